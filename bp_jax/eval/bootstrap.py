"""Bootstrap confidence intervals of throughput ratios over prompts.

Throughput of a method over a prompt set is a ratio of sums, total tokens / total seconds, so
the speedup of method a over method b on the same prompts is

  speedup = (sum_n tok_a[n] / sum_n sec_a[n]) / (sum_n tok_b[n] / sum_n sec_b[n]).

Its percentile interval resamples prompts with replacement, the same prompt indices for both
methods (the comparison is paired: a prompt that is slow for one is usually slow for the other).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from bp_jax.errors import BadInputError


class Speedup(NamedTuple):
  """A speedup of a over b and its percentile bootstrap interval."""
  ratio: float
  lo: float
  hi: float


def _vector(name: str, v) -> np.ndarray:
  a = np.asarray(v, np.float64)
  if a.ndim != 1 or not np.isfinite(a).all() or (a < 0).any():
    raise BadInputError(f"bootstrap: {name} must be a 1-d array of finite values >= 0, got "
                        f"shape {a.shape}")
  return a


def _ratio(tokens_a_RN, secs_a_RN, tokens_b_RN, secs_b_RN) -> np.ndarray:
  """[R] speedups of the R rows of resampled per-prompt figures."""
  rate_a = tokens_a_RN.sum(-1) / np.maximum(secs_a_RN.sum(-1), 1e-300)
  rate_b = tokens_b_RN.sum(-1) / np.maximum(secs_b_RN.sum(-1), 1e-300)
  return rate_a / np.maximum(rate_b, 1e-300)


def bootstrap_speedup(tokens_a, secs_a, tokens_b, secs_b, reps: int = 2000, seed: int = 0,
                      level: float = 0.95) -> Speedup:
  """Speedup of method a over method b (module docstring) over N prompts, with the central
  `level` percentile interval of `reps` paired bootstrap resamples of the prompts.

  Args:
    tokens_a, secs_a, tokens_b, secs_b: [N] per-prompt tokens and seconds of each method.
    reps: bootstrap resamples (>= 1); seed: their generator's seed; level: in (0, 1).

  Raises:
    BadInputError: arrays of other shapes or lengths, negative or non-finite values, no
      prompts, zero total seconds or tokens of b, reps < 1 or level outside (0, 1).
  """
  ta, sa, tb, sb = (_vector(n, v) for n, v in (("tokens_a", tokens_a), ("secs_a", secs_a),
                                               ("tokens_b", tokens_b), ("secs_b", secs_b)))
  N = len(ta)
  if N == 0 or any(len(v) != N for v in (sa, tb, sb)):
    lengths = [len(v) for v in (ta, sa, tb, sb)]
    raise BadInputError(f"bootstrap: per-prompt arrays of lengths {lengths}; they must be equal "
                        "and non-empty")
  if sa.sum() <= 0 or sb.sum() <= 0 or tb.sum() <= 0:
    raise BadInputError("bootstrap: the seconds of both methods and the tokens of b must not "
                        "sum to zero")
  if int(reps) < 1 or not 0.0 < float(level) < 1.0:
    raise BadInputError(f"bootstrap: reps={reps} must be >= 1 and level={level} in (0, 1)")
  ratio = float(_ratio(ta, sa, tb, sb))
  idx_RN = np.random.default_rng(int(seed)).integers(0, N, size=(int(reps), N))
  boot_R = _ratio(ta[idx_RN], sa[idx_RN], tb[idx_RN], sb[idx_RN])
  tail = 100.0 * (1.0 - float(level)) / 2.0
  lo, hi = np.percentile(boot_R, [tail, 100.0 - tail])
  return Speedup(ratio, float(lo), float(hi))


def speedup_entry(tokens_a, secs_a, tokens_b, secs_b, reps: int = 2000) -> dict:
  """`bootstrap_speedup` as a report's entry: {"ratio", "lo", "hi"} rounded to 4 places, the
  interval None from a single prompt (or group), which has none."""
  s = bootstrap_speedup(tokens_a, secs_a, tokens_b, secs_b, reps=reps)
  one = len(tokens_a) < 2
  return {"ratio": round(s.ratio, 4), "lo": None if one else round(s.lo, 4),
          "hi": None if one else round(s.hi, 4)}


def bootstrap_ratio_ci(a_N, b_N, reps: int = 2000, seed: int = 0,
                       level: float = 0.95) -> Speedup:
  """Ratio of sums sum(a) / sum(b) over N prompts with its paired percentile interval (e.g.
  a = seconds of one method, b = of another, on the same prompts)."""
  a, b = _vector("a_N", a_N), _vector("b_N", b_N)
  ones = np.ones_like(a)
  # sum(a) / sum(b) = (sum a / sum 1) / (sum b / sum 1): a speedup with unit seconds.
  return bootstrap_speedup(a, ones, b, np.ones_like(b), reps, seed, level)
