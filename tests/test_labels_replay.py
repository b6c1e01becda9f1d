"""The intra-request analysis (bp_jax/train/intra_request.py): the teacher-forced replay predicts
every real decode cycle's acceptance and every target forward of the loop that ran (with and
without the AR fallback), and the per-cycle dynamic program is right on small cases worked out
by hand."""

from __future__ import annotations

import numpy as np
import pytest

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from toy_models import zeros_drafter_pair
from bp_jax.train import intra_request as intra

V = 64
SIZES = (2, 3, 4, 5)
MAX_NEW = 30


@pytest.fixture(scope="module")
def models():
  """A random untied target whose greedy output often is token 0, and a drafter whose final
  norm is zero: its logits are all 0, so it always drafts token 0 and a cycle accepts exactly
  the run of 0s the target produces next — partial acceptances of every length occur."""
  target, drafter = zeros_drafter_pair(V)
  return target, drafter


def _replayed_runs(models, seed: int, **loop):
  """(output, replayed acceptance of size b, block size b, the engine's Generation at b) for 6
  random prompts: every size's real decode next to the teacher-forced replay."""
  target, drafter = models
  engine = Engine(target, drafter=drafter,
                  shapes=ShapeOptions(max_len=96, length_buckets=(32, 64, 96), block_sizes=SIZES),
                  loop=LoopOptions(**loop))
  rng = np.random.default_rng(seed)
  for _ in range(6):
    prompt = rng.integers(1, V - 1, int(rng.integers(3, 30))).tolist()
    out = engine.generate(prompt, max_new_tokens=MAX_NEW).output_ids
    acc = intra.replay_acceptance(target, drafter, prompt, out, SIZES, MAX_NEW,
                                  engine.length_buckets)
    for b in SIZES:
      g = engine.generate(prompt, max_new_tokens=MAX_NEW, block_size=b)
      assert g.output_ids == out
      yield out, acc[b], b, g


def test_replay_predicts_every_real_cycle(models):
  partial = 0
  for out, acc, b, g in _replayed_runs(models, 0):
    m = 1
    for a in g.acceptance_lengths:  # a cycle starting with m committed tokens kept a tokens
      # The replay cannot see past the output's end; the engine keeps no token past it.
      assert min(int(acc[m]) + 1, len(out) - m) == a, (b, m, a, acc[:m + 3])
      partial += 0 < a - 1 < b - 1
      m += a
    assert m == len(out)
    assert intra.fixed_cycles(acc) == len(g.acceptance_lengths) == g.target_forwards
    assert intra.forward_schedule(acc) == list(zip(g.forward_lengths, g.forward_is_cycle))
  assert partial >= 3  # intermediate acceptance lengths were checked, not only 0 and b-1


def test_replay_reproduces_the_fallback_loop(models):
  """With the engine's AR fallback, the replayed schedule is the loop that ran: every target
  forward, cycle or AR step, and its committed tokens."""
  steps = 0
  for out, acc, b, g in _replayed_runs(models, 1, ar_fallback=4, ar_fallback_accept=1):
    assert intra.forward_schedule(acc, 4, 1) == list(zip(g.forward_lengths,
                                                         g.forward_is_cycle)), b
    assert intra.fallback_schedule(acc, 4, 1) == (g.cycles, g.ar_steps)
    steps += g.ar_steps
  assert steps > 0  # the fallback ran


def test_forward_schedule_by_hand():
  # M = 8; size 3 accepts 0 at m=1 (a poor cycle: 2 AR steps follow), then 2 (a full block).
  acc = np.array([0, 0, 2, 2, 2, 2, 2, 2])
  want = [(1, True), (1, False), (1, False), (3, True), (1, True)]  # the last keeps 1 of 3
  assert intra.forward_schedule(acc, ar_fallback=4, ar_fallback_accept=0) == want
  assert intra.fallback_schedule(acc, 4, 0) == (3, 2)
  assert sum(n for n, _ in want) == len(acc) - 1  # as Generation.forward_lengths: new tokens - 1
  # Without the fallback: cycles only (m: 1 -> 2 -> 5 -> 8).
  assert intra.forward_schedule(acc) == [(1, True), (3, True), (3, True)]
  # The k-th poor cycle in a row is followed by min(2^k, ar_fallback) steps, capped at the end.
  poor = np.zeros(12, np.int64)
  assert [c for _, c in intra.forward_schedule(poor, 3, 1)] == (
      [True, False, False, True, False, False, False, True, False, False, False])


