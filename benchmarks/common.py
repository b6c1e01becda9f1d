"""What the benchmarks share: their common flags, defined once; loading the demo's models and
prompt sets; the command line and the result files they record.

Run a benchmark as a module from the repository root (`python -m benchmarks.batch_decode
...`), or anywhere once the package is installed (`pip install -e .`); nothing edits sys.path.
A benchmark uses it like this:

  from absl import flags
  from benchmarks import common
  from bp_jax import cli

  common.define_flags("target", "drafter", "max_len", num_prompts=16,         # defaults
                      helps={"num_prompts": "Held-out prompts decoded (0 = all)."})
  flags.DEFINE_string("out", "out/my_bench", "Output folder (JSON, Markdown).")
  FLAGS = flags.FLAGS

  def main(_):
    models = common.load_models(FLAGS)      # .target .drafter .tokenizer .stop_ids, float32
    prompts = common.demo_prompts(models.tokenizer, "eval", limit=FLAGS.num_prompts)
    ...
    common.write_json(os.path.join(FLAGS.out, "my_bench.json"),
                      {"command": common.command_line(), "rows": rows})

  if __name__ == "__main__":
    cli.run(main, __doc__)                  # as app.run, but --help exits 0

  define_flags(*names, helps=None, **defaults)  the named COMMON_FLAGS as the calling script's
      own (its --help lists them); a keyword also sets a default; `helps` narrows a help text.
  load_models(F, drafter=True, dtype=None, tokenizer=True) -> Models(target, drafter,
      tokenizer, stop_ids) from the --target / --drafter flags (dtype: the --dtype flag where
      the script has one, else float32).
  demo_prompts(tok, half="eval", skip=0, limit=0) -> [(key, token ids)]  a half of
      configs/demo.py's HumanEval split: "eval" (held out: never labelled on) or "label".
  command_line() -> "python -m benchmarks.NAME <the arguments given>"
  by_verify_length(counts) -> {"ar": n, "k=7": n, ...}  target forwards keyed by
      `Generation.forward_verified` values, labelled by what they verified.
  write_json(path, obj, indent=2), write_text(path, text)  a result file, its folder made first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from absl import flags

# name -> (absl definer, default, help): the flags most benchmarks take.
COMMON_FLAGS: dict[str, tuple[Any, Any, str]] = {
    "target": (flags.DEFINE_string, "demo/target", "Target checkpoint folder."),
    "drafter": (flags.DEFINE_string, "demo/drafter", "DFlash drafter checkpoint folder."),
    "dtype": (flags.DEFINE_string, "float32",
              "Dtype the weights are loaded in (float32, bfloat16, float16)."),
    "max_len": (flags.DEFINE_integer, 640, "KV cache slots per request (the demo's max_len)."),
    "max_new_tokens": (flags.DEFINE_integer, 128, "New tokens per prompt."),
    "num_prompts": (flags.DEFINE_integer, 0,
                    "Prompts decoded, the first N of the script's set (0 = all)."),
    "block_size": (flags.DEFINE_integer, 8, "Block size of the speculative runs."),
    "repeats": (flags.DEFINE_integer, 2, "Timed repetitions; the fastest is kept."),
}


def define_flags(*names: str, helps: Mapping[str, str] | None = None, **defaults: Any) -> None:
  """Defines the named common flags (`COMMON_FLAGS`) as the calling script's own (its --help
  lists them); keyword arguments change a default or add a common flag with that default;
  `helps` gives a flag a narrower help text where the script means something narrower."""
  caller = sys._getframe(1).f_globals.get("__name__", "__main__")
  module = sys.argv[0] if caller == "__main__" else caller  # absl's key for the main module
  helps = dict(helps or {})
  chosen = tuple(dict.fromkeys(names + tuple(defaults)))
  for name in (*chosen, *helps):
    if name not in COMMON_FLAGS or name not in chosen:
      raise KeyError(f"{name!r} is not a common benchmark flag defined here "
                     f"({', '.join(COMMON_FLAGS)})")
  for name in chosen:
    define, default, help_text = COMMON_FLAGS[name]
    define(name, defaults.get(name, default), helps.get(name, help_text))
    flags.FLAGS.register_flag_by_module(module, flags.FLAGS[name])


class Models(NamedTuple):
  """What a benchmark decodes with."""
  target: Any          # bp_jax.models.qwen3.Qwen3
  drafter: Any         # bp_jax.models.dflash.DFlashDrafter, or None
  tokenizer: Any       # the target's tokenizer, or None
  stop_ids: list[int]  # the tokenizer's stop tokens ([] without one)


def load_models(F, drafter: bool = True, dtype: str | None = None,
                tokenizer: bool = True) -> Models:
  """The target of the `target` flag, the drafter of the `drafter` flag (if `drafter`) and the
  target's tokenizer (if `tokenizer`), weights in `dtype` (default: the `dtype` flag when
  defined, else float32)."""
  from bp_jax.text.tokenizer import load_tokenizer, stop_token_ids
  from bp_jax.weights.loading import load_drafter, load_target
  dtype = dtype or (F.dtype if "dtype" in F else "float32")
  target = load_target(F.target, dtype)
  draft = load_drafter(F.drafter, target.cfg, dtype) if drafter else None
  tok = load_tokenizer(F.target) if tokenizer else None
  return Models(target, draft, tok, stop_token_ids(tok) if tok is not None else [])


def demo_prompt_set(tok, half: str = "eval", skip: int = 0, limit: int = 0) -> list:
  """The prompts (`key`, `text`) of one half of configs/demo.py's HumanEval split: "eval" (the
  BlockPilot evaluation half, never labelled on) or "label" (its HumanEval prompts); those after
  the first `skip`, the first `limit` of them (0 = all)."""
  from configs import demo
  from bp_jax.train.labels import prompt_sets
  if half not in ("eval", "label"):
    raise ValueError(f"half={half!r}: give eval or label")
  cfg = demo.get_config()
  # The labelling set's corpus windows are not HumanEval's (filtered out below): not cut here
  # (tokenizing their ~500 documents took ~4 s of every benchmark run on the demo).
  cfg.blockpilot.corpus_prompts = 0
  label, evals = prompt_sets(cfg, tok)
  source = str(cfg.blockpilot.eval_source)
  chosen = [p for p in (evals if half == "eval" else label) if p.source == source][skip:]
  return chosen[:limit] if limit > 0 else chosen


def demo_prompts(tok, half: str = "eval", skip: int = 0,
                 limit: int = 0) -> list[tuple[str, list[int]]]:
  """(key, token ids) of `demo_prompt_set`'s prompts."""
  from bp_jax.text.tokenizer import encode_prompt
  return [(p.key, encode_prompt(tok, p.text, False))
          for p in demo_prompt_set(tok, half, skip, limit)]


