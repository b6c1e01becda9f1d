"""BlockPilot's policy (bp_jax/policy/mlp.py, policy_features.py) and its place in decoding: features
equal a recomputation from the target's outputs, the policy adds no target pass to the prefill,
learned decoding is lossless and compiles nothing per request, a policy learns a known labelling
rule, and checkpoints round-trip."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.decoding import loops as decode_loops
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.decoding.engine import JOINT_MARGIN, LABELLING_PRICES, LEARNED, Engine
from bp_jax.decoding.options import ShapeOptions
from bp_jax.errors import BadInputError
from bp_jax.policy.mlp import (BlockPolicy, PolicyArch, load_policy, prompt_hash, random_block_size,
                           save_policy)
from bp_jax.policy.features import (FEATURE_TYPES, feature_dims, mlp_param_count, policy_costs,
                                    pooled_layers)
from bp_jax.models.qwen3 import Qwen3
from bp_jax.optim_config import opt_config
from bp_jax.train.policy_stage import fit_policy, predict
from compile_counting import BackendCompiles

V, D, LAYERS = 64, 32, 3
LAYER_IDS = (0, 2)
SIZES = (2, 3, 5)
MAX_LEN = 96
BUCKETS = (16, 32)


def _target(seed: int = 0) -> Qwen3:
  cfg = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=True, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(seed))
  # Larger embeddings than the default init, so that greedy outputs are not constant.
  target.embed[...] = jax.random.normal(jax.random.key(seed + 1), target.embed.shape)
  return target


def _drafter(target: Qwen3, seed: int = 2) -> DFlashDrafter:
  t = target.cfg
  layers = Qwen3Config(**{**t.__dict__, "num_hidden_layers": 1, "tie_word_embeddings": False})
  cfg = DFlashConfig(layers=layers, block_size=3, num_target_layers=LAYERS, mask_token_id=V - 1,
                     target_layer_ids=LAYER_IDS)
  return DFlashDrafter(cfg, rngs=nnx.Rngs(seed))


def _policy(feature: str = "last_hidden", seed: int = 3, hidden: int = 16) -> BlockPolicy:
  dims = feature_dims(V, D, len(LAYER_IDS), draft_block_size=3)
  return BlockPolicy(PolicyArch(feature, dims[feature], hidden, 2, len(SIZES)),
                     rngs=nnx.Rngs(seed))


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, V - 1, int(rng.integers(2, 30))).tolist() for _ in range(num)]


@pytest.fixture(scope="module")
def models():
  target = _target()
  return target, _drafter(target)


@pytest.fixture(scope="module")
def engine(models):
  target, drafter = models
  return Engine(target, drafter=drafter, policy=_policy(), policy_sizes=SIZES,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS,
                                    block_sizes=(2, 3, 4, 5)))


# ---- features ------------------------------------------------------------------------------


def test_prefill_features_equal_a_recomputation_from_the_targets_outputs(models, engine):
  """The features returned by the padded prefill equal the same quantities recomputed from an
  unpadded causal forward of the target (numpy means over the true prompt positions)."""
  target, _ = models
  drafter, b = engine.drafter, engine.drafter.cfg.block_size

  @nnx.jit  # one program per prompt length (run eagerly, each operation compiled apart)
  def reference(target, drafter, ids_1n, block_1b):
    n = ids_1n.shape[1]
    out = target(ids_1n, target.init_cache(1, n), LAYER_IDS)
    # The drafter's first block [first token, MASK, ...] over the unpadded prompt's context.
    ctx = drafter.add_context(out.layer_hiddens, drafter.init_cache(1, n + b))
    h = drafter.draft(target.embed_tokens(block_1b), ctx.with_lengths(jnp.array([n])))
    return out.logits[0, n - 1], out.final_hidden[0, n - 1], out.layer_hiddens[:, 0], \
        target.project_to_vocab(h[:, 1:])[0]

  padded = 0
  for ids in _prompts(4, seed=7):
    n = len(ids)
    g = engine.generate(ids, max_new_tokens=3, return_features=True)
    block = jnp.asarray([[g.output_ids[0]] + [drafter.cfg.mask_token_id] * (b - 1)])
    logits, hidden, layers, draft_logits = map(
        np.asarray, reference(target, drafter, jnp.asarray([ids]), block))  # layers [2, n, D]
    pooled = np.concatenate([np.concatenate([layers[j].mean(axis=0), layers[j][n - 1]])
                             for j in range(len(LAYER_IDS))])
    probs = [jax.nn.softmax(jnp.asarray(x, jnp.float32), axis=-1)
             for x in (draft_logits, logits[None])]
    ent = [-np.sum(np.asarray(p) * np.log(np.asarray(p)), axis=-1) for p in probs]
    confidence = np.concatenate([np.max(probs[0], -1), ent[0], np.max(probs[1], -1), ent[1]])
    f = g.features
    assert set(f) == set(FEATURE_TYPES)
    np.testing.assert_allclose(f["last_logits"], logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f["last_hidden"], hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f["pooled_layers"], pooled, rtol=1e-4, atol=1e-4)
    assert f["draft_confidence"].shape == (2 * b,)
    np.testing.assert_allclose(f["draft_confidence"], confidence, rtol=1e-4, atol=1e-4)
    padded += engine.encode_padded(ids)[1] > n
  assert padded >= 3  # prompts padded to a bucket: padding really was excluded from the mean


def test_pooled_layers_ignores_padding_values():
  h = np.random.default_rng(0).normal(size=(2, 1, 8, 4)).astype(np.float32)
  h2 = h.copy()
  h2[:, :, 5:] = 1e6  # garbage in the padding
  a = np.asarray(pooled_layers(jnp.asarray(h), jnp.int32(5)))
  b = np.asarray(pooled_layers(jnp.asarray(h2), jnp.int32(5)))
  np.testing.assert_allclose(a, b)
  want = np.concatenate([h[0, 0, :5].mean(0), h[0, 0, 4], h[1, 0, :5].mean(0), h[1, 0, 4]])
  np.testing.assert_allclose(a[0], want, rtol=1e-5, atol=1e-6)


# ---- one target pass -----------------------------------------------------------------------


def _count_scans(jaxpr) -> int:
  """Scan equations in a jaxpr, including those nested in sub-jaxprs (jit, scan, cond)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "scan"
    for v in eqn.params.values():
      for item in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(item, "jaxpr", item)
        if hasattr(inner, "eqns"):
          n += _count_scans(inner)
  return n


