"""The per-cycle verify-length controller (`--config.controller`, `decoding/controller.py`).

The decision rule is unit-tested on synthetic confidences against a brute-force reading of the
cost rule; the loops are tested on `toy_models.zeros_drafter_pair` (a drafter with uniform
logits that always drafts token 0): every verify bucket, forced with the tests' "fixed:k"
controller, and the confidence controller give AR's tokens (greedy, and at T > 0 for a seed with
verify=exact), compile one loop per block size whatever the buckets chosen, hold no copy of a
cache buffer, and batched rows equal their requests alone.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bp_jax.decoding import controller as control
from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.decoding.generation import forward_cost_units
from bp_jax.errors import BadInputError
from toy_models import toy_engine as _engine
from toy_models import toy_requests as _requests
from toy_models import assert_one_spec_loop, assert_sampled_like_ar, toy_ar_outputs, zeros_drafter_pair

V, MAX_LEN, BUCKETS, B = 64, 128, (16, 32, 64), 4
# Flat costs and a free drafter: E_k / cost_k grows with k, so confidence verifies every draft.
FLAT = dict(controller_costs="1,1,1", controller_draft_cost=0.0)
# CPU-like costs (a forward over 1, 2, 4, 8 tokens; a drafter pass), given where a test asserts
# a choice (without them the engine measures its own, which differ by machine).
CPU = dict(controller_costs="1.0,2.01,2.25,2.58", controller_draft_cost=1.58)


@pytest.fixture(scope="module")
def models():
  return zeros_drafter_pair(V)


@pytest.fixture(scope="module")
def ar_outputs(models):
  return toy_ar_outputs(models, 5)


# -- the pure rule ----------------------------------------------------------------------------
def test_verify_buckets():
  assert control.verify_buckets(8) == (0, 1, 3, 7)
  assert control.verify_buckets(4) == (0, 1, 3)
  assert control.verify_buckets(2) == (0, 1)
  assert control.verify_buckets(6) == (0, 1, 3, 5)
  assert control.verify_buckets(16) == (0, 1, 3, 7, 15)
  assert control.fixed_k("fixed:3", 8) == 3 and control.fixed_k("confidence", 8) is None
  with pytest.raises(ValueError, match="not a verify bucket"):
    control.fixed_k("fixed:2", 8)


def test_verify_cost_table():
  costs = (1.0, 1.5, 2.0, 4.0)  # 1, 2, 4, 8 tokens
  assert control.verify_cost(1, costs) == 1.0 and control.verify_cost(8, costs) == 4.0
  assert control.verify_cost(3, costs) == pytest.approx(1.75)
  assert control.verify_cost(16, costs) == pytest.approx(8.0)  # last slope extended
  assert control.verify_cost(5, (2.0,)) == 2.0
  np.testing.assert_allclose(control.bucket_costs(8, costs, 0.5), [1.5, 2.0, 2.5, 4.5])


def _brute_force(p_Bk, active_B, b, costs, draft_cost):
  """The cost rule read literally, in numpy."""
  ks = control.verify_buckets(b)
  rates = []
  for k in ks:
    E = [1 + sum(np.prod(p[:j]) for j in range(1, k + 1)) for p in p_Bk]
    total = sum(e for e, a in zip(E, active_B) if a)
    rates.append(total / (draft_cost + control.verify_cost(k + 1, costs)))
  best = int(np.argmax(rates))
  return best, rates[best] >= sum(active_B) / control.verify_cost(1, costs)


@pytest.mark.parametrize("p_Bk, active_B, costs, draft_cost, want_k, want_draft", [
    ([[0.99] * 7], [True], (1.0, 1.1, 1.3, 1.7), 0.5, 7, True),    # confident: verify all
    ([[0.9, 0.05, 0.9, 0.9, 0.9, 0.9, 0.9]], [True], (1.0, 1.1, 1.3, 1.7), 0.5, 1, True),
    ([[0.9, 0.8, 0.1, 0.9, 0.9, 0.9, 0.9]], [True], (1.0, 1.1, 1.3, 1.7), 0.5, 3, True),
    ([[0.05] * 7], [True], (1.0, 1.1, 1.3, 1.7), 0.5, 0, False),   # hopeless: AR next
    ([[0.6] * 7], [True], (1.0, 1.1, 1.3, 1.7), 1.5, 3, False),    # best rate < AR rate
    ([[0.6] * 7], [True], (1.0, 1.1, 1.3, 1.7), 0.8, 3, True),     # a cheaper drafter pays
    # A batch: one confident row, one hopeless, one idle (ignored) confident row.
    ([[0.95] * 7, [0.01] * 7, [0.99] * 7], [True, True, False], (1.0, 1.2, 1.5, 2.5), 0.3,
     7, True),
    ([[0.95] * 7, [0.01] * 7, [0.01] * 7], [True, True, True], (1.0, 1.2, 1.5, 2.5), 0.3,
     3, True),
    ([[0.01] * 7, [0.99] * 7], [True, False], (1.0, 1.2, 1.5, 2.5), 0.3, 0, False),
    ([[0.95] * 7, [0.01] * 7, [0.01] * 7], [True, True, True], (1.0, 1.2, 1.5, 2.5), 0.6,
     7, False),
])
def test_choice_follows_the_cost_rule(p_Bk, active_B, costs, draft_cost, want_k, want_draft):
  b = 8
  ks = control.verify_buckets(b)
  idx, draft_next = control.choose(jnp.asarray(p_Bk, jnp.float32), jnp.asarray(active_B), ks,
                                   control.bucket_costs(b, costs, draft_cost),
                                   control.verify_cost(1, costs))
  assert (ks[int(idx)], bool(draft_next)) == (want_k, want_draft)
  best, draft = _brute_force(p_Bk, active_B, b, costs, draft_cost)
  assert (ks[best], draft) == (want_k, want_draft)


def test_expected_committed_and_drafted_probs():
  p = jnp.asarray([[0.5, 0.5, 1.0]])
  np.testing.assert_allclose(control.expected_committed(p, (0, 1, 3)), [[1.0, 1.5, 2.0]])
  logits = jnp.log(jnp.asarray([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]]))
  np.testing.assert_allclose(control.drafted_probs(logits, jnp.asarray([[0, 1]])),
                             [[0.7, 0.3]], rtol=1e-5)


# -- the loops --------------------------------------------------------------------------------
@pytest.mark.parametrize("controller, kw", [("fixed:0", {}), ("fixed:1", {}), ("fixed:3", {}),
                                            ("confidence", CPU), ("confidence", FLAT),
                                            ("backoff", dict(ar_fallback=4))])
def test_every_bucket_and_controller_is_lossless(models, ar_outputs, controller, kw):
  eng = _engine(models, controller, **kw)
  prompts, max_news = _requests(5)
  outs = [eng.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in outs] == ar_outputs
  lengths = [a for g in outs for a, cyc in zip(g.forward_lengths, g.forward_is_cycle) if cyc]
  if controller.startswith("fixed:"):  # a cycle verifying k drafts commits at most k + 1
    k = int(controller[6:])
    assert max(lengths) == k + 1 and all(g.forward_is_cycle[:-1] == [True] * (
        len(g.forward_is_cycle) - 1) for g in outs)
  elif controller == "confidence" and kw is CPU:
    # The drafter is uniform (p = 1/64): it never pays to verify a draft, and after each such
    # cycle the next forward is an AR step without a drafter pass.
    assert set(lengths) == {1}
    assert any(not cyc for g in outs for cyc in g.forward_is_cycle)
  elif controller == "confidence" and kw is FLAT:
    assert max(lengths) == B and all(all(g.forward_is_cycle) for g in outs)
  assert eng.controller == controller  # the loop form in effect (the decode summary's)


def _drafter_runs(verified: list[int]) -> list[int]:
  """The lengths of the runs of forwards without a drafter pass (verified 0) that follow each
  drafter pass (verified > 0), the last one cut by the request's end included."""
  runs = []
  for v in verified:
    if v > 0:
      runs.append(0)
    elif runs:
      runs[-1] += 1
  return runs


