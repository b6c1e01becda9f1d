"""The priced controller's costs kept current from the engine's timed loop calls
(`decoding/online_costs.py`, `LoopState.break_even_N`).

The estimator alone: it recovers known per-forward costs from (forward counts, seconds) calls,
follows a step change within a few calls, keeps its prior's ratio where the calls cannot tell
it (one kind of forward only) and ignores calls without forwards or time. The engine with a
fake clock (time passes as its forwards run, at prices the test sets): making cycles dearer mid-run
raises the break-even and the loop then takes more AR steps, cheaper lowers it, within a few
loop calls, with no compilation, on the one-request path and the batched one; greedy outputs
stay AR's throughout.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from bp_jax.decoding.online_costs import (MIN_CALLS, PLAIN_FLOOR_CALLS, SIZE_PRICE_CALLS,
                                           OnlineCosts)
from bp_jax.errors import BadInputError
from compile_counting import BackendCompiles
from toy_models import toy_engine, toy_requests, zeros_drafter_pair

V, B = 64, 4
N = B  # a priced cycle of block size 4 verifies 3 drafts: forwards over N = 4 tokens
# Given start-up costs: a b=4 cycle costs 1.2 AR steps (an accelerator's prices).
CHEAP = dict(controller_costs="1,1.05,1.1", controller_draft_cost=0.1)
AR_S = 1e-3  # the fake clock's seconds per AR step


def _calls(num: int, seed: int = 0) -> list[tuple[int, int]]:
  """(AR steps, cycles) of `num` loop calls that mix them in varied proportions."""
  rng = np.random.default_rng(seed)
  return [(int(rng.integers(0, 40)), int(rng.integers(1, 40))) for _ in range(num)]


def _counts(n_ar: int, n_cycle: int) -> list[int]:
  counts = [0] * (N + 1)
  counts[0], counts[N] = n_ar, n_cycle
  return counts


# -- the estimator ------------------------------------------------------------------------------
def test_the_version_counts_what_reached_the_prices():
  """`OnlineCosts.version` moves with every call taken and floor set, not with a call that
  taught nothing (no forwards, or no positive time)."""
  costs = OnlineCosts(lambda n: 1.0 + 0.1 * n)
  assert costs.version == 0
  assert costs.observe(0.01, [3, 0, 1], 2) and costs.version == 1
  assert not costs.observe(0.01, [0, 0, 0], 2) and not costs.observe(0.0, [3, 0, 1], 2)
  assert costs.observe_plain(0.01, 4, 2) and costs.version == 2
  assert not costs.observe_plain(0.01, 0, 2) and costs.version == 2
  costs.set_ar_step_floor(1e-3, 2)
  assert costs.version == 3


def test_the_plain_loops_steps_price_a_batchs_start():
  """A batch's start weighs a cycle against the plain AR loop's step (`start_break_even`): the
  speculative loop's own break-even until plain calls are seen at that batch size, then the
  cycle's seconds over the plain step's (here 5 ms against 1.25 ms: 4 plain steps, where the
  speculative loop's dearer AR steps make it 5 / 2 = 2.5). Plain calls without steps or time
  teach nothing; each batch size keeps its own."""
  est = OnlineCosts(lambda n: 3.0)
  for n_ar, n_cycle in _calls(12):
    est.observe(2 * AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=8)
  assert est.plain_step_s(8) is None
  assert est.break_even(N, 8) == pytest.approx(2.5, rel=0.02)
  assert est.start_break_even(N, 8) == pytest.approx(est.break_even(N, 8))
  assert not est.observe_plain(0.0, 16, rows=8) and not est.observe_plain(0.02, 0, rows=8)
  for _ in range(3):
    assert est.observe_plain(16 * 1.25 * AR_S, 16, rows=8)
  assert est.plain_step_s(8) == pytest.approx(1.25 * AR_S)
  assert est.start_break_even(N, 8) == pytest.approx(4.0, rel=0.02)
  assert est.plain_step_s(4) is None and est.start_break_even(N, 4) == pytest.approx(3.0)
  e = est.estimate(8).to_json()
  assert e["plain_step_s"] == pytest.approx(1.25 * AR_S)
  assert e["start_break_even"][str(N)] == pytest.approx(4.0, rel=0.02)


def test_a_batchs_price_before_the_plain_loop_is_timed_may_take_the_start_up_forward():
  """`start_break_even(forward_prior=True)`: until a plain call is timed at a batch size, the
  cycle's seconds over the start-up one-token forward measured at exactly that size (5 ms over
  1 ms: 5 forwards, where the speculative loop's own price in its AR steps reads 2.5); the
  plain loop's own step once timed (4); the loop's own price where no forward was measured at
  that size (one at a larger size is no plain step's prior) or no loop call priced the cycle
  (`forward_priced`)."""
  est = OnlineCosts(lambda n: 3.0)
  est.set_ar_step_floor(1.0 * AR_S, rows=2)  # no loop call priced a cycle at 2: the prior
  assert not est.forward_priced(N, 2) and est.start_break_even(N, 2, True) == pytest.approx(3.0)
  for n_ar, n_cycle in _calls(12):
    est.observe(2 * AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=8)
  assert est.plain_prior_s(8) is None and not est.forward_priced(N, 8)
  assert est.start_break_even(N, 8, forward_prior=True) == pytest.approx(2.5, rel=0.02)
  est.set_ar_step_floor(1.0 * AR_S, rows=8)
  assert est.plain_prior_s(8) == pytest.approx(AR_S) and est.plain_prior_s(4) is None
  assert est.forward_priced(N, 8)
  assert est.start_break_even(N, 8, forward_prior=True) == pytest.approx(5.0, rel=0.02)
  assert est.start_break_even(N, 8) == pytest.approx(2.5, rel=0.02)
  for _ in range(3):
    est.observe_plain(16 * 1.25 * AR_S, 16, rows=8)
  assert est.start_break_even(N, 8, forward_prior=True) == pytest.approx(4.0, rel=0.02)
  for n_ar, n_cycle in _calls(12):
    est.observe(2 * AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=4)
  assert est.start_break_even(N, 4, forward_prior=True) == pytest.approx(2.5, rel=0.02)


def test_a_batchs_price_takes_the_cycle_and_the_plain_step_at_one_moment():
  """A batch that decodes plain times the plain step with every call and the cycle only in its
  explorer runs: a load that makes the plain step dearer (1.25 -> 2 ms) while no speculative
  call runs leaves the cycle's price in plain steps where it was measured (4), rather than
  reading the stale cycle as cheaper (5 / 2 = 2.5 plain steps, toward drafting); once
  speculative calls time the cycle under the load (10 ms: dearer than the plain step's rise,
  as a second process on a CPU makes it), the price follows (10 / 2 = 5 plain steps)."""
  est = OnlineCosts(lambda n: 3.0)
  for n_ar, n_cycle in _calls(12):
    est.observe_plain(16 * 1.25 * AR_S, 16, rows=8)
    est.observe(2 * AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=8)
  assert est.start_break_even(N, 8) == pytest.approx(4.0, rel=0.02)
  for _ in range(20):  # the load: plain calls only, each step 2 ms
    est.observe_plain(16 * 2.0 * AR_S, 16, rows=8)
  assert est.plain_step_s(8) == pytest.approx(2.0 * AR_S, rel=0.02)
  assert est.start_break_even(N, 8) == pytest.approx(4.0, rel=0.02)
  for n_ar, n_cycle in _calls(8, seed=1):  # explorers time the cycle under the load
    est.observe(3 * AR_S * n_ar + 10 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=8)
  assert est.start_break_even(N, 8) == pytest.approx(5.0, rel=0.05)
  # Before any speculative call at a batch size, the plain step of the moment is taken.
  for _ in range(3):
    est.observe_plain(16 * 1.0 * AR_S, 16, rows=4)
  for n_ar, n_cycle in _calls(12):
    est.observe(2 * AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=4)
  assert est.start_break_even(N, 4) == pytest.approx(5.0, rel=0.02)


def test_recovers_known_costs_and_follows_a_step_change():
  est = OnlineCosts(lambda n: 3.0)
  assert est.break_even(N, rows=1) == pytest.approx(3.0)  # the prior before any call
  calls = _calls(24)
  for n_ar, n_cycle in calls[:12]:
    assert est.observe(AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
  e = est.estimate(1)
  assert e.calls == 12 and e.ar_step_s == pytest.approx(AR_S, rel=0.02)
  assert e.cycle_s[N] == pytest.approx(5 * AR_S, rel=0.02)
  assert e.break_even[N] == pytest.approx(5.0, rel=0.02)
  assert est.break_even_N(B, rows=1).tolist() == pytest.approx([1.0, 3.0, 3.0, 3.0, 5.0],
                                                                rel=0.02)
  # Cycles get cheaper (5 -> 2 AR steps): past the midpoint within 4 calls, there in 12.
  seen = []
  for n_ar, n_cycle in calls[12:]:
    est.observe(AR_S * n_ar + 2 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
    seen.append(est.break_even(N, rows=1))
  assert min(seen[:4]) < 3.5, seen
  assert seen[-1] == pytest.approx(2.0, rel=0.05), seen
  # Another batch size is its own fit: still the prior.
  assert est.break_even(N, rows=8) == pytest.approx(3.0)


def test_size_prices_take_a_lengths_own_fit_once_it_ran_in_enough_calls():
  """A policy weighs sizes by `size_prices`: before the fit prices, the prior; then a length
  run in `SIZE_PRICE_CALLS` calls at its own fitted break-even, a rarer one at the prior's
  shape scaled to the break-even of the length run in the most calls: a length that ran in two
  slow calls is not priced by them (its own break-even is), and once it has run in enough
  calls its own fit prices it."""
  prior = lambda n: 1.0 + 0.25 * n  # start-up: a cycle over n tokens, drafter pass included
  est = OnlineCosts(prior)
  np.testing.assert_allclose(est.size_prices([5, 8], rows=1), [2.25, 3.0])
  for n_ar, n_cycle in _calls(12):  # b = 8 cycles really cost 4.5 AR steps (1.5x the prior)
    counts = [0] * 9
    counts[0], counts[8] = n_ar, n_cycle
    est.observe(AR_S * n_ar + 4.5 * AR_S * n_cycle, counts, rows=1)
  for n_ar, n_cycle in ((3, 2), (4, 2)):  # two calls of b = 5 on a slow moment
    counts = [0] * 9
    counts[0], counts[5] = n_ar, n_cycle
    est.observe(3 * (AR_S * n_ar + 3.4 * AR_S * n_cycle), counts, rows=1)
  assert est.break_even(5, rows=1) > est.break_even(8, rows=1)  # its own fit: dearer than 8
  got = est.size_prices([5, 6, 8], rows=1)
  scale = est.break_even(8, rows=1) / 3.0
  assert est.break_even(8, rows=1) == pytest.approx(4.5, rel=0.05)
  np.testing.assert_allclose(got, [2.25 * scale, 2.5 * scale, 3.0 * scale], rtol=1e-6)
  assert got[0] < got[1] < got[2]
  # b = 5 cycles really cost 4.2 AR steps, more than the shape says (3.4): once they ran in
  # enough calls, their own fit prices them.
  for n_ar, n_cycle in _calls(SIZE_PRICE_CALLS, seed=3):
    counts = [0] * 9
    counts[0], counts[5] = n_ar, n_cycle
    est.observe(AR_S * n_ar + 4.2 * AR_S * n_cycle, counts, rows=1)
  got = est.size_prices([5, 6, 8], rows=1)
  assert got[0] == pytest.approx(4.2, rel=0.1)
  assert got[2] == est.break_even(8, rows=1)
  # With each size's own drafter pass timed at start-up (`size_shape`), the shape is that one.
  shaped = OnlineCosts(prior, size_shape=lambda n: 0.5 + 0.3 * n, batch_prior_floor=1.0)
  np.testing.assert_allclose(shaped.size_prices([5, 8], rows=1), [2.0, 2.9])
  assert shaped.break_even(8, rows=1) == pytest.approx(3.0)  # the controller's prior unchanged
  # A batch's floor (its prior) is the shape's for these prices, not the controller's.
  np.testing.assert_allclose(shaped.size_prices([5, 8], rows=4), [2.0, 2.9])
  assert shaped.break_even(5, rows=4) == pytest.approx(2.25)


def _size_ratios_seen(rule_of_fit: bool, seed: int) -> np.ndarray:
  """11's price over 8's in `size_prices` before each call of size 11 (once it ran in enough
  calls), on a noisy clock where an 11 cycle costs 1.4x an 8 cycle: 300 calls, one in ten of
  size 11, each call's time off by a lognormal factor (sigma 0.2: a VM's speed from call to
  call). `rule_of_fit`: 11's own fitted break-even over 8's (what `size_prices` gave before)."""
  rng = np.random.default_rng(seed)
  est, seen = OnlineCosts(lambda n: 1.0 + 0.25 * n), []
  for i in range(300):
    size = 11 if i % 10 == 3 else 8
    if size == 11 and est._fit(1).calls_with.get(11, 0) >= SIZE_PRICE_CALLS:
      p8, p11 = ((est.break_even(8, 1), est.break_even(11, 1)) if rule_of_fit else
                 est.size_prices([8, 11], rows=1))
      seen.append(p11 / p8)
    n_ar, n_cycle = int(rng.integers(0, 12)), int(rng.integers(8, 30))
    counts = [0] * 12
    counts[0], counts[size] = n_ar, n_cycle
    cycle_s = 3 * AR_S * (1.4 if size == 11 else 1.0)
    est.observe((AR_S * n_ar + cycle_s * n_cycle) * rng.lognormal(0, 0.2), counts, rows=1)
  return np.asarray(seen)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_rare_lengths_price_is_its_ratio_over_the_run_not_its_last_calls(seed):
  """A policy weighs its sizes by `size_prices`: a length run in one call of ten is priced by
  its ratio to the common length over every call (long memory), not by its own fitted
  break-even, which the fit's fast forgetting leaves to its last call or two. On a clock whose
  calls are off by ~20% each, the ratio stays within ~5% of the true 1.4 (median; at most
  ~11% in six seeds: what 8-30 such calls can tell), where the fit's own ratio strays by 8-17%
  (median) and up to 34-57% (this test checks it does, so it can tell the two apart)."""
  ratios = _size_ratios_seen(False, seed)
  errors = np.abs(np.log(ratios / 1.4))
  assert len(ratios) >= 15 and np.median(errors) < 0.08 and errors.max() < 0.15, ratios
  own = np.abs(np.log(_size_ratios_seen(True, seed) / 1.4))
  assert np.median(own) > np.median(errors) and own.max() > 0.3, own


def test_a_batch_size_prices_by_its_prior_until_its_third_call():
  """Two calls give as many equations as unknowns: a batch tail's first two calls at a new size
  (these, from a batch-16 run at the test shapes on this CPU) fitted an AR step at ~0 and a
  cycle at the 64-step cap. The prior prices until the fit has seen MIN_CALLS (3) calls."""
  first_two = ((87.24e-3, 2, 3), (13.14e-3, 11, 2))  # (seconds, AR steps, cycles)
  est = OnlineCosts(lambda n: 5.47, batch_prior_floor=1.0)
  for seconds, n_ar, n_cycle in first_two:
    est.observe(seconds, _counts(n_ar, n_cycle), rows=4)
    assert est.break_even(N, rows=4) == pytest.approx(5.47)
  assert est.estimate(4).calls == 2
  loose = OnlineCosts(lambda n: 5.47, batch_prior_floor=1.0, min_calls=1,  # the rule before
                      hold_outliers=False)
  for seconds, n_ar, n_cycle in first_two:
    loose.observe(seconds, _counts(n_ar, n_cycle), rows=4)
  # The rule before (a fit from the first call): those two calls price the AR step at or below
  # zero, so the fit keeps the prior's shape on their scale (`_Fit.update`; floored near zero,
  # that step had put the cycle at the cap, 4 AR steps per token verified).
  assert loose.break_even(N, rows=4) == pytest.approx(5.47)
  for n_ar, n_cycle in _calls(12):  # then the fit prices: here cycles at 5 AR steps
    est.observe(AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=4)
  assert est.break_even(N, rows=4) == pytest.approx(5.0, rel=0.1)
  with pytest.raises(BadInputError, match="min_calls=0"):
    OnlineCosts(lambda n: 3.0, min_calls=0)


def test_declined_cycles_are_priced_by_the_prior_not_fitted():
  """The decline's cycles (verify length 1: a drafter pass and a one-token forward) among AR
  steps and full cycles: `by_prior` counts each as prior(1) AR steps, so the fit still
  recovers the two costs it can tell apart, and length 1 keeps the prior's break-even."""
  prior = lambda n: 2.0 if n == 1 else 3.0
  est = OnlineCosts(prior, by_prior=(1,))
  rng = np.random.default_rng(3)
  for n_ar, n_cycle in _calls(16):
    declined = int(rng.integers(0, 4))
    counts = _counts(n_ar, n_cycle)
    counts[1] = declined  # each really costs its prior, 2 AR steps
    est.observe(AR_S * (n_ar + 2 * declined) + 5 * AR_S * n_cycle, counts, rows=1)
  e = est.estimate(1)
  assert e.ar_step_s == pytest.approx(AR_S, rel=0.02)
  assert e.break_even[N] == pytest.approx(5.0, rel=0.02) and 1 not in e.cycle_s
  assert est.break_even(1, rows=1) == pytest.approx(2.0)


def test_a_noisy_machine_moves_the_estimate_less_than_a_change_does():
  """Calls whose time is off by a random factor (a VM whose speed moves by a quarter between
  requests, lognormal sigma 0.25) keep the break-even near the truth, where restarting on every
  mispredicted call (the old rule: forget 0.6, one call) let it swing to the clip's ends; a real
  change (5 -> 2 AR steps per cycle) is still followed within a few calls."""
  rng = np.random.default_rng(3)
  calls = _calls(200, seed=5)
  noise = np.exp(rng.normal(0.0, 0.25, len(calls)))

  def spread(est):
    seen = []
    for (n_ar, n_cycle), f in zip(calls, noise):
      est.observe(f * (AR_S * n_ar + 5 * AR_S * n_cycle), _counts(n_ar, n_cycle), rows=1)
      seen.append(est.break_even(N, rows=1))
    return np.quantile(np.abs(np.log(np.asarray(seen[20:]) / 5.0)), 0.75)

  steady = spread(OnlineCosts(lambda n: 3.0))
  old_rule = spread(OnlineCosts(lambda n: 3.0, forget=0.6, restart_calls=1))
  assert steady < 0.8 * old_rule, (steady, old_rule)
  est = OnlineCosts(lambda n: 3.0)
  for n_ar, n_cycle in calls[:20]:
    est.observe(AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
  seen = []
  for n_ar, n_cycle in calls[20:28]:
    est.observe(AR_S * n_ar + 2 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
    seen.append(est.break_even(N, rows=1))
  assert min(seen[:3]) < 3.5 and seen[-1] == pytest.approx(2.0, rel=0.1), seen


def _device_calls(num: int, slow_call: int | None, seed: int = 0, cycle_s: float = 5.26e-3,
                  change_at: int | None = None) -> list[tuple[float, list[int]]]:
  """(seconds, counts) of a batch's loop calls as an H200 ran them at Qwen3-4B shapes, batch 4
  (docs/results/accelerator.md): 10-30 cycles of 3.38 ms AR steps and `cycle_s` cycles, 0-3 AR
  steps, 3% noise, 3 ms per call; call `slow_call` 0.15 s slower (a one-off stall, as one group's
  first run of the default was on that device); from call `change_at` every cycle 2x dearer."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    n_ar, n_cycle = int(rng.integers(0, 4)), int(rng.integers(10, 30))
    dear = 2.0 if change_at is not None and i >= change_at else 1.0
    secs = (n_ar * 3.38e-3 + n_cycle * cycle_s * dear) * (1 + 0.03 * rng.standard_normal())
    out.append((secs + 3e-3 + (0.15 if i == slow_call else 0.0), _counts(n_ar, n_cycle)))
  return out


def test_a_batchs_one_slow_call_is_held_out_until_a_call_like_it_says():
  """A batch's calls run few AR steps, so its fit can barely tell an AR step's price from a
  cycle's: one call 0.15 s slow among calls of ~0.1 s, fitted at once, sent the break-even of
  a cycle priced 1.56 AR steps to the cap (64), where every cycle is a miss and the rows back
  off. Held out until a later call that ran the same kinds of forwards confirms a change (off
  the same way) or refutes it, the break-even stays within the calls' own noise; a real change
  (cycles 2x dearer) is still followed once two calls show it."""
  prior = lambda n: 1.557

  def run(calls, hold):
    est = OnlineCosts(prior, batch_prior_floor=1.0, hold_outliers=hold)
    seen = []
    for secs, counts in calls:
      est.observe(secs, counts, rows=4)
      seen.append(est.break_even(N, rows=4))
    return est, seen

  calls = _device_calls(20, slow_call=6)
  _, fitted = run(calls, hold=False)
  # Fitted at once, the slow call prices the AR step below zero: the fit keeps its shape
  # (`_Fit.update`), where the step floored near zero had sent the break-even to the cap.
  assert max(fitted) < 2.6, fitted
  est, held = run(calls, hold=True)
  assert max(held) < 2.5, held
  assert est.estimate(4).calls == 20  # a held call is still an observation
  _, quiet = run(_device_calls(20, slow_call=None), hold=True)
  assert max(quiet) < 2.5, quiet
  # Cycles 2x dearer from call 10 on (a cycle then costs ~3.1 AR steps): followed, about as
  # unsteadily as without the hold (few AR steps tell the two prices apart poorly: one run's
  # median after the change ranged 2.1-16 over seeds, so the medians are taken over 8).
  for hold in (True, False):
    before, after = [], []
    for seed in range(8):
      _, changed = run(_device_calls(30, slow_call=None, change_at=10, seed=seed), hold=hold)
      before.append(np.median(changed[:10]))
      after.append(np.median(changed[15:]))
    assert np.median(before) < 2.0 and 2.5 < np.median(after) < 5.0, (before, after)
  # One request's calls (AR steps after every miss) are held only where fitting them would
  # price the AR step at or below zero (`test_one_requests_stall_is_held_out`).
  one = OnlineCosts(prior)
  for secs, counts in calls:
    one.observe(secs, counts, rows=1)
  assert one._fit(1).hold and not one._fit(1).hold_any and one._fit(4).hold_any


def test_one_requests_stall_is_held_out():
  """One request's calls mix 0-40 AR steps (1.3 ms) with 12-25 cycles (4.5 ms: 3.46 AR steps),
  8% noise; call 25 runs 2 AR steps and 16 cycles in 3x their time (a stall, as a slow spell of
  the 2-core Xeon VM gave the learned default's batch-1 run one). Fitted at once it priced the
  AR step below zero, the step was floored near it and every cycle went to the cap (32 AR
  steps) for several calls: the median over the ten calls from it was 8.5-28 over these seeds.
  Held (it would price the AR step at or below zero) until the next call refutes it, the
  break-even stays near the truth. A call that is merely off (the noise, or a change of the
  costs) is fitted at once, as before."""
  n = 8
  for seed in range(8):
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(40):
      n_ar, n_cycle = int(rng.integers(0, 40)), int(rng.integers(12, 25))
      calls.append(((n_ar * 1.3e-3 + n_cycle * 4.5e-3) * (1 + 0.08 * rng.standard_normal()),
                    n_ar, n_cycle))
    calls[25] = ((2 * 1.3e-3 + 16 * 4.5e-3) * 3.0, 2, 16)
    est = OnlineCosts(lambda k: 2.5, one_prior_floor=0.5)
    seen = []
    for i, (secs, n_ar, n_cycle) in enumerate(calls):
      counts = [0] * (n + 1)
      counts[0], counts[n] = n_ar, n_cycle
      est.observe(secs, counts, rows=1)
      seen.append(est.break_even(n, rows=1))
      if i == 25:
        assert est._fit(1).held is not None, seed
    assert np.median(seen[25:35]) < 1.5 * 4.5 / 1.3, (seed, seen[25:35])
    assert est.estimate(1).calls == 40  # the held call is still counted


def test_one_requests_young_fit_keeps_its_shape_where_its_first_calls_price_no_ar_step():
  """A batch-1 run's first speculative calls (the 2-core Xeon, model 207; prior from its start-up
  costs, b = 8): three of 8 AR steps and 21 cycles, the first slower (a loop's first timed
  call), then 2 and 17. The free fit put the AR step near zero and the cycle at the cap (32 AR
  steps; the next request decoded plain); a young fit keeps its shape there. The calls after
  it, which tell the two prices apart, are priced as by the free fit once it settles, and
  cycles turned 4x dearer later are followed alike."""
  from bp_jax.decoding import controller as control

  costs, draft = (1.0, 1.0098, 1.1576, 1.4322), 0.8594
  prior = lambda n: control.break_even(n - 1, costs, draft)
  counts = lambda n_ar, n_cycle: [n_ar] + [0] * 7 + [n_cycle]  # b = 8: 8 tokens verified
  first = [(0.09612, 8, 21), (0.07045, 8, 21), (0.06787, 8, 21), (0.05831, 2, 17)]
  rng = np.random.default_rng(0)
  later = []  # 1.1 ms an AR step and 3.3 ms a cycle (3 AR steps), then cycles of 13.2 ms (12)
  for cycle_s in [3.3e-3] * 30 + [13.2e-3] * 12:
    n_ar, n_cycle = int(rng.integers(2, 60)), int(rng.integers(12, 22))
    later.append((n_ar * 1.1e-3 + n_cycle * cycle_s, n_ar, n_cycle))
  est = OnlineCosts(prior)
  assert est._fit(1).early_shape and not est._fit(2).early_shape  # one request's fit only
  seen = {}
  for young in (False, True):
    est = OnlineCosts(prior, one_prior_floor=0.5)
    est._fit(1).early_shape = young
    seen[young] = []
    for secs, n_ar, n_cycle in first + later:
      est.observe(secs, counts(n_ar, n_cycle), 1)
      seen[young].append(est.break_even(8, 1))
  assert seen[False][3] == pytest.approx(32.0)  # the cap: what the run priced
  assert seen[True][3] == pytest.approx(prior(8), rel=0.01)  # its shape, on the calls' scale
  assert seen[True][:3] == seen[False][:3]
  np.testing.assert_allclose(seen[True][8:], seen[False][8:], rtol=0.01)
  assert seen[True][33] == pytest.approx(3.0, rel=0.02)
  assert seen[True][-1] == pytest.approx(12.0, rel=0.05)


def test_a_batchs_cycle_held_at_its_floor_is_priced_by_the_calls_that_timed_it():
  """Where a batch's fitted cycle falls below its floor (the start-up price in AR steps), the
  fit is redone with the cycle held at the floor times the AR step, so the cycle's seconds are
  what the calls timed. Before, the free fit's cycle was moved up to the floor times its AR
  step, which the calls barely price: calls of cycles alone a few percent cheaper than the
  mixed calls before them raised that step (the older calls' seconds still to explain), and the
  cycle with it, above every call that timed it (an H200's simulated clock, batch 8: 5.2-5.5 ms
  timed, 6.22 ms fitted). `start_break_even` divides that cycle by the plain step."""
  ar_s, cycle_s = 3.52e-3, 5.535e-3
  prior = lambda n: cycle_s / ar_s  # the true ratio: the floor binds about half the time
  est = OnlineCosts(prior, batch_prior_floor=1.0)
  rng = np.random.default_rng(0)
  for _ in range(5):
    est.observe((3 * ar_s + 13 * cycle_s) * np.exp(rng.normal(0.0, 0.03)), _counts(3, 13), 8)
  for factor in (0.933, 0.993, 0.963, 0.978, 0.97, 0.97):  # 3-7% cheaper (the noise)
    est.observe(16 * cycle_s * factor, _counts(0, 16), 8)
    assert est._fit(8).seconds(N) < cycle_s, est._fit(8).seconds(N)  # before: 6.2-7.7 ms
  assert est.break_even(N, rows=8) == pytest.approx(cycle_s / ar_s)  # at the floor
  # The calls of an H200 at batch 4 (0-3 AR steps among 10-30 cycles, 3% noise), the cycle's
  # true price at the floor: after 30 calls each seed's fitted cycle is within 2.5% of it
  # (before: up to 27% above, 4 seeds of 12 above 4%).
  prior = lambda n: 1.557
  for seed in range(12):
    est = OnlineCosts(prior, batch_prior_floor=1.0)
    for secs, counts in _device_calls(30, slow_call=None, seed=seed):
      est.observe(secs - 3e-3, counts, rows=4)  # without the per-call 3 ms
    assert est._fit(4).seconds(N) == pytest.approx(5.26e-3, rel=0.025), seed


def test_a_batchs_ar_step_costs_at_least_the_start_up_forward():
  """A batch's calls run few AR steps (0-3 among 10-30 cycles), so its fit barely prices the
  speculative loop's AR step, and the fitted ratio swung: through the calls of an H200 at batch
  4 (a cycle 1.56 AR steps; τ ~6 there, so a price above 3 makes drafting short of decisive
  before the plain loop is timed, `start_backoff.DECISIVE`) it reached 4.4. That step is a
  one-token forward and more, so it costs at least the start-up one-token forward there
  (`set_ar_step_floor`): bounded so, the break-even and the start price stay below 2.5, and the
  plain loop's step takes over the start price once timed."""
  calls = _device_calls(30, slow_call=None, seed=1)
  unbounded = OnlineCosts(lambda n: 1.557, batch_prior_floor=1.0)
  est = OnlineCosts(lambda n: 1.557, batch_prior_floor=1.0)
  est.set_ar_step_floor(3.38e-3, rows=4)
  ratios, prices, starts = [], [], []
  for secs, counts in calls:
    unbounded.observe(secs, counts, rows=4)
    est.observe(secs, counts, rows=4)
    ratios.append(unbounded.break_even(N, rows=4))
    prices.append(est.break_even(N, rows=4))
    starts.append(est.start_break_even(N, rows=4))
  assert max(ratios) > 3.0, ratios
  assert max(prices) < 2.5 and min(prices) >= 1.557 and starts == prices, prices
  cycle_s = est.estimate(4).cycle_s[N]
  assert cycle_s == pytest.approx(5.4e-3, rel=0.1)
  for _ in range(3):
    est.observe_plain(16 * 3.0e-3, 16, rows=4)
  est.observe(*_device_calls(1, slow_call=None, seed=2)[0], rows=4)
  assert est.start_break_even(N, rows=4) == pytest.approx(est.estimate(4).cycle_s[N] / 3.0e-3)
  assert est.break_even(N, rows=8) == unbounded.break_even(N, rows=8)  # no bound there
  with pytest.raises(BadInputError, match="seconds"):
    est.set_ar_step_floor(0.0, rows=4)


def test_a_batch_tails_ar_step_costs_at_least_its_share_of_the_start_up_forward():
  """The sizes a batch's tail shrinks to have no start-up forward of their own; a forward over
  R rows costs at most R / r forwards over r rows, so the one measured at the batch size bounds
  theirs below at r / R of it. The four calls of a batch-16 run's tail of 8 (the 2-core EPYC VM,
  T = 0, the demo: `docs/cpu_epyc/b16_t0_2026-11-29_rowgate`; start-up forward 11.228 ms at 16
  rows, a full b = 8 cycle priced 3.02 AR steps; a cycle of 8 rows there took 3.7 plain steps)
  fitted the AR step at ~0 and the cycle at the cap, 32 AR steps: bounded, at most 4."""
  tail = ((0.23654, [9, 0, 0, 0, 0, 0, 0, 0, 7]), (0.1787, [9, 1, 0, 0, 0, 0, 0, 0, 6]),
          (0.18646, [9, 1, 0, 0, 0, 0, 0, 0, 6]), (0.1331, [14, 0, 0, 0, 0, 0, 0, 0, 2]))
  prior = lambda n: 1.5 if n == 1 else 3.0178
  unbounded = OnlineCosts(prior, batch_prior_floor=1.0, by_prior=(1,))
  est = OnlineCosts(prior, batch_prior_floor=1.0, by_prior=(1,))
  est.set_ar_step_floor(11.228e-3, rows=16)
  assert est.ar_step_floor_s(16) == 11.228e-3
  assert est.ar_step_floor_s(8) == pytest.approx(11.228e-3 / 2)
  assert est.ar_step_floor_s(2) == pytest.approx(11.228e-3 / 8)
  assert est.ar_step_floor_s(32) is None  # nothing measured at or above 32 rows
  for seconds, counts in tail:
    unbounded.observe(seconds, counts, rows=8)
    est.observe(seconds, counts, rows=8)
  assert unbounded.break_even(8, rows=8) == 32.0  # the cap
  assert 3.0178 <= est.break_even(8, rows=8) < 4.0
  assert est.break_even(8, rows=8) == pytest.approx(
      min(32.0, max(3.0178, est.estimate(8).cycle_s[8] / (11.228e-3 / 2))))
  # One request (a tail of one row) is not bounded so: its calls price its AR step.
  for seconds, counts in tail:
    unbounded.observe(seconds, counts, rows=1)
    est.observe(seconds, counts, rows=1)
  assert est.ar_step_floor_s(1) == pytest.approx(11.228e-3 / 16)
  assert est.break_even(8, rows=1) == unbounded.break_even(8, rows=1) > 4.0


def test_one_requests_fit_is_not_bounded_by_the_start_up_forward():
  """One request's calls run many AR steps, so its fit prices the AR step itself: the start-up
  forward does not bound its break-even (a batch-1 run on the 2-core EPYC VM: the loop's AR step
  1.96 ms, a cycle 9.6 ms, the start-up forward read 3.61 ms from the cost cache, which priced
  the cycle at 2.66 AR steps instead of 4.9)."""
  rng = np.random.default_rng(3)
  est = OnlineCosts(lambda n: 3.48, one_prior_floor=0.5)
  est.set_ar_step_floor(3.61e-3, rows=1)
  for _ in range(30):
    n_ar, n_cycle = int(rng.integers(15, 45)), int(rng.integers(10, 30))
    est.observe(1.96e-3 * n_ar + 9.6e-3 * n_cycle, _counts(n_ar, n_cycle), rows=1)
  assert est.break_even(N, rows=1) == pytest.approx(9.6 / 1.96, rel=0.02)
  assert est.start_break_even(N, rows=1) == est.break_even(N, rows=1)


def test_one_requests_ar_step_costs_at_least_its_plain_loops_step():
  """One request's speculative-loop AR step is a one-token forward that also stages the
  drafter's context: it costs at least the plain AR loop's step (in batch-1 runs on the 2-core
  EPYC VM the fit priced it at 1.10-1.19x that step, median). Where its fit prices it below
  (calls mixing their forwards alike, whose noise it cannot tell apart: at T = 1 there, ~117
  AR steps to ~4 cycles per call, the full cycle's price rose from 3.6 to 30.4 AR steps, the
  fit's step 0.60 ms against the plain loop's 1.04 ms), the step is held at the plain loop's
  and the cycles refitted to the same calls with it: a price never above the fit's own, the
  same where the fit's step is at least the plain one, and nearer the truth in noisy runs."""
  # Exact calls of a step 0.8 ms and a cycle 6 ms, the plain loop's step 1 ms: held there, the
  # cycle is the forgetting least-squares fit of what the calls' steps at 1 ms leave.
  # `plain_cheaper`: the plain loop's step 0.5 ms, below the fit's.
  est, off, plain_cheaper = (OnlineCosts(lambda n: 3.0),
                             OnlineCosts(lambda n: 3.0, one_plain_floor=False),
                             OnlineCosts(lambda n: 3.0))
  # The plain loop timed again every 5 speculative calls (a bound lapses past
  # `PLAIN_FLOOR_CALLS` of them: the next test).
  calls = _calls(20)
  for e, plain_s in ((est, 1e-3), (off, 1e-3), (plain_cheaper, 0.5e-3)):
    for i, (n_ar, n_cycle) in enumerate(calls):
      if i % 5 == 0:
        e.observe_plain(64 * plain_s, 64, rows=1)
      e.observe(0.8e-3 * n_ar + 6e-3 * n_cycle, _counts(n_ar, n_cycle), rows=1)
  assert off.break_even(N, rows=1) == pytest.approx(7.5, rel=0.01)
  w = 0.8 ** np.arange(len(calls))[::-1]
  a, c = np.asarray(calls, float).T
  cycle_s = float(np.sum(w * c * (0.8e-3 * a + 6e-3 * c - 1e-3 * a)) / np.sum(w * c * c))
  assert est.break_even(N, rows=1) == pytest.approx(cycle_s / 1e-3, rel=0.02)
  assert est.break_even(N, rows=1) < off.break_even(N, rows=1)
  assert est.start_break_even(N, rows=1) == pytest.approx(est.break_even(N, rows=1))
  # The fit's step (0.8 ms) at least the plain loop's: nothing changes.
  assert plain_cheaper.break_even(N, rows=1) == off.break_even(N, rows=1)
  # Plain calls alone, faster (0.7 ms: another moment of the machine), leave the price where
  # the last fitted call put it, whose cycles were timed beside the plain step as it was then;
  # the next speculative call takes the plain step as it stands.
  held_price = est.break_even(N, rows=1)
  for _ in range(10):
    est.observe_plain(64 * 0.7e-3, 64, rows=1)
  assert est.break_even(N, rows=1) == pytest.approx(held_price)
  est.observe(0.8e-3 * 10 + 6e-3 * 10, _counts(10, 10), rows=1)
  assert est.break_even(N, rows=1) != pytest.approx(held_price, rel=0.01)
  # Noisy calls (15% per call) of a step 1.1 ms and a cycle 4.7 ms (4.27 AR steps), the plain
  # step 1 ms (5%): over 8 runs the held price is never above the fit's own and errs less (mean
  # |log(price / 4.27)| 0.84x the fit's).
  errors = {True: [], False: []}
  for seed in range(8):
    rng = np.random.default_rng(seed)
    ests = {held: OnlineCosts(lambda n: 3.5, one_prior_floor=0.5, one_plain_floor=held)
            for held in (True, False)}
    for i in range(30):
      plain = 128e-3 * float(np.exp(rng.normal(0, 0.05)))
      n_ar, n_cycle = int(rng.integers(90, 140)), int(rng.integers(2, 6))
      secs = (1.1e-3 * n_ar + 4.7e-3 * n_cycle) * float(np.exp(rng.normal(0, 0.15)))
      for e in ests.values():
        e.observe_plain(plain, 128, rows=1)
        e.observe(secs, _counts(n_ar, n_cycle), rows=1)
      prices = {held: e.break_even(N, rows=1) for held, e in ests.items()}
      assert prices[True] <= prices[False] * (1 + 1e-6)
      if i >= 3:
        for held, price in prices.items():
          errors[held].append(abs(np.log(price / 4.27)))
  assert np.mean(errors[True]) < 0.9 * np.mean(errors[False]), errors
  assert OnlineCosts(lambda n: 3.0).break_even(N, rows=1) == 3.0  # no call: the prior


def test_one_requests_plain_step_bounds_its_ar_step_only_while_timed_lately():
  """Where every request drafts, no plain call renews the plain loop's step, and one timed at
  a slow moment held one request's AR step there for the rest of a run, its cycles priced in
  that too-dear step (batch 1, T = 0 on the 2-core EPYC VM, model 17: the learned default's one
  plain call at 1.29 ms a step where the plain loop then ran 0.65 ms; a b = 8 cycle priced 2.15
  AR steps where its calls timed 4.4, every request drafting at 0.93x our AR). The plain step
  bounds the fit's step only while timed within the last `PLAIN_FLOOR_CALLS` speculative calls."""
  calls = _calls(3 * PLAIN_FLOOR_CALLS, seed=1)
  secs = lambda n_ar, n_cycle: 0.8e-3 * n_ar + 6e-3 * n_cycle  # a step 0.8 ms, a cycle 6 ms
  est, free = OnlineCosts(lambda n: 3.0), OnlineCosts(lambda n: 3.0, one_plain_floor=False)
  for e in (est, free):
    e.observe_plain(64 * 2e-3, 64, rows=1)  # a slow moment: 2 ms a plain step
  prices = []
  for i, (n_ar, n_cycle) in enumerate(calls):
    for e in (est, free):
      e.observe(secs(n_ar, n_cycle), _counts(n_ar, n_cycle), rows=1)
    prices.append((est.break_even(N, rows=1), free.break_even(N, rows=1)))
  # Held at the stale step while it is recent (the cycle's price far under its 7.5 AR steps),
  # the fit's own price once it is not.
  held = [p for p, q in prices[MIN_CALLS - 1:PLAIN_FLOOR_CALLS]]
  assert max(held) < 0.6 * 7.5, prices
  for p, q in prices[PLAIN_FLOOR_CALLS:]:
    assert p == q == pytest.approx(7.5, rel=0.01)
  # A plain call timed now bounds the step again, at its own time: the forgetting fit of what the
  # calls leave after steps of 1 ms (a price under the fit's own 7.5).
  est.observe_plain(64 * 1e-3, 64, rows=1)
  n_ar, n_cycle = calls[0]
  est.observe(secs(n_ar, n_cycle), _counts(n_ar, n_cycle), rows=1)
  assert est.break_even(N, rows=1) < 7.4
  assert est.start_break_even(N, rows=1) == pytest.approx(est.break_even(N, rows=1))


def test_keeps_its_prior_on_degenerate_calls():
  est = OnlineCosts(lambda n: 3.0)
  # Calls that run cycles only cannot tell them from AR steps: the ratio stays the prior's
  # while the scale follows the time (here, everything dearer by 3x).
  for i, scale in enumerate((1.0, 1.0, 3.0, 3.0)):
    est.observe(scale * 3 * AR_S * (10 + i), _counts(0, 10 + i), rows=1)
    assert est.break_even(N, rows=1) == pytest.approx(3.0)
  assert est.estimate(1).cycle_s[N] == pytest.approx(9 * AR_S, rel=0.05)
  ar_only = OnlineCosts(lambda n: 3.0)  # and AR steps only: the same
  for n_ar in (5, 9, 20):
    ar_only.observe(2 * AR_S * n_ar, _counts(n_ar, 0), rows=1)
    assert ar_only.break_even(N, rows=1) == pytest.approx(3.0)
  assert ar_only.estimate(1).ar_step_s == pytest.approx(2 * AR_S)
  # No forwards, no time, or a time that is not a number: not an observation.
  before = est.estimate(1)
  assert not est.observe(0.5, _counts(0, 0), rows=1)
  assert not est.observe(0.0, _counts(3, 3), rows=1)
  assert not est.observe(float("nan"), _counts(3, 3), rows=1)
  assert est.estimate(1) == before


def test_clips_to_sane_bounds_and_checks_its_inputs():
  est = OnlineCosts(lambda n: 3.0)
  for n_ar, n_cycle in _calls(10):  # cycles 100x an AR step: clipped at 4 per token verified
    est.observe(AR_S * n_ar + 100 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
  assert est.break_even(N, rows=1) == pytest.approx(4.0 * N)
  cheap = OnlineCosts(lambda n: 3.0)
  for n_ar, n_cycle in _calls(10):  # cycles cheaper than an AR step: at least one AR step
    cheap.observe(AR_S * n_ar + 0.2 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
  assert cheap.break_even(N, rows=1) == pytest.approx(1.0)
  # With the prior as a batch's floor (the engine's): a batch's cheaper cycles stop at the
  # prior, dearer ones still move its fit up; one request's fit is not bounded so.
  floored = OnlineCosts(lambda n: 3.0, batch_prior_floor=1.0)
  for n_ar, n_cycle in _calls(10):
    for rows in (1, 4):
      floored.observe(AR_S * n_ar + 0.2 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=rows)
  assert floored.break_even(N, rows=4) == pytest.approx(3.0)
  assert floored.break_even(N, rows=1) == pytest.approx(1.0)
  for n_ar, n_cycle in _calls(10, seed=1):
    floored.observe(AR_S * n_ar + 5 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=4)
  assert floored.break_even(N, rows=4) == pytest.approx(5.0, rel=0.05)
  # One request's floor (the engine's: half the prior) bounds its fit alone.
  half = OnlineCosts(lambda n: 3.0, batch_prior_floor=1.0, one_prior_floor=0.5)
  for n_ar, n_cycle in _calls(10):
    half.observe(AR_S * n_ar + 0.2 * AR_S * n_cycle, _counts(n_ar, n_cycle), rows=1)
  assert half.break_even(N, rows=1) == pytest.approx(1.5)
  with pytest.raises(BadInputError, match="batch_prior_floor=-1"):
    OnlineCosts(lambda n: 3.0, batch_prior_floor=-1)
  with pytest.raises(BadInputError, match="one_prior_floor=-0.5"):
    OnlineCosts(lambda n: 3.0, one_prior_floor=-0.5)
  with pytest.raises(BadInputError, match="forget=0"):
    OnlineCosts(lambda n: 3.0, forget=0)
  with pytest.raises(BadInputError, match="restart_calls=0"):
    OnlineCosts(lambda n: 3.0, restart_calls=0)
  with pytest.raises(BadInputError, match="forget=1.5"):
    OnlineCosts(lambda n: 3.0, forget=1.5)
  with pytest.raises(BadInputError, match="ridge=-1"):
    OnlineCosts(lambda n: 3.0, ridge=-1)
  with pytest.raises(BadInputError, match="counts_N="):
    est.observe(1.0, [-1, 2], rows=1)
  with pytest.raises(BadInputError, match="rows=0"):
    est.observe(1.0, [1, 2], rows=0)


# -- the engine, on a fake clock ----------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
  return zeros_drafter_pair(V)


@pytest.fixture(scope="module")
def requests():
  prompts, _ = toy_requests(8, seed=4)
  return prompts, [36] * len(prompts)


@pytest.fixture(scope="module")
def ar_outputs(models, requests):
  eng = toy_engine(models, "none")
  prompts, max_news = requests
  return [eng.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, max_news)]


class FakeClock:
  """Time that passes as the engine's target forwards run (`Engine.forwards_run`, counted
  before each loop call's clock stops): `prices[n]` seconds per forward over n tokens after a
  drafter pass, `prices[0]` per AR step."""

  def __init__(self, cycle_in_ar_steps: float):
    self.engine = None
    self.set(cycle_in_ar_steps)

  def set(self, cycle_in_ar_steps: float) -> None:
    self.prices = {0: AR_S, N: cycle_in_ar_steps * AR_S}

  def __call__(self) -> float:
    return sum(self.prices.get(n, 0.0) * c for n, c in self.engine.forwards_run.items())


def _engine(models, clock: FakeClock, batch_size: int = 1, shrink: bool = False):
  # start_plain=False: requests that start deep stay in the speculative loop, whose calls these
  # tests follow (a plain start's AR loop: tests/test_priced.py). controller_decline=False: the
  # toy drafter's probabilities are the same for every draft, so with the decline the explorers'
  # first cycles all declined while the estimate was dear, fewer full cycles ran, and the
  # estimate came back from 4.2 to 3.6 AR steps in 8 requests instead of to 1.2 (/tmp/s36/oc.py;
  # the decline: tests/test_decline.py).
  eng = toy_engine(models, "priced", batch_size=batch_size, sync_cycles=2, online_costs=True,
                   start_plain=False, shrink=shrink, controller_decline=False, **CHEAP)
  eng.clock = clock
  clock.engine = eng
  return eng


def _ar_share(gens) -> float:
  return sum(g.ar_steps for g in gens) / sum(g.ar_steps + g.drafter_passes for g in gens)


def test_one_request_path_follows_dearer_then_cheaper_cycles(models, requests, ar_outputs):
  """Each request is one loop call: the break-even follows the fake clock's cycle price within
  a few requests, the loop takes more AR steps under the dearer price and fewer again after,
  the tokens stay AR's, and nothing compiles once every shape has run."""
  clock = FakeClock(1.2)
  eng = _engine(models, clock)
  prompts, max_news = requests
  run = lambda: [eng.generate(p, max_new_tokens=m, block_size=B)
                 for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in run()] == ar_outputs  # compiles every prefill bucket
  assert eng.cost_estimate["online"] is True
  assert eng.prices.break_even(N, 1) == pytest.approx(1.2, rel=0.05)
  with BackendCompiles() as compiles:
    cheap = run()
    clock.set(4.5)  # verifies dearer mid-run: every b=4 cycle (at most 4 tokens) is now a miss
    dear, seen = [], []
    eng.call_log = []  # each call as booked, with the price in effect after it
    for p, m in zip(prompts, max_news):
      dear.append(eng.generate(p, max_new_tokens=m, block_size=B))
      seen.append(eng.prices.break_even(N, 1))
    log, eng.call_log = eng.call_log, None
    clock.set(1.2)
    cheap_again = run()
  assert compiles.n == 0
  assert [c.break_even for c in log] == seen and [c.block_size for c in log] == [B] * len(dear)
  for call, gen in zip(log, dear):  # the fake clock's seconds for the forwards each call ran
    assert call.rows == 1 and call.forwards_N[0] == gen.ar_steps
    assert sum(call.forwards_N) == gen.ar_steps + gen.cycles
    assert call.seconds == pytest.approx(AR_S * gen.ar_steps + 4.5 * AR_S * gen.cycles)
    assert call.start_break_even == call.break_even  # alone: no plain loop's price
  assert all(a.end_s < b.end_s for a, b in zip(log, log[1:]))
  assert max(seen[:3]) > 2.85, seen  # past the midpoint within 3 calls
  assert seen[-1] == pytest.approx(4.5, rel=0.1), seen
  assert eng.prices.break_even(N, 1) == pytest.approx(1.2, rel=0.1)
  # The loop followed: the last dear requests took far more AR steps than the cheap ones.
  assert _ar_share(dear[4:]) > _ar_share(cheap) + 0.3
  assert _ar_share(cheap_again[4:]) < _ar_share(dear[4:]) - 0.3
  for gens in (cheap, dear, cheap_again):
    assert [g.output_ids for g in gens] == ar_outputs
  est = eng.cost_estimate["by_batch_size"]["1"]
  assert est["calls"] == 4 * len(prompts) and est["break_even"][str(N)] == pytest.approx(
      1.2, rel=0.1)
  assert eng.compiled.counts["spec_loop"] == 1


def test_batched_path_follows_dearer_cycles(models, requests, ar_outputs):
  """The scheduler writes the current break-even into each bucket's carry before every loop
  call (2 cycles each here) and feeds the estimate after it: dearer cycles raise the
  break-even and the rows take more AR steps; one compiled batched loop throughout."""
  clock = FakeClock(1.2)
  eng = _engine(models, clock, batch_size=3, shrink=True)
  prompts, max_news = requests
  run = lambda: eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert [g.output_ids for g in run()] == ar_outputs
  assert eng.prices.break_even(N, 3) == pytest.approx(1.2, rel=0.05)
  with BackendCompiles() as compiles:
    cheap = run()
    clock.set(4.5)
    dear = run()
    rising = eng.prices.break_even(N, 3)
    dear_more = run()
  assert compiles.n == 0
  assert rising == pytest.approx(4.5, rel=0.1)
  assert _ar_share(dear_more) > _ar_share(cheap) + 0.3
  for gens in (cheap, dear, dear_more):
    assert [g.output_ids for g in gens] == ar_outputs
  by_rows = eng.cost_estimate["by_batch_size"]  # online_costs=True: batched calls update it
  assert eng.cost_estimate["online"] is True
  # The batch's tails ran in 2 and 1 slots (`BatchOptions.shrink`): their own estimates.
  assert set(by_rows) <= {"1", "2", "3"} and len(by_rows) > 1 and by_rows["3"]["calls"] > 20


def test_real_clock_outputs_stay_ar_and_off_keeps_the_start_up_costs(models, requests,
                                                                     ar_outputs):
  """On the real clock (toy forwards: noisy, overhead-heavy timings) the estimate moves but the
  tokens stay AR's; with `online_costs=False` the break-even stays the start-up one."""
  prompts, max_news = requests
  on = toy_engine(models, "priced", online_costs=True, **CHEAP)
  gens = [on.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in gens] == ar_outputs
  # Every speculative loop call is an observation (a plain start's AR loop is none).
  assert on.cost_estimate["by_batch_size"]["1"]["calls"] == sum(not g.plain_start for g in gens)
  off = toy_engine(models, "priced", batch_size=3, sync_cycles=2, online_costs=False, **CHEAP)
  assert [g.output_ids for g in off.generate_batch(prompts, max_new_tokens=max_news,
                                                  block_size=B)] == ar_outputs
  est = off.cost_estimate
  assert est["online"] is False
  assert est["by_batch_size"]["3"]["calls"] == 0
  assert off.prices.break_even(N, 3) == pytest.approx(1.2)
  assert sum(off.forwards_run.values()) > 0
  # Given costs are kept by default; measured ones are updated (test_priced runs those).
  assert toy_engine(models, "priced", **CHEAP).cost_estimate["online"] is False
  assert toy_engine(models, "backoff", ar_fallback=4).cost_estimate is None


def test_the_summary_shows_the_online_estimate(models, requests):
  """The decode summary's controller-costs line says what the online estimate learned."""
  from bp_jax.decode_job import records as rec
  clock = FakeClock(3.0)
  eng = _engine(models, clock)
  prompts, max_news = requests
  for p, m in zip(prompts[:4], max_news[:4]):
    eng.generate(p, max_new_tokens=m, block_size=B)
  c = rec.controller_costs_of(eng)
  assert c["source"] == "given" and c["online"]["by_batch_size"]["1"]["calls"] == 4
  line = rec.costs_line(c)
  assert line.startswith("given: verify 1,1.05,1.1 AR steps")
  found = re.search(r"; online \(4 calls, batch 1\): a cycle over 4 tokens costs ([0-9.]+) AR "
                    r"steps \(([0-9.]+) ms per AR step\)", line)
  assert found, line
  assert float(found[1]) == pytest.approx(3.0, rel=0.05)  # the fake clock's price
  assert float(found[2]) == pytest.approx(1e3 * AR_S, rel=0.05)
  assert rec.online_line(None) == "" and rec.online_line({"online": False}) == ""
  batched = {"online": True,
             "by_batch_size": {"4": {"calls": 0, "break_even": {}, "ar_step_s": None}}}
  assert rec.online_line(batched) == "; online (0 calls, batch 4): no cycle yet"
  plain = {"online": True, "by_batch_size": {"8": {
      "calls": 3, "break_even": {"8": 4.0}, "ar_step_s": 0.004, "plain_step_s": 0.0036,
      "start_break_even": {"8": 5.5}}}}
  assert rec.online_line(plain) == (
      "; online (3 calls, batch 8): a cycle over 8 tokens costs 4.00 AR steps (4.000 ms per AR "
      "step), plain AR loop 3.600 ms per step (a cycle: 5.50 of them)")


def test_start_up_prices_are_computed_once_per_verify_length():
  """The start-up price functions are fixed functions of a verify length, read ~40 times per
  learned request (its policy's sizes, the start check, the start): each value is computed
  once, and the prices read are the functions' own."""
  calls: dict[tuple[float, int], int] = {}

  def counted(scale):
    def price(n):
      calls[(scale, n)] = calls.get((scale, n), 0) + 1
      return scale * (1.0 + 0.25 * n)
    return price

  est = OnlineCosts(counted(1.0), size_shape=counted(2.0), one_prior_floor=0.5)
  for _ in range(3):
    sizes = est.size_prices([2, 4, 8], 1)
    be = est.break_even_N(8, 1)
  assert calls and set(calls.values()) == {1}, calls
  assert be[4] == pytest.approx(2.0) and sizes[1] == pytest.approx(4.0)
