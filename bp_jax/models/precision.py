"""The precision of float32 matmuls (`--config.matmul_precision`), set at decode.py's and
train.py's entry points.

JAX's default lets a float32 matmul on TPU run as bf16 passes and on recent NVIDIA GPUs as TF32
(about 10 bits of mantissa), so float32 runs there would not be the exact computation they are on
CPU. `highest` (the configs' default) asks for full float32 everywhere: then speculative output
is token-identical to AR decoding on every backend (docs/design.md §12). `high` and `default`
trade that for speed. bfloat16 / float16 weights compute in their own dtype whatever this says.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax

from bp_jax.errors import BadInputError

FLAG = "--config.matmul_precision"
# Values of JAX's `jax_default_matmul_precision` offered by the flag, most exact first.
MATMUL_PRECISIONS = ("highest", "high", "default")
DEFAULT = "highest"


def check_matmul_precision(value: Any, flag: str = FLAG) -> str:
  """`value` if it is one of MATMUL_PRECISIONS, else a BadInputError naming `flag`."""
  if value not in MATMUL_PRECISIONS:
    raise BadInputError(f"{flag}={value!r} is not one of {list(MATMUL_PRECISIONS)} (highest = "
                        "full float32 matmuls on every backend, needed for f32 exactness on "
                        "TPU/GPU)")
  return value


def precision_of(cfg: Any) -> str:
  """The checked `matmul_precision` of a config (DEFAULT for configs without the field)."""
  return check_matmul_precision(cfg.get("matmul_precision", DEFAULT))


@contextlib.contextmanager
def matmul_precision(value: str) -> Iterator[str]:
  """Runs the block with JAX's default matmul precision set to `value` (checked); functions
  traced inside compile with it. The previous setting comes back on exit."""
  value = check_matmul_precision(value)
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", value)
  try:
    yield value
  finally:
    jax.config.update("jax_default_matmul_precision", before)