@pytest.mark.parametrize("controller, kw, want", [
    ("fixed:0", {}, 1), ("fixed:1", {}, 2), ("fixed:3", {}, 4),
    ("backoff", dict(ar_fallback=4), B), ("none", {}, B)])
def test_each_forward_records_what_it_verified(models, controller, kw, want):
  """k + 1 for a cycle verifying k drafts (its target forward's tokens), 0 for an AR step; the
  cost in AR steps follows: one drafter pass per cycle plus each forward's verify cost."""
  eng = _engine(models, controller, **kw)
  prompts, max_news = _requests(4, seed=5)
  for p, m in zip(prompts, max_news):
    g = eng.generate(p, max_new_tokens=m, block_size=B)
    assert len(g.forward_verified) == len(g.forward_lengths) == len(g.forward_is_cycle)
    assert g.forward_verified == [want if cyc else 0 for cyc in g.forward_is_cycle]
    assert g.drafter_passes == g.cycles and g.verified_drafts == [want - 1] * g.cycles
    costs, draft_cost = (1.0, 1.5, 2.0), 0.75
    assert forward_cost_units(g.forward_verified, costs, draft_cost) == pytest.approx(
        g.cycles * (draft_cost + control.verify_cost(want, costs)) + g.ar_steps)
  ar = eng.generate(prompts[0], max_new_tokens=max_news[0], block_size=1)
  assert ar.forward_verified == [0] * ar.target_forwards and ar.drafter_passes == 0
  assert forward_cost_units(ar.forward_verified, (1.0, 3.0), 9.0) == ar.target_forwards


