"""The priced controller's decline (`bp_jax.decoding.decline`, `--config.controller_decline`).

The rule is unit-tested on given numbers: no decline before the evidence, the drafter's
expectation scaled by the measured acceptance, a batch's sum against its rows' price, the
evidence's update. The loops run on `toy_models.zeros_drafter_pair`, whose drafter's
probabilities (1/64 for every draft) understate its acceptance by ~50x: outputs equal AR's
(greedy, and at T = 1 for a seed under exact), cycles that verified none of their drafts
appear where verifies are dear and not where they are cheap, and the engine carries the
evidence from request to request, alone and in a batch.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding import decline
from bp_jax.decoding import evidence
from bp_jax.decoding.options import declines_by_costs
from bp_jax.errors import BadInputError
from toy_models import assert_sampled_like_ar, toy_engine, toy_requests

B = 4  # the toy engine's block size
CHEAP = dict(controller_costs="1,1.05,1.1", controller_draft_cost=0.1)
# A verify of 4 tokens costs 4 AR steps (the drafter pass aside): only a cycle expected to
# accept 3 drafts pays for it.
DEAR = dict(controller_costs="1,2.5,4", controller_draft_cost=1.0)


def _declines(expected, active, price, state, level: int = 0) -> bool:
  return bool(decline.declines(jnp.asarray(expected, jnp.float32), jnp.asarray(active),
                               jnp.float32(price), jnp.asarray(state, jnp.float32), level))


# -- the rule -----------------------------------------------------------------------------------
def test_the_verify_price_leaves_the_drafter_pass_out():
  # break_even_N[n] = (draft + V(n)) / V(1): draft 1.5, V = 1, 2, 2.5 for n = 1, 2, 4 tokens.
  be_N = jnp.asarray([1.0, 2.5, 3.5, 3.75, 4.0])
  assert float(decline.verify_price(4, be_N)) == pytest.approx(2.5)   # V(4) / V(1)
  assert float(decline.verify_price(2, be_N)) == pytest.approx(2.0)


def test_a_cycle_declines_only_on_evidence_and_by_the_measured_acceptance():
  seen = [decline.EVIDENCE_ROWS, 8.0, 16.0]  # 2 drafts accepted per one expected
  # Expected 0.5 drafts read as 1 accepted: 2 tokens < 2.5 AR steps of verify.
  assert _declines([0.5], [True], 2.5, seen)
  assert not _declines([1.0], [True], 2.5, seen)  # 3 tokens >= 2.5
  # The same probabilities taken at face value (scale 1) decline both.
  face = [decline.EVIDENCE_ROWS, 8.0, 8.0]
  assert _declines([0.5], [True], 2.5, face) and _declines([1.0], [True], 2.5, face)
  # Too little evidence: never declines, whatever the probabilities.
  assert not _declines([0.0], [True], 2.5, [decline.EVIDENCE_ROWS - 1, 8.0, 0.0])
  assert not _declines([0.0], [True], 2.5, decline.empty_state())
  # The probe after a longer back-off verifies, whatever it expects.
  assert _declines([0.0], [True], 2.5, seen, level=decline.MAX_DECLINE_LEVEL)
  assert not _declines([0.0], [True], 2.5, seen, level=decline.MAX_DECLINE_LEVEL + 1)
  # A batch: its decoding rows' tokens against their number times the price; a row that is not
  # decoding does not count, and a batch without one never declines.
  assert not _declines([0.25, 1.5, 0.0], [True, True, False], 2.5, seen)  # 1.5 + 4 >= 5
  assert _declines([0.25, 1.0, 9.0], [True, True, False], 2.5, seen)     # 1.5 + 3 < 5
  assert not _declines([0.0, 0.0], [False, False], 2.5, seen)


def test_the_evidence_adds_the_rows_that_committed_and_forgets_the_older():
  state = jnp.asarray([10.0, 5.0, 20.0])
  full = decline.observed(state, B - 1, B, jnp.asarray([0.5, 2.0, 1.0]), jnp.asarray([3, -1, 0]))
  f = decline.EVIDENCE_FORGET
  np.testing.assert_allclose(np.asarray(full), [10 * f + 2, 5 * f + 1.5, 20 * f + 3], rtol=1e-6)
  # No row committed, or a declined cycle (k = 0): nothing learned, nothing forgotten.
  for k, a in ((B - 1, [-1]), (0, [0])):
    same = decline.observed(state, k, B, jnp.asarray([0.5]), jnp.asarray(a))
    np.testing.assert_allclose(np.asarray(same), [10.0, 5.0, 20.0])
  p = jnp.asarray([[0.5, 0.5, 0.0], [1.0, 1.0, 1.0]])
  np.testing.assert_allclose(np.asarray(decline.expected_accepted(p)), [0.75, 3.0])


@pytest.mark.parametrize("field", ["controller_decline", "controller_persist"])  # and the gate's
def test_the_command_line_carries_it(field):
  cfg = lambda **kw: ml_collections.ConfigDict(dict(controller="priced", **kw))
  # The decline is left to the engine's costs unless given (`Engine._declining`).
  assert loop_options(cfg())[field] is (None if field == "controller_decline" else True)
  assert loop_options(cfg(**{field: False}))[field] is False
  assert loop_options(cfg(**{field: True}))[field] is True
  if field == "controller_decline":
    assert loop_options(cfg(**{field: "auto"}))[field] is None
    assert loop_options(cfg(**{field: "false"}))[field] is False
  with pytest.raises(BadInputError, match=f"--config.{field}='yes'"):
    loop_options(cfg(**{field: "yes"}))


def test_the_engine_declines_only_where_a_declined_cycle_saves_enough(zeros_models):
  """Left to the engine, the decline is on where a verify of its largest block size costs at
  least `DECLINE_MIN_SAVING` AR steps more than an AR step (as its forward over one token, or
  two where AR steps are padded), else off; given, as given."""
  assert declines_by_costs((1.0, 1.5, 1.9), 4, 1)              # this CPU's kind: 0.9 saved
  assert not declines_by_costs((1.0, 1.02, 1.05, 1.09, 1.23), 16, 1)  # an H100's batch 4
  assert declines_by_costs((1.0, 1.03, 1.15, 1.38, 1.90), 16, 1)      # its batch 16
  assert not declines_by_costs((1.0, 0.67, 0.68, 0.7, 0.72), 16, 2)   # batch 1, padded steps
  for kw, want in ((CHEAP, False), (DEAR, True), (dict(CHEAP, controller_decline=True), True)):
    eng = toy_engine(zeros_models, "priced", **kw)
    assert eng.loop_options.controller_decline is want
    assert eng.evidence_state is not None  # the gate keeps its evidence either way


def test_each_block_size_declines_by_its_own_verify(zeros_models):
  """Left to the engine's costs, the decline is each loop's own: in an engine of sizes 2 and 4
  whose 4-token verify saves 0.9 AR steps and whose 2-token one 0.5 less than that, only the
  size-4 loop declines (`LoopOptions.decline_sizes`); given, every size as given."""
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import LoopOptions, ShapeOptions
  costs = dict(controller="priced", controller_costs="1,1.3,1.9", controller_draft_cost=0.8)
  assert declines_by_costs((1.0, 1.3, 1.9), 4, 1) and not declines_by_costs((1.0, 1.3, 1.9), 2, 1)
  shapes = ShapeOptions(max_len=128, length_buckets=(16, 32, 64), block_sizes=(1, 2, 4))
  engine = lambda **kw: Engine(zeros_models[0], drafter=zeros_models[1], shapes=shapes,
                               loop=LoopOptions(**costs, **kw))
  eng = engine()
  opts = eng.programs.options
  assert opts.controller_decline is True and opts.decline_sizes == (4,)
  assert [opts.for_loop(b).controller_decline for b in (2, 4)] == [False, True]
  assert opts.for_loop(4).decline_sizes is None  # resolved in each loop's own options
  prompt, ar = toy_requests(1)[0][0], Engine(zeros_models[0], shapes=shapes)
  want = ar.generate(prompt, max_new_tokens=24).output_ids
  for b in (2, 4):  # each loop as built: AR's tokens
    assert eng.generate(prompt, max_new_tokens=24, block_size=b).output_ids == want
  given = engine(controller_decline=True).programs.options
  assert given.decline_sizes is None and all(given.for_loop(b).controller_decline for b in (2, 4))


# -- the loops ----------------------------------------------------------------------------------
def _declined(gens) -> int:
  """Cycles that verified none of their drafts (a forward over 1 token after a drafter pass)."""
  return sum(v == 1 for g in gens for v in g.forward_verified)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_dear_verifies_decline_drafts_and_the_outputs_stay_ar(zeros_models, zeros_ar_outputs,
                                                              batch_size):
  prompts, max_news = toy_requests(6)
  declined, seen = {}, {}
  for name, kw in (("cheap", CHEAP), ("dear", DEAR), ("off", dict(DEAR, controller_decline=False))):
    eng = toy_engine(zeros_models, "priced", batch_size=batch_size, sync_cycles=2,
                     start_backoff=False, **kw)
    # Three times over: the later passes decide on the earlier passes' evidence.
    for _ in range(3):
      outs = ([eng.generate(p, max_new_tokens=m, block_size=B)
               for p, m in zip(prompts, max_news)] if batch_size == 1 else
              eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B))
      assert [g.output_ids for g in outs] == zeros_ar_outputs
    declined[name], seen[name] = _declined(outs), eng.evidence_state[evidence.DECLINE]
  assert declined["dear"] > 0 and declined["cheap"] == declined["off"] == 0
  assert not np.any(seen["off"])  # the state is the back-off gate's there (`evidence`)
  rows, expected, accepted = seen["dear"]
  # The toy drafter accepts far more than its probabilities say, and the engine measured it.
  assert rows >= decline.EVIDENCE_ROWS and accepted > 10 * expected


def test_sampled_output_equals_ar_for_a_seed(zeros_models):
  eng = toy_engine(zeros_models, "priced", sync_cycles=2, start_backoff=False, **DEAR)
  prompts, max_news = toy_requests(6)
  for p, m in zip(prompts, max_news):  # evidence first, so that cycles may decline below
    eng.generate(p, max_new_tokens=m, block_size=B)
  assert eng.evidence_state[0] >= decline.EVIDENCE_ROWS
  declined_before = eng.forwards_run[1]  # forwards over 1 token after a drafter pass
  assert_sampled_like_ar(zeros_models, eng, B)
  assert eng.forwards_run[1] > declined_before