def test_policy_in_prefill_adds_no_target_pass(models, monkeypatch):
  """Tracing the prefill with the policy calls the target once, like the prefill without it,
  and the traced programs hold the same number of layer scans (the policy has none)."""
  target, drafter = models
  policy = _policy("pooled_layers")
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  p_graph, p_state = nnx.split(policy)
  calls = []
  original = Qwen3.__call__

  def counting(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(Qwen3, "__call__", counting)
  args = (t_state, d_state, jnp.zeros((1, 16), jnp.int32), jnp.int32(5),
          target.init_cache(1, MAX_LEN), drafter.init_cache(1, MAX_LEN), jax.random.key(0),
          jnp.float32(0))
  scans = {}
  for name, fn, extra in (("plain", decode_loops.make_prefill(t_graph, d_graph), ()),
                          ("policy", decode_loops.make_prefill(t_graph, d_graph, p_graph),
                           (p_state,))):
    calls.clear()
    jaxpr = jax.make_jaxpr(fn)(*args, *extra)
    assert len(calls) == 1, (name, len(calls))
    scans[name] = _count_scans(jaxpr.jaxpr)
  assert scans["plain"] == scans["policy"] >= 1, scans
  # And the policy's output is the policy applied to the prefill's own feature.
  monkeypatch.setattr(Qwen3, "__call__", original)
  out = jax.jit(decode_loops.make_prefill(t_graph, d_graph, p_graph))(*args, p_state)
  want = jax.nn.softmax(policy(out.features["pooled_layers"])[0])
  np.testing.assert_allclose(np.asarray(out.policy_probs), np.asarray(want), rtol=1e-5)
  assert int(out.policy_class) == int(np.argmax(np.asarray(want)))


# ---- decoding --------------------------------------------------------------------------------




def test_learned_decoding_is_lossless_and_compiles_once_per_bucket(engine):
  prompts = _prompts(12, seed=1)
  before = dict(engine.compiled.counts)
  outs, chosen = [], []
  for p in prompts:
    ar = engine.generate(p, max_new_tokens=17, block_size=1)
    g = engine.generate(p, max_new_tokens=17, block_size=LEARNED)
    assert g.output_ids == ar.output_ids  # token-identical to AR at T=0
    assert g.block_size in SIZES and len(g.policy_probs) == len(SIZES)
    assert abs(sum(g.policy_probs) - 1.0) < 1e-4
    assert g.block_size == SIZES[int(np.argmax(g.policy_probs))]
    outs.append(g.output_ids)
    chosen.append(g.block_size)
  assert len(set(chosen)) >= 2, chosen  # the policy really picks different buckets
  used = {engine.encode_padded(p)[1] for p in prompts}
  assert used == set(BUCKETS)
  keys = set(engine.compiled.seconds)
  assert {("prefill", P, engine.policy_key) for P in BUCKETS} <= keys
  assert {("spec_loop", b) for b in set(chosen)} <= keys
  # One compilation per key: per length bucket and block size, never per request.
  for name in ("prefill", "spec_loop", "ar_loop"):
    assert engine.compiled.counts[name] == sum(k[0] == name for k in keys)
  assert engine.compiled.counts["prefill"] - before.get("prefill", 0) <= 2 * len(BUCKETS)
  counts = dict(engine.compiled.counts)
  with BackendCompiles() as compiles:
    again = [engine.generate(p, max_new_tokens=17, block_size=LEARNED).output_ids
             for p in prompts]
  assert again == outs
  assert dict(engine.compiled.counts) == counts and compiles.n == 0


def test_same_architecture_policies_share_the_compiled_prefill(engine):
  p = _prompts(1, seed=4)[0]
  engine.generate(p, max_new_tokens=4, block_size=LEARNED)
  n = engine.compiled.counts["prefill"]
  other = _policy(seed=11)  # same architecture, other weights
  engine.set_policy(other, SIZES)
  try:
    g = engine.generate(p, max_new_tokens=4, block_size=LEARNED)
    assert engine.compiled.counts["prefill"] == n  # (a new block size may compile its loop)
    feats = engine.generate(p, max_new_tokens=4, return_features=True).features
    want = jax.nn.softmax(other(jnp.asarray(feats["last_hidden"])[None])[0])
    np.testing.assert_allclose(g.policy_probs, np.asarray(want), atol=1e-5)
  finally:
    engine.set_policy(_policy(), SIZES)


def _value_policy(seed: int, prior, lam: float, static: int, favour: int | None = None
                  ) -> BlockPolicy:
  """A value policy over SIZES on last_hidden; with `favour`, rhat = 1 everywhere except 3 at
  class `favour` (strong evidence for every input), else random weights."""
  dims = feature_dims(V, D, len(LAYER_IDS), draft_block_size=3)
  policy = BlockPolicy(PolicyArch("last_hidden", dims["last_hidden"], 16, 2, len(SIZES),
                                  head="value"), rngs=nnx.Rngs(seed))
  if favour is not None:
    policy.w_out[...] = jnp.zeros_like(policy.w_out[...])
    policy.b_out[...] = jnp.ones((len(SIZES),)).at[favour].set(3.0)
  policy.set_decision(np.asarray(prior), lam, static)
  return policy


def test_value_policy_decides_inside_the_prefill(engine):
  """Through the jitted prefill: an uninformative value policy (lam = 0) decodes every request
  with the static size and reports the prior as its scores; strong evidence at lam = 1 moves
  every request; value policies of one architecture share their compiled prefill."""
  prompts = _prompts(6, seed=9)
  prior = [0.9, 1.0, 0.8]
  try:
    engine.set_policy(_value_policy(5, prior, 0.0, 1), SIZES)
    for p in prompts:
      g = engine.generate(p, max_new_tokens=5, block_size=LEARNED)
      assert g.block_size == SIZES[1]
      np.testing.assert_allclose(g.policy_probs, prior, atol=1e-6)
    n = engine.compiled.counts["prefill"]
    engine.set_policy(_value_policy(6, prior, 1.0, 1, favour=2), SIZES)
    with BackendCompiles() as compiles:
      got = [engine.generate(p, max_new_tokens=5, block_size=LEARNED) for p in prompts]
    assert [g.block_size for g in got] == [SIZES[2]] * len(prompts)
    assert engine.compiled.counts["prefill"] == n
    # One bucket loop (size 5) may compile; never a prefill.
    assert compiles.n <= 1
    ar = [engine.generate(p, max_new_tokens=5, block_size=1).output_ids for p in prompts]
    assert [g.output_ids for g in got] == ar
  finally:
    engine.set_policy(_policy(), SIZES)


def _priced_policy(counts) -> BlockPolicy:
  """A priced policy over SIZES on last_hidden predicting `counts` ([2K]) for every input."""
  dims = feature_dims(V, D, len(LAYER_IDS), draft_block_size=3)
  policy = BlockPolicy(PolicyArch("last_hidden", dims["last_hidden"], 16, 2, len(SIZES),
                                  head="priced"), rngs=nnx.Rngs(7))
  policy.w_out[...] = jnp.zeros_like(policy.w_out[...])
  policy.b_out[...] = jnp.asarray(counts, jnp.float32)
  policy.set_priced_decision(np.asarray(counts), 1.0)
  return policy


# Cycles per new token of sizes 2, 3, 5 (τ 2, 2.2, 3.3), no fallback step.
PRICED_COUNTS = np.r_[0.5, 0.45, 0.3, 0.0, 0.0, 0.0]


def test_priced_policy_decides_inside_the_prefill_by_the_engines_prices(engine, monkeypatch):
  """Through the jitted prefill: a priced policy's choice follows the costs the engine hands it
  (`Engine.policy_prices`, here a CPU's, then an accelerator's, then the CPU's again), from one
  request to the next, with no prefill compiled for a change of prices; decoding stays
  lossless. Without prices from the engine it decides at the labelling machine's."""
  prompts = _prompts(3, seed=12)
  cpu = (np.array([6.0, 8.0, 12.0]), np.ones(3))
  accelerator = (np.array([1.07, 1.08, 1.11]), np.ones(3))
  try:
    policy = _priced_policy(PRICED_COUNTS)
    policy.set_prices(*cpu)
    engine.set_policy(policy, SIZES)
    assert engine.policy_prices() is None and engine.policy_prices_source == LABELLING_PRICES
    g = engine.generate(prompts[0], max_new_tokens=5, block_size=LEARNED)
    assert g.block_size == 2 and engine.policy_prices_source == LABELLING_PRICES
    n = engine.compiled.counts["prefill"]
    got = []
    for prices, want in ((accelerator, 5), (cpu, 2), (accelerator, 5)):
      monkeypatch.setattr(engine, "policy_prices", lambda p=prices: p)
      for p in prompts:
        got.append(engine.generate(p, max_new_tokens=5, block_size=LEARNED))
        assert got[-1].block_size == want
        cost = PRICED_COUNTS[:3] * prices[0]
        np.testing.assert_allclose(got[-1].policy_probs, 1.0 / cost, rtol=1e-5)
      assert engine.policy.prices()["cycle"] == [round(float(c), 4) for c in prices[0]]
    assert engine.compiled.counts["prefill"] == n
    assert engine.policy_prices_source.startswith("the engine's costs")
    ar = [engine.generate(p, max_new_tokens=5, block_size=1).output_ids for p in prompts]
    assert [g.output_ids for g in got] == ar * 3
  finally:
    engine.set_policy(_policy(), SIZES)


def _priced_engine(models, counts=PRICED_COUNTS, costs: str = "1,2,3,4", draft: float = 0.5,
                   batch_size: int = 1) -> Engine:
  """An engine of sizes 2-5 whose priced policy (`counts`) picks among SIZES, its priced
  controller at the given start-up `costs` and `draft` pass, no online update."""
  from bp_jax.decoding.options import BatchOptions, LoopOptions

  target, drafter = models
  return Engine(target, drafter=drafter, policy=_priced_policy(counts), policy_sizes=SIZES,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS,
                                    block_sizes=(2, 3, 4, 5)),
                loop=LoopOptions(controller="priced", ar_fallback=16, controller_costs=costs,
                                 controller_draft_cost=draft, online_costs=False),
                batching=BatchOptions(batch_size=batch_size))


