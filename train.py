"""Trains the embedded demo (or any configured run) stage by stage.

  python train.py                                    # every stage of configs/demo.py
  python train.py --config.stage=tokenizer,lm_data,lm --config.workdir=runs/demo
  python train.py --config configs/demo.py --config.lm.steps=20 --config.workdir=/tmp/smoke

Stages (in the order `all` runs them): tokenizer, lm_data, lm, regenerate, draft. Each reads its
inputs from --config.workdir; training stages resume from their latest checkpoint there. A run
locks its workdir (<workdir>/.lock): a second run on the same workdir stops at once, naming the
first. Compiled programs are cached on disk (--config.compile_cache, default ~/.cache/bp_jax/jax).
"""

import sys

from absl import app, logging
from ml_collections import config_flags

from bp_jax import cli

cli.check_config_fields("configs/demo.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Training config file; override any field with "
    "--config.<field>=value, e.g. --config.stage=lm --config.lm.steps=100 (see the file for "
    "the fields and what each means).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from bp_jax import compile_cache
  from bp_jax.train import stages
  cfg = _CONFIG.value
  compile_cache.enable(cfg.get("compile_cache", compile_cache.DEFAULT))
  stages.run_stages(cfg, " ".join(sys.argv))  # a BadInputError: one line (`cli.run`)


if __name__ == "__main__":
  cli.run(main, __doc__, "configs/demo.py")