def test_forward_cost_units():
  costs = (1.0, 2.0, 2.5, 3.0)  # 1, 2, 4, 8 tokens
  assert forward_cost_units([], costs, 1.5) == 0.0
  assert forward_cost_units([0, 0, 0], costs, 1.5) == 3.0  # AR steps: no drafter pass
  # A cycle verifying 7 drafts (8 tokens), one verifying 0 (1 token), one AR step.
  assert forward_cost_units([8, 1, 0], costs, 1.5) == pytest.approx((1.5 + 3.0) + (1.5 + 1) + 1)
  assert forward_cost_units([3], costs, 0.0) == pytest.approx(2.25)  # interpolated


@pytest.mark.parametrize("ar_fallback, want_runs", [(1, [1] * 8), (4, [2, 4, 4, 4]),
                                                    (0, [2, 4, 8, 16])])
def test_declined_cycles_back_off(models, ar_fallback, want_runs):
  """The uniform drafter is never worth verifying: every cycle is declined, and the AR steps
  between drafter passes grow 2, 4, ... up to ar_fallback (16 when 0); ar_fallback = 1 is one
  step per declined cycle. Outputs stay AR's."""
  eng = _engine(models, "confidence", ar_fallback=ar_fallback, **CPU)
  assert eng.ar_fallback == (ar_fallback or control.DEFAULT_SKIP_CAP)
  ar = _engine(models, "none")
  prompt = _requests(1, seed=6)[0][0]
  g = eng.generate(prompt, max_new_tokens=60, block_size=B)
  assert g.output_ids == ar.generate(prompt, max_new_tokens=60, block_size=1).output_ids
  assert set(g.verified_drafts) == {0}
  runs = _drafter_runs(g.forward_verified)
  assert runs[:len(want_runs)] == want_runs
  assert g.drafter_passes == len(runs) and g.drafter_passes < g.target_forwards


@pytest.mark.parametrize("poor_miss", [False, True])
def test_poor_cycles_count_as_misses_when_asked(models, ar_outputs, poor_miss):
  """With flat costs and a free drafter the controller always verifies every draft, and the
  zeros drafter's drafts are (nearly) always rejected: only with `controller_poor_miss` do such
  cycles back off into AR steps. Lossless either way."""
  eng = _engine(models, "confidence", ar_fallback=4, controller_poor_miss=poor_miss, **FLAT)
  prompts, max_news = _requests(5)
  outs = [eng.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in outs] == ar_outputs
  assert all(set(g.verified_drafts) == {B - 1} for g in outs)
  ar_steps = sum(g.ar_steps for g in outs)
  assert (ar_steps > 0) == poor_miss