def test_engine_prices_a_policy_by_its_priced_controllers_costs(models):
  """`Engine.policy_prices`: a size-b cycle at the priced controller's price of a b-token
  verify (drafter pass included; before any loop call, its break-even) at the engine's batch
  size, a step at one AR step; a cheap
  verify (an accelerator's costs) makes the longest size the priced choice, a dear one (a
  CPU's) the shortest."""
  picks = []
  for costs, draft in (("1,4,8,16", 2.0), ("1,1.02,1.05,1.1", 0.05)):
    eng = _priced_engine(models, costs=costs, draft=draft)
    cycle, step = eng.policy_prices()
    np.testing.assert_allclose(cycle, [eng.prices.break_even(b, 1) for b in SIZES], rtol=1e-6)
    assert step.tolist() == [1.0] * 3
    picks.append(SIZES[int(np.argmin(PRICED_COUNTS[:3] * cycle))])
  assert picks == [2, 5]
  # Priced once per state of the prices (`OnlineCosts.version`): again only once a call (or a
  # floor) reached them, and then as the prices say.
  priced = []
  size_prices = eng.prices.size_prices
  eng.prices.size_prices = lambda *a: priced.append(a) or size_prices(*a)
  again = eng.policy_prices()
  assert not priced and again[0].tolist() == cycle.tolist()
  again[0][:] = 0.0  # the caller's copy
  assert eng.policy_prices()[0].tolist() == cycle.tolist() and not priced
  assert eng.prices.observe(0.02, [4, 0, 0, 0, 2], 1)  # a loop call: 4 AR steps, 2 cycles
  moved = eng.policy_prices()
  assert len(priced) == 1
  np.testing.assert_allclose(moved[0], size_prices([2, 3, 5], 1), rtol=1e-6)
  eng.prices.set_ar_step_floor(1e-3, 1)
  eng.policy_prices()
  assert len(priced) == 2


