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
  """decode.py's --config.compare interval (`compare.paired_speedup`): the prompts are
  resampled in pairs, so a method twice as fast on every prompt reads exactly 2x whatever the
  prompts' lengths, where an unpaired resample would spread; one prompt gives no interval."""
  from bp_jax.decode_job.compare import paired_speedup
  rs = np.random.default_rng(0)
  secs = rs.uniform(0.05, 2.0, 40)  # prompts of very different lengths
  ar = [{"new_tokens": 128, "decode_s": s} for s in secs]
  fast = [{"new_tokens": 128, "decode_s": s / 2} for s in secs]
  got = paired_speedup(fast, ar)
  assert got == {"ratio": 2.0, "lo": 2.0, "hi": 2.0}
  noisy = [{"new_tokens": 128, "decode_s": s * f} for s, f in zip(secs, rs.uniform(0.8, 1.2, 40))]
  got = paired_speedup(noisy, ar)
  want = bootstrap_speedup([128] * 40, [r["decode_s"] for r in noisy], [128] * 40, secs,
                           reps=2000, seed=0)
  assert got == {"ratio": round(want.ratio, 4), "lo": round(want.lo, 4), "hi": round(want.hi, 4)}
  assert got["lo"] < got["ratio"] < got["hi"]
  assert paired_speedup(fast[:1], ar[:1]) is None
  with pytest.raises(ValueError, match="the same prompts"):
    paired_speedup(fast, ar[:3])
  # End to end: each request's prefill joins its decode. A method 2x faster to decode whose
  # prefill costs as much as AR's decode gains nothing there.
  pre = [dict(r, prefill_s=0.0) for r in ar]
  slow_prefill = [dict(r, prefill_s=s / 2) for r, s in zip(fast, secs)]
  assert paired_speedup(slow_prefill, pre) == {"ratio": 2.0, "lo": 2.0, "hi": 2.0}
  assert paired_speedup(slow_prefill, pre, end_to_end=True) == {
      "ratio": 1.0, "lo": 1.0, "hi": 1.0}
  prefills = rs.uniform(0.01, 0.1, 40)
  got = paired_speedup([dict(r, prefill_s=p) for r, p in zip(noisy, prefills)], pre,
                           end_to_end=True)
  want = bootstrap_speedup([128] * 40, [r["decode_s"] + p for r, p in zip(noisy, prefills)],
                           [128] * 40, secs, reps=2000, seed=0)
  assert got == {"ratio": round(want.ratio, 4), "lo": round(want.lo, 4), "hi": round(want.hi, 4)}


def test_the_best_fixed_size_in_hindsight_is_the_fastest_other_b_k():
  """decode.py's bar for its own method (`compare.best_fixed`, `against_best_fixed`): the
  fastest `b<k>` among the other compared methods, never AR, learned, random or the run's own;
  paired over the prompts at batch 1, the ratio of tokens per second alone in a batch."""
  from bp_jax.decode_job.compare import against_best_fixed, best_fixed, fixed_size, paired_speedup
  assert [fixed_size(m) for m in ("b8", "b12", "ar", "b1", "learned", "random")] == [
      8, 12, None, None, None, None]
  figs = {"ar": {"decode_tokens_per_s": 900.0}, "b4": {"decode_tokens_per_s": 500.0},
          "b8": {"decode_tokens_per_s": 700.0}, "b6": {"decode_tokens_per_s": 650.0},
          "random": {"decode_tokens_per_s": 990.0}}
  assert best_fixed("learned", figs) == "b8"
  assert best_fixed("b8", figs) == "b6"  # the run's own size is not its own bar
  assert best_fixed("learned", {"ar": figs["ar"], "random": figs["random"]}) is None
  rs = np.random.default_rng(1)
  secs = rs.uniform(0.05, 2.0, 30)
  best = [{"new_tokens": 128, "decode_s": s, "prefill_s": 0.1} for s in secs]
  main = [{"new_tokens": 128, "decode_s": s * f, "prefill_s": 0.2}
          for s, f in zip(secs, rs.uniform(0.9, 1.05, 30))]
  got = against_best_fixed({"method": "learned"}, {"method": "b8"}, main, best, batch_size=1)
  assert got["method"] == "b8"
  assert got["decode"] == paired_speedup(main, best)
  assert got["end_to_end"] == paired_speedup(main, best, end_to_end=True)
  assert got["end_to_end"]["ratio"] < got["decode"]["ratio"]  # its dearer prefill
  speeds = lambda d, t: {"decode_tokens_per_s": d, "tokens_per_s": t}
  got = against_best_fixed({"method": "learned", **speeds(990.0, 800.0)},
                           {"method": "b8", **speeds(1000.0, 1000.0)}, main, best, batch_size=4)
  assert got == {"method": "b8", "decode": {"ratio": 0.99, "lo": None, "hi": None},
                 "end_to_end": {"ratio": 0.8, "lo": None, "hi": None}}
