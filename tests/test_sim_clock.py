"""benchmarks/sim_clock.SimClock: a simulated device's clock charges an engine's target
forwards at a cost table's prices, call by call, with noise and stalls; and the engine's online
prices fitted through it (a batch holding a stalled call out, as on a device)."""

import collections

import numpy as np
import pytest

from benchmarks.sim_clock import SimClock
from bp_jax.decoding.online_costs import OnlineCosts

COSTS, DRAFT = (1.0, 1.02, 1.08, 1.13, 1.30), 0.26  # an H200's batch-4 table at Qwen3-4B shapes


class _Engine:
  def __init__(self):
    self.forwards_run = collections.Counter()


def _call(clock: SimClock, engine: _Engine, n_ar: int, n_cycle: int) -> float:
  """One loop call as `Engine.loop_ran` books it: the reading before, the forwards counted,
  the reading after."""
  t0 = clock()
  engine.forwards_run[0] += n_ar
  engine.forwards_run[16] += n_cycle
  return clock() - t0


def test_charges_the_tables_prices_per_forward_without_noise():
  eng = _Engine()
  clock = SimClock(eng, COSTS, DRAFT, ar_ms=3.0)
  assert clock() == 0.0  # nothing run yet
  assert _call(clock, eng, 2, 10) == pytest.approx(3e-3 * (2 + 10 * (1.30 + 0.26)))
  assert clock() == clock()  # a reading with nothing new does not move it
  assert clock.price_s(1) == pytest.approx(3e-3 * (1.0 + 0.26))
  assert clock.price_s(3) == pytest.approx(3e-3 * (1.05 + 0.26))  # between 2 and 4 tokens


def test_noise_and_stalls_hit_the_calls_they_name():
  eng = _Engine()
  clock = SimClock(eng, COSTS, DRAFT, ar_ms=3.0, noise=0.03, stall_s=0.15, stall_every=4)
  base = 3e-3 * (1 + 20 * 1.56)
  secs = [_call(clock, eng, 1, 20) for _ in range(8)]
  stalled = [s for i, s in enumerate(secs) if (i + 1) % 4 == 0]
  plain = [s for i, s in enumerate(secs) if (i + 1) % 4]
  assert all(abs(s / base - 1) < 0.15 for s in plain) and len(set(plain)) == len(plain)
  assert all(s - base == pytest.approx(0.15, abs=0.02) for s in stalled)
  with pytest.raises(ValueError, match="ar_ms"):
    SimClock(eng, COSTS, DRAFT, ar_ms=0.0)


def test_a_batchs_prices_through_it_hold_the_stalled_calls_out():
  """Batch-4 calls (0-3 AR steps, 10-30 cycles) timed by the clock, one in 6 stalled 0.15 s:
  fitted at once, the break-even of a cycle priced 1.56 AR steps rises far above the ~6 tokens
  a cycle commits (every cycle a miss: every miss backs off, `evidence.cycles_lose`; it reached
  the cap, 64, before a fit that prices the AR step at or below zero kept its shape); held out
  until a call like it says, it stays below that, its median near the table's (the fit's own
  swings: few AR steps tell an AR step's price from a cycle's poorly)."""
  rng = np.random.default_rng(1)
  shapes = [(int(rng.integers(0, 4)), int(rng.integers(10, 30))) for _ in range(30)]
  prior = lambda n: 1.0 + 0.3005 + 0.2565 if n == 16 else 1.0
  seen = {}
  for hold in (True, False):
    eng = _Engine()
    clock = SimClock(eng, COSTS, DRAFT, ar_ms=3.38, noise=0.03, stall_s=0.15, stall_every=6)
    prices = OnlineCosts(prior, batch_prior_floor=1.0, hold_outliers=hold)
    seen[hold] = []
    for n_ar, n_cycle in shapes:
      counts = np.zeros(17)
      counts[0], counts[16] = n_ar, n_cycle
      prices.observe(_call(clock, eng, n_ar, n_cycle), counts, rows=4)
      seen[hold].append(prices.break_even(16, rows=4))
  assert max(seen[False]) > 12.0, seen[False]
  assert np.median(seen[True]) < 1.9 and max(seen[True]) < 6.0, seen[True]


def test_charges_the_forwards_run_after_the_engines_tallies_were_cleared():
  """`Engine.clear_tallies` (after a benchmark's warm-up) empties the engine's counts: the
  forwards run after it are charged from zero, not from what the warm-up had charged (the
  first timed calls after a warm-up ran free before)."""
  eng = _Engine()
  clock = SimClock(eng, COSTS, DRAFT, ar_ms=3.0)
  assert _call(clock, eng, 5, 20) > 0
  eng.forwards_run.clear()
  assert _call(clock, eng, 2, 0) == pytest.approx(3e-3 * 2)
  assert _call(clock, eng, 0, 1) == pytest.approx(3e-3 * (1.30 + 0.26))