def test_a_rare_sizes_loop_prices_its_cycles_as_the_policy_weighed_that_size(models):
  """`Engine.break_even_N` of a policy's size: its full cycle (entry b) at the price the policy
  weighed the size by (`policy_prices`: a size run in few calls at its long-memory ratio to the
  most-run one, `OnlineCosts.size_prices`), not the fast fit's own price of its last calls,
  which a cheap last call pulled down; a request's start weighs the same price. The size
  requests are routed as (`route_size`) keeps the fit's own price, every other entry too."""
  eng = _priced_engine(models)
  # The size requests are routed as (chosen at its first use, kept) runs in most calls: AR
  # steps (1 ms) and its cycles; every third call also 2 cycles of the other size, the last of
  # them timed at 0.3 of their cost (a quiet moment of the machine).
  common = eng.route_size
  rare = {3: 5, 5: 3}[common]
  step_s, cycle_s = 1e-3, {3: 2e-3, 5: 3e-3}
  for i in range(30):
    counts = [4, 0, 0, 0, 0, 0]
    counts[common] = 3 + i % 2
    seconds = 4 * step_s + counts[common] * cycle_s[common]
    if i % 3 == 2:
      counts[rare] = 2
      seconds += 2 * cycle_s[rare] * (0.3 if i == 29 else 1.0)
    eng.prices.observe(seconds, counts, 1)
  fitted = eng.prices.break_even_N(5, 1)
  weighed = dict(zip(SIZES, eng.policy_prices()[0]))
  ratio = cycle_s[rare] / cycle_s[common]
  assert weighed[rare] / weighed[common] == pytest.approx(ratio, rel=0.06)  # the run's ratio
  assert fitted[rare] < 0.85 * weighed[rare]  # the fit's own: pulled down by the cheap last call
  assert weighed[common] == pytest.approx(fitted[common], rel=1e-6)
  for b in (3, 5):
    price_N = eng.break_even_N(b, 1)
    want = weighed[b] if b != eng.route_size else fitted[b]
    assert price_N[b] == pytest.approx(want, rel=1e-6)
    np.testing.assert_array_equal(np.delete(price_N, b), np.delete(fitted, b))
    assert eng._start_price(b, 1) == (pytest.approx(want, rel=1e-6), False)
  # A loop call's log entry gives the price its own size's loop weighed cycles at.
  eng.call_log = []
  for b in (3, 5, 1):
    eng.loop_ran(eng.clock(), [4, 0, 0, 0, 0, 0], 1, b)
  assert [c.break_even for c in eng.call_log] == [
      pytest.approx(eng.break_even_N(b, 1)[b], rel=1e-6) for b in (3, 5)] + [
          pytest.approx(fitted[5], rel=1e-6)]
  eng.call_log = None
  # Another length now run in more calls (a request's shorter last cycles: 4 tokens): the policy
  # weighs the routed size by its ratio to that one, its loop still by the fit's own price.
  for i in range(80):
    counts = [4, 0, 0, 0, 3, 0]
    counts[common] = 2 if i % 4 == 0 else 0
    quiet = 0.5 if i >= 70 else 1.0  # the routed size's last calls cheap: its own fit follows
    eng.prices.observe(4 * step_s + 3 * 1.7e-3 + counts[common] * cycle_s[common] * quiet,
                       counts, 1)
  own = eng.prices.break_even_N(5, 1)[common]
  assert abs(eng.policy_prices()[0][SIZES.index(common)] / own - 1) > 0.05
  assert eng.break_even_N(common, 1)[common] == own


