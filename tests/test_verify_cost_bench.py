"""benchmarks/verify_cost.py at a tiny shape: the timing of the verify rules' sampling cannot
rot (both rules, untruncated and truncated settings, propose and verify each timed)."""

from __future__ import annotations

from benchmarks import verify_cost


def test_times_both_rules_with_and_without_truncation():
  report = verify_cost.measure(B=2, b=3, V=32, top_k=4, top_p=0.9, reps=1)
  assert set(report) == {"exact", "rejection"}
  for by in report.values():
    assert list(by) == ["T=1", "T=1, top_k 4, top_p 0.9"]
    for t in by.values():
      assert t["propose_ms"] > 0 and t["verify_ms"] > 0