def test_calibration_fit_lookup_and_file(tmp_path):
  # Bins of width 0.5: 3 drafts at p < 0.5 (1 accepted), 1 at p >= 0.5 (accepted).
  rates = control.fit_calibration(np.asarray([0.1, 0.2, 0.3, 0.9]), np.asarray([1, 0, 0, 1]), 2,
                                  prior=2.0)
  assert rates == pytest.approx(((1 + 2 * 0.25) / 5, (1 + 2 * 0.75) / 3), abs=1e-4)
  assert control.fit_calibration(np.asarray([0.1]), np.asarray([1]), 4)[3] == 0.875  # empty bin
  p = jnp.asarray([[0.0, 0.25, 0.5, 0.75, 1.0]])
  np.testing.assert_allclose(control.calibrated(p, (0.2, 0.6)), [[0.2, 0.2, 0.4, 0.6, 0.6]],
                             rtol=1e-6)
  assert control.calibrated(p, None) is p
  path = tmp_path / "calibration.json"
  path.write_text('{"rates": [0.1, 0.5, 0.9]}')
  assert control.load_calibration(str(path)) == (0.1, 0.5, 0.9)
  assert control.load_calibration("") is None
  for text in ('{"rates": [0.1, 1.5]}', '{"rates": []}', '{"bins": []}', "not json"):
    path.write_text(text)
    with pytest.raises(BadInputError, match="--config.controller_calibration"):
      control.load_calibration(str(path))


@pytest.mark.parametrize("calibration, want_k", [(None, 0), ((1.0, 1.0), B - 1)])
def test_calibration_replaces_the_drafters_probabilities(models, ar_outputs, calibration,
                                                         want_k):
  """The uniform drafter's p = 1/64 never pays; a table saying every draft is accepted makes the
  controller verify all of them (CPU-like costs). Lossless either way."""
  eng = _engine(models, "confidence", controller_calibration=calibration, **CPU)
  prompts, max_news = _requests(5)
  outs = [eng.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in outs] == ar_outputs
  assert {k for g in outs for k in g.verified_drafts} == {want_k}


@pytest.mark.parametrize("controller", ["fixed:1", "confidence"])
def test_sampled_output_equals_ar_for_a_seed(models, controller):
  assert_sampled_like_ar(models, _engine(models, controller, verify="exact", **FLAT), B)


