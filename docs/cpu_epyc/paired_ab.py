"""The alternated A/B timing the probes here share: two engines decode the same prompts, the
engines taking turns per round (alternating which goes first), round 0 untimed; the ratio of
the first's time per request to the second's, paired by request, with a 95% bootstrap
interval."""

import time
from typing import Callable, Sequence

import numpy as np


def paired_ratio(decode: dict[str, Callable[[list], object]], prompts: Sequence[list],
                 rounds: int, new_tokens: int) -> str:
  """`decode`: two names, each a function decoding one prompt. Times `rounds` rounds after a
  warm-up one; returns a line with each side's median ms per token and first / second."""
  first, second = decode
  times = {first: [], second: []}
  for r in range(rounds + 1):
    for name in ((first, second) if r % 2 else (second, first)):
      for p in prompts:
        t0 = time.perf_counter()
        decode[name](p)
        if r:
          times[name].append(time.perf_counter() - t0)
  a, b = np.asarray(times[first]), np.asarray(times[second])
  draws = np.random.default_rng(1).integers(0, len(a), (2000, len(a)))
  boot = [np.median(a[i] / b[i]) for i in draws]
  return (f"{second} {1e3 * np.median(b) / new_tokens:.3f} ms/token, {first} "
          f"{1e3 * np.median(a) / new_tokens:.3f} ms/token; {first} / {second} "
          f"{np.median(a / b):.3f} [{np.percentile(boot, 2.5):.3f}, "
          f"{np.percentile(boot, 97.5):.3f}]")