@pytest.mark.parametrize("counts, joint_want", [(PRICED_COUNTS, 5),
                                                 (np.r_[0.5, 0.3, 0.3, 0.0, 0.0, 0.0], 3)])
def test_a_joined_batch_prices_its_joint_size_by_the_fit_without_repricing_the_sizes(
    models, counts, joint_want):
  """In a joined batch every drafting row runs the joint size, the most-run length of the
  batch's fit: `Engine.break_even_N` gives the fit's own prices there, and a loop call prices no
  policy size (`OnlineCosts.size_prices` is not called), nor does its log entry (a plain call's
  prices the largest size, here the joint one or another of the policy's)."""
  eng = _priced_engine(models, counts, batch_size=2)
  joint = eng.joint_size
  assert joint == joint_want
  for i in range(12):
    eng.prices.observe(0.004 + 0.003 * (3 + i % 2), [4] + [0] * (joint - 1) + [3 + i % 2], 2)
  priced = []
  size_prices = eng.prices.size_prices
  eng.prices.size_prices = lambda *a: priced.append(a) or size_prices(*a)
  np.testing.assert_array_equal(eng.break_even_N(joint, 2), eng.prices.break_even_N(5, 2))
  # Nor does a logged call's entry: the joint size's, or a plain call's (the largest size).
  eng.call_log = []
  for b in (joint, 1):
    eng.loop_ran(eng.clock(), [4] + [0] * (joint - 1) + [3 if b > 1 else 0], 2, b)
  assert [c.break_even for c in eng.call_log] == [
      pytest.approx(eng.prices.break_even(b, 2), rel=1e-6) for b in (joint, 5)]
  assert not priced


