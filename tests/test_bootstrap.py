"""bp_jax/eval/bootstrap.py: paired bootstrap intervals of throughput ratios over prompts."""

from __future__ import annotations

import numpy as np
import pytest

from bp_jax.errors import BadInputError
from bp_jax.eval.bootstrap import bootstrap_ratio_ci, bootstrap_speedup


def test_bootstrap_identical_methods_give_exactly_one():
  rng = np.random.default_rng(0)
  tok, sec = rng.integers(10, 100, 50), rng.uniform(0.5, 2.0, 50)
  sp = bootstrap_speedup(tok, sec, tok, sec, reps=500)
  assert sp.ratio == sp.lo == sp.hi == 1.0


def test_bootstrap_known_speedups():
  rng = np.random.default_rng(1)
  tok, sec = rng.integers(10, 100, 40), rng.uniform(0.5, 2.0, 40)
  sp = bootstrap_speedup(tok, sec / 2, tok, sec, reps=500)  # a takes half the time everywhere
  assert sp.ratio == pytest.approx(2.0) and sp.lo == pytest.approx(2.0)
  assert sp.hi == pytest.approx(2.0)
  # Ratio of sums, not mean of ratios: one long prompt dominates.
  sp = bootstrap_speedup([10, 1000], [1.0, 100.0], [10, 1000], [2.0, 100.0], reps=200)
  assert sp.ratio == pytest.approx((1010 / 101) / (1010 / 102))
  ratio = bootstrap_ratio_ci([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], reps=200)
  assert ratio.ratio == pytest.approx(0.5) and ratio.lo == pytest.approx(0.5)


def test_bootstrap_interval_covers_the_truth_on_noise():
  """Per-prompt seconds with multiplicative noise around a true 1.25x speedup: the 90% interval
  covers 1.25 in most of 200 synthetic experiments (and is not trivially wide)."""
  truth, hits, widths = 1.25, 0, []
  for trial in range(200):
    rng = np.random.default_rng(100 + trial)
    tok = rng.integers(20, 200, 60).astype(float)
    base = tok / rng.uniform(5, 15, 60)  # per-prompt speed varies
    sec_b = base * np.exp(rng.normal(0, 0.3, 60))
    sec_a = base / truth * np.exp(rng.normal(0, 0.3, 60))
    sp = bootstrap_speedup(tok, sec_a, tok, sec_b, reps=400, seed=trial, level=0.9)
    hits += sp.lo <= truth <= sp.hi
    widths.append(sp.hi - sp.lo)
  assert 0.8 <= hits / 200 <= 0.98, hits
  assert np.median(widths) < 0.4


def test_bootstrap_bad_input_is_refused():
  with pytest.raises(BadInputError, match="lengths"):
    bootstrap_speedup([1, 2], [1, 1], [1], [1])
  with pytest.raises(BadInputError, match="secs_a"):
    bootstrap_speedup([1], [-1], [1], [1])
  with pytest.raises(BadInputError, match="level"):
    bootstrap_speedup([1], [1], [1], [1], level=1.0)