def test_rejection_with_k0_is_the_ar_draw(models):
  """Verifying no draft is an AR step under `rejection` too: same tokens as AR for a seed."""
  ar = Engine(models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  eng = _engine(models, "fixed:0", verify="rejection")
  prompts, max_news = _requests(3, seed=2)
  for p, m in zip(prompts, max_news):
    want = ar.generate(p, max_new_tokens=m, seed=3, temperature=1.0).output_ids
    assert eng.generate(p, max_new_tokens=m, block_size=B, seed=3, temperature=1.0
                        ).output_ids == want


def test_one_loop_per_block_size_and_no_cache_copy(models):
  eng = _engine(models, "confidence", controller_costs="1,1.3,1.6", controller_draft_cost=0.01)
  assert_one_spec_loop(eng, B)
  hlo = eng.compiled._fns[("spec_loop", B)].as_text()
  # A cache buffer per layer: k [Z, S, H] / v [Z, H, S] (Z = 1 row x 2 kv heads, H = 8), with a
  # leading layer axis in the scanned form (the drafter's context cache has the same shapes).
  cache_shape = re.compile(rf"= f32\[([0-9]+,)?2,({MAX_LEN},8|8,{MAX_LEN})\]\{{[0-9,]*\}} copy\(")
  assert [line.strip()[:120] for line in hlo.splitlines() if cache_shape.search(line)] == []
  assert re.search(rf"f32\[2,{MAX_LEN},8\]", hlo) and re.search(rf"f32\[2,8,{MAX_LEN}\]", hlo)
  # The HLO does hold the four verify shapes (k + 1 = 1, 2, 4 tokens) in its nested loops.
  assert hlo.count(" while(") >= 1 + len(control.verify_buckets(B))


@pytest.mark.parametrize("controller, kw", [("confidence", CPU), ("fixed:1", {})])
def test_batched_rows_equal_their_request_alone(models, controller, kw):
  one = _engine(models, controller, **kw)
  many = _engine(models, controller, batch_size=3, sync_cycles=2, **kw)
  prompts, max_news = _requests(7, seed=4)
  alone = [one.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  cache_shape = re.compile(rf"= f32\[([0-9]+,)?6,({MAX_LEN},8|8,{MAX_LEN})\]\{{[0-9,]*\}} copy\(")
  for key, fn in many.compiled._fns.items():
    if key[0] == "batch_spec_loop":
      assert [ln for ln in fn.as_text().splitlines() if cache_shape.search(ln)] == []


@pytest.mark.parametrize("kw, flag", [
    (dict(controller="fast"), "--config.controller"),
    (dict(controller_costs="1,x", controller_draft_cost=1), "--config.controller_costs"),
    (dict(controller_costs="1,-2", controller_draft_cost=1), "--config.controller_costs"),
    (dict(controller_costs="1,2", controller_draft_cost=-1), "--config.controller_draft_cost"),
])
def test_bad_controller_settings_name_the_parameter_and_the_flag(models, kw, flag):
  """The library names its parameter, the command line (`loop_options`) the flag."""
  param = flag.removeprefix("--config.")
  with pytest.raises(BadInputError, match=rf"(?<![\w.-]){re.escape(param)}="):
    Engine(models[0], shapes=ShapeOptions(max_len=MAX_LEN), loop=LoopOptions(**kw))
  with pytest.raises(BadInputError, match=re.escape(flag)):
    loop_options(ml_collections.ConfigDict(kw))


def test_loop_options_carry_the_controller(tmp_path):
  path = tmp_path / "calibration.json"
  path.write_text('{"rates": [0.2, 0.8]}')
  cfg = ml_collections.ConfigDict(dict(controller="confidence", controller_costs="1,2",
                                       controller_draft_cost=0.5, ar_fallback=8,
                                       controller_poor_miss=True,
                                       controller_calibration=str(path)))
  opts = loop_options(cfg)
  assert opts["controller"] == "confidence" and opts["controller_costs"] == (1.0, 2.0)
  assert opts["controller_draft_cost"] == 0.5 and opts["ar_fallback"] == 8
  assert opts["controller_poor_miss"] and opts["controller_calibration"] == (0.2, 0.8)
  assert loop_options(ml_collections.ConfigDict(dict(controller="none", ar_fallback=8))
                      )["ar_fallback"] == 0
  with pytest.raises(BadInputError, match="--config.controller"):
    loop_options(ml_collections.ConfigDict(dict(controller="maybe")))


def test_priced_has_its_own_cap_and_labels_keep_ar_fallback():
  """`controller_priced_cap` sets priced's longest run of AR steps apart from `ar_fallback`,
  which stays the back-off label sets are measured under: the demo's labels (ar_fallback 16)
  still match a decode whose priced backs off up to 64 steps; 0 falls back to ar_fallback."""
  from bp_jax.data.label_sets import decode_settings
  from bp_jax.decode_job.block_choice import labelling_loop_options

  def cfg(**kw):
    return ml_collections.ConfigDict(dict(controller="priced", ar_fallback=16, **kw))

  long, plain = loop_options(cfg(controller_priced_cap=64)), loop_options(cfg())
  assert (long["priced_cap"], plain["priced_cap"]) == (64, 0)
  assert LoopOptions(**long).in_effect().ar_fallback == 64
  assert LoopOptions(**plain).in_effect().ar_fallback == 16
  assert LoopOptions(controller="priced").in_effect().ar_fallback == control.PRICED_SKIP_CAP
  labelled = labelling_loop_options(cfg(controller_priced_cap=64))
  assert (labelled["controller"], labelled["ar_fallback"], labelled["priced_cap"]) == (
      "backoff", 16, 0)
  assert (decode_settings(128, 0.0, False, long) == decode_settings(128, 0.0, False, plain)
          == decode_settings(128, 0.0, False, labelled))
  with pytest.raises(BadInputError, match=re.escape("--config.controller_priced_cap=-1")):
    loop_options(cfg(controller_priced_cap=-1))
