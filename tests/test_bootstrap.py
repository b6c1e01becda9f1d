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


def test_decode_comparisons_pair_each_prompt_with_its_own_ar_decode():
  """decode.py's --config.compare interval (`compare.speedup_against_ar`): the prompts are
  resampled in pairs, so a method twice as fast on every prompt reads exactly 2x whatever the
  prompts' lengths, where an unpaired resample would spread; one prompt gives no interval."""
  from bp_jax.decode_job.compare import speedup_against_ar
  rs = np.random.default_rng(0)
  secs = rs.uniform(0.05, 2.0, 40)  # prompts of very different lengths
  ar = [{"new_tokens": 128, "decode_s": s} for s in secs]
  fast = [{"new_tokens": 128, "decode_s": s / 2} for s in secs]
  got = speedup_against_ar(fast, ar)
  assert got == {"ratio": 2.0, "lo": 2.0, "hi": 2.0}
  noisy = [{"new_tokens": 128, "decode_s": s * f} for s, f in zip(secs, rs.uniform(0.8, 1.2, 40))]
  got = speedup_against_ar(noisy, ar)
  want = bootstrap_speedup([128] * 40, [r["decode_s"] for r in noisy], [128] * 40, secs,
                           reps=2000, seed=0)
  assert got == {"ratio": round(want.ratio, 4), "lo": round(want.lo, 4), "hi": round(want.hi, 4)}
  assert got["lo"] < got["ratio"] < got["hi"]
  assert speedup_against_ar(fast[:1], ar[:1]) is None
  with pytest.raises(ValueError, match="the same prompts"):
    speedup_against_ar(fast, ar[:3])
  # End to end: each request's prefill joins its decode. A method 2x faster to decode whose
  # prefill costs as much as AR's decode gains nothing there.
  pre = [dict(r, prefill_s=0.0) for r in ar]
  slow_prefill = [dict(r, prefill_s=s / 2) for r, s in zip(fast, secs)]
  assert speedup_against_ar(slow_prefill, pre) == {"ratio": 2.0, "lo": 2.0, "hi": 2.0}
  assert speedup_against_ar(slow_prefill, pre, end_to_end=True) == {
      "ratio": 1.0, "lo": 1.0, "hi": 1.0}
  prefills = rs.uniform(0.01, 0.1, 40)
  got = speedup_against_ar([dict(r, prefill_s=p) for r, p in zip(noisy, prefills)], pre,
                           end_to_end=True)
  want = bootstrap_speedup([128] * 40, [r["decode_s"] + p for r, p in zip(noisy, prefills)],
                           [128] * 40, secs, reps=2000, seed=0)
  assert got == {"ratio": round(want.ratio, 4), "lo": round(want.lo, 4), "hi": round(want.hi, 4)}
