"""Decodes a prompt set with a Qwen3 target, plainly (mode=ar) or speculatively with a DFlash
drafter (mode=spec). With no flags it runs the shipped demo (configs/demo.py).

  python decode.py
  python decode.py --config configs/qwen3_dflash.py --config.target ckpt/qwen3-4b \
      --config.drafter ckpt/dflash-4b --config.prompts humaneval --config.num_prompts 20
"""

from absl import app, logging
from ml_collections import config_flags

from bp_jax import cli

cli.check_config_fields("configs/demo.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Decoding config file; override any field with "
    "--config.<field>=value (see the file for the fields).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from bp_jax.decode_job import run as run_decode
  cfg = _CONFIG.value
  _, summary = run_decode.run(cfg)  # a BadInputError: one line (`cli.run`)
  run_decode.print_summary(summary)
  print(f"records: {cfg.output}\nsummary: {cfg.output}.summary.json")


if __name__ == "__main__":
  cli.run(main, __doc__, "configs/demo.py")
