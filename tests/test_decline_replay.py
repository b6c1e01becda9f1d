"""The decline's replay (`benchmarks/replay.py`, `benchmarks/decline_replay.py`) on made-up
acceptances: where the drafter's expectation tells poor positions from good ones, the simulated
back-off gains from the decline at a CPU's prices and the per-cycle oracle bounds both; at an
accelerator's prices a drafter that expects little still declines nothing it should not."""

from __future__ import annotations

import numpy as np

from benchmarks.replay import accepted_and_expected, oracle, simulate

CPU, ACCELERATOR = (1.26, 2.62), (0.3, 1.2)


def _prompts(num: int = 12, length: int = 128) -> list[tuple[np.ndarray, np.ndarray]]:
  """Prompts whose positions come in runs of 16: good (7 drafts accepted, 5.5 expected) or poor
  (none accepted, 0.2 expected)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(num):
    good = np.repeat(rng.random(length // 16) < 0.5, 16)
    out.append((np.where(good, 7, 0), np.where(good, 5.5, 0.2)))
  return out


def test_the_decline_gains_where_the_expectation_tells_and_the_oracle_bounds_it():
  prompts = _prompts()
  base = simulate(prompts, *CPU, cap=64, declines=False)
  new = simulate(prompts, *CPU, cap=64, declines=True)
  assert base["declined"] == 0 and new["declined"] > 0
  assert new["tokens_per_ar_step"] > 1.02 * base["tokens_per_ar_step"]
  assert oracle(prompts, *CPU) >= new["tokens_per_ar_step"]
  # A drafter whose expectation says nothing (the same everywhere) is read at its measured rate:
  # at an accelerator's prices the mean acceptance pays, and nothing declines.
  flat = [(a, np.full_like(e, 0.01)) for a, e in prompts]
  assert simulate(flat, *ACCELERATOR, cap=64, declines=True)["declined"] == 0


def test_accepted_and_expected_read_the_leading_run_and_the_calibration():
  p = np.asarray([[0.5, 0.5, 0.5], [0.9, 0.1, 0.9]])
  hit = np.asarray([[True, False, True], [True, True, True]])
  accepted, expected = accepted_and_expected(p, hit)
  assert accepted.tolist() == [1, 3]
  np.testing.assert_allclose(expected, [0.875, 0.9 + 0.09 + 0.081])
  # A calibration whose rates are all 1: every draft expected.
  _, sure = accepted_and_expected(p, hit, rates=[1.0] * 4)
  np.testing.assert_allclose(sure, [3.0, 3.0])