def test_a_batchs_joint_size_is_the_cheapest_by_the_priors_counts_at_the_engines_prices(models):
  """`Engine.joint_size` with a priced policy: the speculative size its prior expects cheapest
  per new token at the engine's prices (a CPU's dear long verifies: the shortest; an
  accelerator's: the longest), chosen once and kept as the prices move; the middle size where
  none is cheaper by `JOINT_MARGIN`, and with a policy of another head."""
  from bp_jax.decoding.options import BatchOptions, LoopOptions

  target, drafter = models
  batched = lambda policy, costs, draft: Engine(
      target, drafter=drafter, policy=policy, policy_sizes=SIZES,
      shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=(2, 3, 4, 5)),
      loop=LoopOptions(controller="priced", ar_fallback=16, controller_costs=costs,
                       controller_draft_cost=draft),
      batching=BatchOptions(batch_size=2))
  cpu, accelerator = ("1,4,8,16", 2.0), ("1,1.02,1.05,1.1", 0.05)
  joints = []
  for costs in (cpu, accelerator):
    eng = batched(_priced_policy(PRICED_COUNTS), *costs)
    cycle, _ = eng.policy_prices()
    per_token = PRICED_COUNTS[:3] * cycle
    joints.append(eng.joint_size)
    assert per_token[SIZES.index(joints[-1])] == per_token.min()
    assert eng.learned_sizes == (joints[-1],)
    for _ in range(3):  # prices that move after it was chosen leave it as it is
      eng.prices.observe(0.05, [0, 0, 0, 0, 0, 4], 2)
    assert eng.joint_size == joints[-1]
  assert joints == [2, 5]
  # Size 3 within the margin of size 5, the cheapest: the middle, 3.
  cycle, _ = eng.policy_prices()
  near = PRICED_COUNTS.copy()
  near[1] = near[2] * cycle[2] / cycle[1] * (1.0 + JOINT_MARGIN / 2)
  eng.set_policy(_priced_policy(near), SIZES)
  assert eng.joint_size == 3
  assert batched(_policy(), *accelerator).joint_size == 3  # a classify head: the middle