def test_analysis_models_the_fallback_loop():
  acc = {3: np.array([0, 0, 2, 2, 2, 2, 2, 2])}
  a = intra.analyse_request(acc, {3: 1.0}, ar_step_s=0.5, ar_fallback=4, ar_fallback_accept=0)
  assert a["fixed_cycles"] == {"3": 3} and a["fixed_ar_steps"] == {"3": 2}
  # Target forwards: the fixed loop takes 5 (3 cycles, 2 AR steps); the per-cycle oracle 3.
  f = a["forwards"]
  assert f["best_fixed"] == 5 and f["per_cycle"] == 3 and f["per_cycle_forwards"] == 3
  # Seconds: 3 cycles * 1.0 + 2 AR steps * 0.5; the oracle takes an AR step at m=1 (0.5 < 1.0
  # for the same one token), then two full blocks.
  s = a["seconds"]
  assert s["best_fixed"] == pytest.approx(4.0) and s["per_cycle"] == pytest.approx(2.5)
  assert s["switched_forwards"] == 0 and s["distinct_sizes"] == 2  # an AR step is no switch
  # Without the fallback the fixed loop has no AR steps and the oracle no AR option.
  plain = intra.analyse_request(acc, {3: 1.0})
  assert plain["fixed_ar_steps"] == {"3": 0} and plain["forwards"]["best_fixed"] == 3
  assert plain["seconds"]["per_cycle"] == pytest.approx(3.0)
  with pytest.raises(ValueError, match="ar_step_s"):
    intra.analyse_request(acc, {3: 1.0}, ar_fallback=4)


def test_fixed_cycles_and_per_cycle_oracle_by_hand():
  # M = 6 tokens; size 2 accepts 1 everywhere; size 3 accepts 0 except 2 at m=1 and m=3.
  acc = {2: np.array([0, 1, 1, 1, 1, 1]), 3: np.array([0, 2, 0, 2, 0, 0])}
  assert intra.fixed_cycles(acc[2]) == 3   # m: 1 -> 3 -> 5 -> 7
  assert intra.fixed_cycles(acc[3]) == 3   # m: 1 -> 4 -> 5 -> 6
  # Two optimal schedules of 2 cycles: 3 then 2 (1 -> 4 -> 6) or 2 then 3 (1 -> 3 -> 6); ties go
  # to the preferred size.
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.0}, prefer=2) == (2.0, [2, 3])
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.0}, prefer=3) == (2.0, [3, 2])
  # When size 3 costs more per cycle, the cheapest mixes least of it.
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.5}, prefer=3) == (2.5, [3, 2])
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 2.5}, prefer=3) == (3.0, [2, 2, 2])


def test_per_cycle_oracle_never_worse_than_any_fixed_size():
  rng = np.random.default_rng(3)
  for _ in range(50):
    M = int(rng.integers(2, 40))
    acc = {b: np.minimum(rng.geometric(0.4, M) - 1, b - 1) for b in (2, 3, 5, 8)}
    costs = {b: 1.0 + 0.1 * b for b in acc}
    for c in ({b: 1.0 for b in acc}, costs):
      total, schedule = intra.per_cycle_oracle(acc, c, prefer=3)
      assert all(total <= intra.fixed_cycles(acc[b]) * c[b] + 1e-9 for b in acc)
      # The schedule really reaches M and costs `total`.
      m, spent = 1, 0.0
      for b in schedule:
        m += int(acc[b][m]) + 1
        spent += c[b]
      assert m >= M and spent == pytest.approx(total)
      # Brute force over all schedules on short requests.
      if M <= 7:
        best = min(_brute(acc, c, M, 1), default=0.0)
        assert total == pytest.approx(best)


def _brute(acc, costs, M, m):
  if m >= M:
    yield 0.0
    return
  for b in acc:
    for rest in _brute(acc, costs, M, m + int(acc[b][m]) + 1):
      yield costs[b] + rest


def test_analysis_counts_switches_only_when_needed():
  acc = {2: np.array([0, 1, 1, 1, 1, 1]), 3: np.array([0, 2, 2, 2, 2, 2])}
  a = intra.analyse_request(acc, {2: 1.0, 3: 1.0})
  assert a["forwards"]["best_fixed_size"] == 3 and a["forwards"]["switched_forwards"] == 0
  assert a["forwards"]["per_cycle"] == a["forwards"]["best_fixed"] == 2
  s = intra.summarize([a, a])
  assert s["forwards"]["gain_per_cycle_over_per_request"] == 0.0
  assert s["forwards"]["global_static_size"] == 3 and s["forwards"]["global_static"] == 4