def by_verify_length(counts: Mapping[int, int]) -> dict[str, int]:
  """Target forwards counted by `Generation.forward_verified` value, labelled by what they
  verified: "ar" (an AR step, no drafter pass) and "k=n" (n drafts after a drafter pass), in
  that order."""
  from bp_jax.decoding.generation import verify_label
  return {verify_label(v): c for v, c in sorted(counts.items())}


def command_line() -> str:
  """The command that ran this benchmark: `python -m benchmarks.NAME <the arguments given>`
  (`python <script> ...` for a script run by its path)."""
  spec = getattr(sys.modules["__main__"], "__spec__", None)
  program = f"-m {spec.name}" if spec is not None else sys.argv[0]
  return " ".join(["python", program, *sys.argv[1:]])


def _parent_made(path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def mean_ms(fn, args: tuple, reps: int) -> float:
  """Mean milliseconds of `reps` calls of `fn` jitted (after one untimed call: compilation)."""
  import jax

  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - t0) / reps


def write_json(path: str, obj: Any, indent: int | None = 2) -> None:
  """Writes `obj` to `path` as JSON, making its folder first."""
  with open(_parent_made(path), "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=indent)


def write_text(path: str, text: str) -> None:
  """Writes `text` to `path`, making its folder first."""
  with open(_parent_made(path), "w", encoding="utf-8") as f:
    f.write(text)