def test_a_batchs_prior_tau_is_the_priced_priors_at_the_joint_size(models):
  """`Engine.batch_prior_tau`: (1 - fallback steps) / cycles per new token of a priced policy's
  prior at the joint size, which a batch's start rule weighs before it has seen cycles
  (`StartBackoff.batch_prior_tau`; the start choice reports it); None at batch 1 and with a
  policy of another head."""
  from bp_jax.decoding.options import BatchOptions, LoopOptions

  target, drafter = models
  counts = np.r_[0.5, 0.4, 0.3, 0.1, 0.2, 0.4]  # cycles, then fallback steps, per new token
  engine_at = lambda policy, batch: Engine(
      target, drafter=drafter, policy=policy, policy_sizes=SIZES,
      shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=(2, 3, 4, 5)),
      loop=LoopOptions(controller="priced", ar_fallback=16, controller_costs="1,1.02,1.05,1.1",
                       controller_draft_cost=0.05, start_backoff=True, start_plain=True),
      batching=BatchOptions(batch_size=batch))
  eng = engine_at(_priced_policy(counts), 2)
  i = SIZES.index(eng.joint_size)
  assert eng.batch_prior_tau == pytest.approx((1.0 - counts[3 + i]) / counts[i])
  choice = eng.start_choice(eng.joint_size)
  assert choice.tau == pytest.approx(eng.batch_prior_tau)
  assert eng.starts.tau() is None  # nothing seen: the prior stands in for the batch alone
  assert engine_at(_priced_policy(counts), 1).batch_prior_tau is None  # batch 1: no joint size
  assert engine_at(_policy(), 2).batch_prior_tau is None  # a classify head: no counts


def test_policy_misuse_is_refused(models, engine):
  target, drafter = models
  plain = Engine(target, drafter=drafter,
                 shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=SIZES))
  with pytest.raises(BadInputError, match="needs a block-size policy"):
    plain.generate([1, 2, 3], max_new_tokens=3, block_size=LEARNED)
  with pytest.raises(BadInputError, match="not one of the configured buckets"):
    plain.set_policy(_policy(), (2, 3, 7))
  with pytest.raises(BadInputError, match="3 classes but 2 block sizes"):
    plain.set_policy(_policy(), (2, 3))
  wrong = BlockPolicy(PolicyArch("last_hidden", D + 1, 8, 1, 3), rngs=nnx.Rngs(0))
  with pytest.raises(BadInputError, match="trained for another model"):
    plain.set_policy(wrong, SIZES)
  no_drafter = Engine(target, shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  with pytest.raises(BadInputError, match="needs the drafter"):
    no_drafter.set_policy(_policy("pooled_layers"), (1, 1, 1))
  with pytest.raises(BadInputError, match="integer bucket or 'learned'"):
    engine.generate([1, 2], max_new_tokens=2, block_size="smart")
  # The largest candidate decides whether a learned request fits the cache.
  with pytest.raises(BadInputError, match="max_len"):
    engine.generate(list(range(1, 30)), max_new_tokens=MAX_LEN - 29 - 3, block_size=LEARNED)


# ---- training and checkpoints ----------------------------------------------------------------


def test_policy_learns_a_known_labelling_rule():
  """Labels are a known function of the features (argmax of a fixed linear map of 8 of 32 badly
  scaled, offset inputs; the other 24 are noise): held-out accuracy must exceed 90%, far above
  the majority class."""
  rng = np.random.default_rng(0)
  F, C = 32, 5
  scales = np.exp(rng.normal(0, 2, F)).astype(np.float32)  # normalisation must handle this
  w = np.zeros((F, C), np.float32)
  w[:8] = rng.normal(size=(8, C))

  def data(n):
    x = rng.normal(size=(n, F)).astype(np.float32)
    return x * scales + 3.0, np.argmax(x @ w, axis=1)

  (xt, yt), (xv, yv), (xe, ye) = data(6000), data(500), data(1000)
  arch = PolicyArch("last_hidden", F, 64, 2, C, residual=True, dropout=0.2)
  fit = fit_policy(xt, yt, xv, yv, arch, opt_cfg=opt_config(lr=3e-3, weight_decay=0.05),
                   steps=1500, batch=128, label_smoothing=0.05, eval_every=50, patience=6,
                   seed=0)
  acc = float((predict(fit.policy, xe) == ye).mean())
  majority = float((ye == np.bincount(yt).argmax()).mean())
  assert acc > 0.9, (acc, fit.best_step, fit.steps_run)
  assert majority < 0.3
  assert fit.history and fit.best_step <= fit.steps_run


def test_early_stopping_keeps_the_best_validation_parameters():
  """Random labels: the validation loss only gets worse after a while; the returned policy is
  the one of the best validation step, and training stops early."""
  rng = np.random.default_rng(1)
  x, y = rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64)
  xv, yv = rng.normal(size=(32, 8)).astype(np.float32), rng.integers(0, 3, 32)
  arch = PolicyArch("last_hidden", 8, 64, 2, 3, dropout=0.0)
  fit = fit_policy(x, y, xv, yv, arch, opt_cfg=opt_config(lr=1e-2, weight_decay=0.0),
                   steps=3000, batch=64, label_smoothing=0.0, eval_every=5, patience=5, seed=0)
  assert fit.steps_run < 3000
  best = min(h["val_loss"] for h in fit.history)
  assert best == pytest.approx(fit.val_loss)
  logits = fit.policy(jnp.asarray(xv))
  import optax
  ce = float(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(yv)).mean())
  assert ce == pytest.approx(best, rel=1e-5)


