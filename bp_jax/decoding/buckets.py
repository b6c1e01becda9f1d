"""Static-shape buckets: prompt lengths are padded up to one of a few sizes."""

from __future__ import annotations

from typing import Sequence

from bp_jax.errors import BadInputError


def default_length_buckets(max_len: int, smallest: int = 32) -> tuple[int, ...]:
  """Powers of two from `smallest` up to and including `max_len`."""
  out, b = [], smallest
  while b < max_len:
    out.append(b)
    b *= 2
  out.append(max_len)
  return tuple(out)


def pick_bucket(n: int, buckets: Sequence[int], what: str = "prompt length",
                flag: str = "--config.length_buckets") -> int:
  """The smallest bucket >= n, or a clear error."""
  for b in sorted(buckets):
    if n <= b:
      return b
  raise BadInputError(f"{what} {n} exceeds the largest bucket {max(buckets)} ({flag})")
