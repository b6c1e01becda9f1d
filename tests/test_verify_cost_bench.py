"""benchmarks/verify_cost.py at a tiny shape: the timing of the verify rules' sampling cannot
rot (both rules, untruncated and truncated settings, propose and verify each timed, the
truncation with the candidates and without)."""

from __future__ import annotations

import jax
import numpy as np

from benchmarks import verify_cost
from bp_jax.decoding import sampling
from bp_jax.decoding.sampling import processed_logits, sampling_params


def test_times_both_rules_with_and_without_truncation():
  report = verify_cost.measure(B=2, b=3, V=32, top_k=4, top_p=0.9, reps=1,
                               candidates=(sampling.TOP_CANDIDATES, 8, 0))
  assert set(report) == {"exact", "rejection"}
  for by in report.values():
    assert list(by) == ["T=1", "T=1, top_k 4, top_p 0.9", "T=1, top_k 4, top_p 0.9, 8 candidates",
                        "T=1, top_k 4, top_p 0.9, bisection only"]
    for t in by.values():
      assert t["propose_ms"] > 0 and t["verify_ms"] > 0
  assert sampling.TOP_CANDIDATES == 64  # restored


def test_bisecting_every_row_keeps_the_same_tokens(monkeypatch):
  """`TOP_CANDIDATES = 0` (the benchmark's comparison) bisects every row: the same processed
  logits as reading the thresholds off the candidates."""
  x = 3.0 * jax.random.normal(jax.random.key(6), (4, 5, 200))
  sp = sampling_params(0.8, 20, 0.9)
  want = np.asarray(processed_logits(x, sp))
  monkeypatch.setattr(sampling, "TOP_CANDIDATES", 0)
  got = np.asarray(processed_logits(x, sp))
  np.testing.assert_array_equal(got, want)