def test_policy_checkpoint_round_trip(tmp_path):
  policy = _policy("pooled_layers")
  rng = np.random.default_rng(0)
  policy.set_feature_stats(rng.normal(size=policy.arch.input_dim),
                           rng.uniform(0.5, 2, policy.arch.input_dim))
  texts = ["def f():\n", "print(1)\n"]
  path = save_policy(str(tmp_path / "pol"), policy, block_sizes=SIZES, label_rule="max_tau",
                     target_layer_ids=LAYER_IDS, labelled_hashes=[prompt_hash(t) for t in texts],
                     meta={"note": "test"})
  loaded, info = load_policy(path)
  x = jnp.asarray(rng.normal(size=(3, policy.arch.input_dim)), jnp.float32)
  np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(policy(x)), rtol=1e-6)
  assert loaded.arch == policy.arch
  assert info.block_sizes == SIZES and info.label_rule == "max_tau"
  assert info.target_layer_ids == LAYER_IDS
  assert info.overlap(["x = 1\n", "print(1)\n"]) == [1]
  meta = json.load(open(os.path.join(path, "bp_jax.json")))
  config = json.load(open(os.path.join(path, "config.json")))
  assert meta["kind"] == "policy" and meta["note"] == "test"
  assert meta["num_trainable_params"] == policy.arch.num_params()
  assert config["feature_type"] == "pooled_layers" and config["block_sizes"] == list(SIZES)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
  assert n_params == policy.arch.num_params()
  with pytest.raises(BadInputError, match="'dflash' checkpoint is expected|is a 'policy'"):
    from bp_jax.weights.loading import load_drafter
    load_drafter(path)


def test_parameter_counts_match_the_published_policy_scale():
  # The published last_logits MLP (2 x 2048, 5 classes) on Qwen3's 151,936-token vocabulary.
  n = mlp_param_count(151936, 2048, 2, 5)
  assert 311e6 < n < 316e6
  costs = policy_costs(151936, 2560, 5, 2048, 2, 5)
  assert costs["last_logits"] == n
  assert costs["last_hidden"] < costs["pooled_layers"] < costs["last_logits"] / 4


def test_random_control_is_seeded_and_uniform():
  draws = [random_block_size(SIZES, 0, i) for i in range(3000)]
  assert draws == [random_block_size(SIZES, 0, i) for i in range(3000)]
  assert draws != [random_block_size(SIZES, 1, i) for i in range(3000)]
  counts = np.bincount([SIZES.index(d) for d in draws])
  assert counts.min() > 900, counts
