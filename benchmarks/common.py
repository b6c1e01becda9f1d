"""What the benchmarks share: their common flags, defined once, and loading the demo's models.

Run a benchmark as a module from the repository root (`python -m benchmarks.batch_decode
...`), or anywhere once the package is installed (`pip install -e .`).

  from benchmarks import common
  common.define_flags("target", "drafter", "max_len", max_new_tokens=64)  # defaults overridable
  target, drafter = common.load_models(flags.FLAGS)                        # after app.run parses
"""

from __future__ import annotations

import sys
from typing import Any

from absl import flags

# name -> (absl definer, default, help): the flags most benchmarks take.
COMMON_FLAGS: dict[str, tuple[Any, Any, str]] = {
    "target": (flags.DEFINE_string, "demo/target", "Target checkpoint folder."),
    "drafter": (flags.DEFINE_string, "demo/drafter", "DFlash drafter checkpoint folder."),
    "dtype": (flags.DEFINE_string, "float32",
              "Dtype the weights are loaded in (float32, bfloat16, float16)."),
    "max_len": (flags.DEFINE_integer, 640, "KV cache slots per request (the demo's max_len)."),
    "max_new_tokens": (flags.DEFINE_integer, 128, "New tokens per prompt."),
    "num_prompts": (flags.DEFINE_integer, 0, "Prompts decoded, the first N of the script's set (0 = all)."),
    "block_size": (flags.DEFINE_integer, 8, "Block size of the speculative runs."),
    "repeats": (flags.DEFINE_integer, 2, "Timed repetitions; the fastest is kept."),
}


def define_flags(*names: str, **defaults: Any) -> None:
  """Defines the named common flags (`COMMON_FLAGS`) as the calling script's own (its --help
  lists them); keyword arguments change a default or add a common flag with that default."""
  caller = sys._getframe(1).f_globals.get("__name__", "__main__")
  module = sys.argv[0] if caller == "__main__" else caller  # absl's key for the main module
  for name in dict.fromkeys(names + tuple(defaults)):
    if name not in COMMON_FLAGS:
      raise KeyError(f"{name!r} is not a common benchmark flag ({', '.join(COMMON_FLAGS)})")
    define, default, help_text = COMMON_FLAGS[name]
    define(name, defaults.get(name, default), help_text)
    flags.FLAGS.register_flag_by_module(module, flags.FLAGS[name])


def load_models(F, drafter: bool = True, dtype: str | None = None) -> tuple:
  """(target, drafter or None) from the `target` / `drafter` flags, in `dtype` (default: the
  `dtype` flag when defined, else float32)."""
  from bp_jax.weights.loading import load_drafter, load_target
  dtype = dtype or (F.dtype if "dtype" in F else "float32")
  target = load_target(F.target, dtype)
  return target, (load_drafter(F.drafter, target.cfg, dtype) if drafter else None)
