"""What a prefill computes (`loops.make_prefill`, `Engine._prefill_form`): a learned size's
request is prefilled by the target alone and its drafter context built afterwards, only where it
then drafts (`DraftContext.LATER`, `loops.make_draft_context`); that context is the one a
prefill with the drafter builds, so the request drafts and commits as it would have. The
drafter's pass over its first block (the `draft_confidence` feature) runs only where that
feature is wanted."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.decoding import loops
from bp_jax.decoding.engine import LEARNED, Engine
from bp_jax.decoding.options import BatchOptions, ShapeOptions
from bp_jax.decoding.programs import DraftContext
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.decoding.start_backoff import StartChoice
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.qwen3 import Qwen3
from bp_jax.policy.features import DRAFT_CONFIDENCE, FEATURE_TYPES, feature_dims
from bp_jax.policy.mlp import BlockPolicy, PolicyArch

V, D, MAX_LEN, P = 64, 32, 96, 32
LAYER_IDS = (0, 2)
SIZES = (1, 3, 5)  # size 1 (plain) among them: a learned request may decode plain


@pytest.fixture(scope="module")
def models():
  cfg = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=True, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  layers = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": 1, "tie_word_embeddings": False})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=3, num_target_layers=3,
                                       mask_token_id=V - 1, target_layer_ids=LAYER_IDS),
                          rngs=nnx.Rngs(2))
  return target, drafter


def _policy(feature: str) -> BlockPolicy:
  dims = feature_dims(V, D, len(LAYER_IDS), draft_block_size=3)
  return BlockPolicy(PolicyArch(feature, dims[feature], 16, 2, len(SIZES)), rngs=nnx.Rngs(3))


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, V - 1, int(rng.integers(3, 30))).tolist() for _ in range(num)]


def _prefill_args(target, drafter, prompt):
  n = len(prompt)
  tokens = np.zeros((1, P), np.int32)
  tokens[0, :n] = prompt
  return (nnx.state(target), nnx.state(drafter), jnp.asarray(tokens), jnp.int32(n),
          target.init_cache(1, MAX_LEN), drafter.init_cache(1, MAX_LEN), jax.random.key(0),
          jnp.float32(0))


def _valid(cache, n: int):
  k, v = cache.as_LBSKH()
  return np.asarray(k[:, 0, :n]), np.asarray(v[:, 0, :n])


@pytest.mark.parametrize("prompt", [_prompts(1, 1)[0], _prompts(1, 2)[0]])
def test_the_drafter_context_built_later_is_the_prefills_own(models, prompt):
  """A prefill without the drafter that keeps its chosen layers' outputs, then
  `make_draft_context` over them, gives the drafter the context a prefill with it writes, and
  the same first token, target cache and features."""
  target, drafter = models
  t_graph, d_graph = nnx.graphdef(target), nnx.graphdef(drafter)
  n = len(prompt)
  args = _prefill_args(target, drafter, prompt)
  built = jax.jit(loops.make_prefill(t_graph, d_graph, features=FEATURE_TYPES))(*args)
  later_args = args[:1] + (None,) + args[2:5] + (None,) + args[6:]
  later = jax.jit(loops.make_prefill(t_graph, None, features=FEATURE_TYPES,
                                     context_layers=LAYER_IDS))(*later_args)
  assert built.context_hiddens is None and later.draft_cache is None
  assert later.context_hiddens.shape == (len(LAYER_IDS), 1, P, D)
  draft_cache = jax.jit(loops.make_draft_context(d_graph))(
      nnx.state(drafter), later.context_hiddens, jnp.int32(n), drafter.init_cache(1, MAX_LEN))
  assert int(draft_cache.lengths[0]) == int(built.draft_cache.lengths[0]) == n
  for got, want in zip(_valid(draft_cache, n), _valid(built.draft_cache, n)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  for got, want in zip(_valid(later.cache, n), _valid(built.cache, n)):
    np.testing.assert_array_equal(got, want)
  assert int(later.first_tok) == int(built.first_tok)
  # Without the drafter there is no first block to draft: every other feature is the same.
  assert set(later.features) == set(FEATURE_TYPES) - {DRAFT_CONFIDENCE}
  for name, value in later.features.items():
    np.testing.assert_allclose(np.asarray(value), np.asarray(built.features[name]), rtol=1e-6,
                               atol=1e-6)


def test_the_drafters_first_block_runs_only_for_draft_confidence(models, monkeypatch):
  """The drafter's pass over its first block is traced into the prefill only where the
  `draft_confidence` feature is returned or the policy reads it; a prefill returns the features
  asked for and no other."""
  target, drafter = models
  t_graph, d_graph = nnx.graphdef(target), nnx.graphdef(drafter)
  args = _prefill_args(target, drafter, _prompts(1, 3)[0])
  drafts = []
  original = DFlashDrafter.draft

  def counting(self, *a, **kw):
    drafts.append(1)
    return original(self, *a, **kw)

  monkeypatch.setattr(DFlashDrafter, "draft", counting)
  runs = {}
  for name, feature in (("none", None), ("last_hidden", "last_hidden"),
                        ("draft_confidence", DRAFT_CONFIDENCE)):
    policy = None if feature is None else _policy(feature)
    p_graph = None if policy is None else nnx.graphdef(policy)
    extra = () if policy is None else (nnx.state(policy),)
    for features in ((), FEATURE_TYPES):
      drafts.clear()
      fn = loops.make_prefill(t_graph, d_graph, p_graph, features=features)
      out = jax.eval_shape(fn, *args, *extra)
      runs[name, len(features)] = len(drafts)
      assert set(out.features) == set(features), (name, features)
  assert runs == {("none", 0): 0, ("none", 4): 1, ("last_hidden", 0): 0,
                  ("last_hidden", 4): 1, ("draft_confidence", 0): 1,
                  ("draft_confidence", 4): 1}, runs


def _engine(models, feature: str = "last_hidden", batch_size: int = 1) -> Engine:
  target, drafter = models
  return Engine(target, drafter=drafter, policy=_policy(feature), policy_sizes=SIZES,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, P),
                                    block_sizes=SIZES),
                batching=BatchOptions(batch_size=batch_size, sync_cycles=2))


def _built_in_the_prefill(engine: Engine, monkeypatch) -> Engine:
  monkeypatch.setattr(engine, "defers_context", lambda return_features=False: False)
  return engine


@pytest.mark.parametrize("batch_size", [1, 2])
def test_learned_requests_draft_from_the_context_built_later(models, monkeypatch, batch_size):
  """Learned sizes decoded from a target-only prefill whose drafter context is built after it
  commit the same tokens in the same forwards (each forward's committed tokens) as with the
  context built in the prefill, alone and in a batch; after a request alone, the engine's
  drafter cache holds the same context."""
  prompts = _prompts(5, seed=4)
  later = _engine(models, batch_size=batch_size)
  built = _built_in_the_prefill(_engine(models, batch_size=batch_size), monkeypatch)
  assert later.defers_context() and not built.defers_context()
  if batch_size == 1:
    for p in prompts:
      a = later.generate(p, max_new_tokens=12, block_size=LEARNED)
      b = built.generate(p, max_new_tokens=12, block_size=LEARNED)
      assert (a.output_ids, a.forward_lengths, a.block_size) == (
          b.output_ids, b.forward_lengths, b.block_size)
      end = len(p) + a.new_tokens - 1
      for x, y in zip(_valid(later.draft_cache, end), _valid(built.draft_cache, end)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
  else:
    contexts = []
    original = later.build_draft_context
    monkeypatch.setattr(later, "build_draft_context", lambda pre, n: contexts.append(
        pre.context_hiddens is not None) or original(pre, n))
    a = later.generate_batch(prompts, max_new_tokens=12, block_size=LEARNED)
    b = built.generate_batch(prompts, max_new_tokens=12, block_size=LEARNED)
    assert [(g.output_ids, g.forward_lengths, g.block_size) for g in a] == [
        (g.output_ids, g.forward_lengths, g.block_size) for g in b]
    # Each request that drafted had its context built once, before it took its slot; those
    # the policy sent to the plain bucket none.
    drafted = sum(g.block_size > 1 for g in a)
    assert contexts == [True] * drafted and 0 < drafted < len(prompts)
  keys = lambda e, name: {k for k in e.compiled.seconds if k[0] == name}
  assert all(k[-1] == DraftContext.LATER.value for k in keys(later, "prefill"))
  assert keys(later, "draft_context") and not keys(built, "draft_context")
  assert not any(DraftContext.LATER.value in k for k in keys(built, "prefill"))


def test_a_learned_request_that_decodes_plain_builds_no_drafter_context(models, monkeypatch):
  """Where a learned request's start sends it to the plain loop (alone) or bucket (in a
  batch), nothing builds its drafter context; where its policy reads the drafter's first block
  (`draft_confidence`), its prefill builds the context itself."""
  prompts = _prompts(6, seed=4)
  for batch_size in (1, 2):
    engine = _engine(models, batch_size=batch_size)
    monkeypatch.setattr(engine, "starts_plain", lambda *a, **kw: True)
    built = []
    original = engine.build_draft_context
    monkeypatch.setattr(engine, "build_draft_context",
                        lambda pre, n: built.append(pre.context_hiddens) or original(pre, n))
    if batch_size == 1:
      gens = [engine.generate(p, max_new_tokens=6, block_size=LEARNED) for p in prompts]
    else:
      gens = engine.generate_batch(prompts, max_new_tokens=6, block_size=LEARNED)
    assert all(g.drafter_passes == 0 for g in gens)
    assert any(g.policy_block_size > 1 and g.plain_start for g in gens)  # a pick that drafts
    assert all(h is None for h in built), batch_size
    assert not any(k[0] == "draft_context" for k in engine.compiled.seconds)
  reads_drafter = _engine(models, feature=DRAFT_CONFIDENCE)
  assert not reads_drafter.defers_context()
  reads_drafter.generate(prompts[0], max_new_tokens=4, block_size=LEARNED)
  assert {k for k in reads_drafter.compiled.seconds if k[0] == "prefill"} == {
      ("prefill", reads_drafter.encode_padded(prompts[0])[1], reads_drafter.policy_key)}


def test_precompiled_learned_prefills_leave_nothing_to_compile(models):
  """`Engine.precompile(policy=True)` compiles the learned prefill and, where the drafter
  context comes after it, its program too: learned requests then compile no prefill."""
  engine = _engine(models)
  engine.precompile(SIZES, policy=True)
  before = dict(engine.compiled.counts)
  assert before["draft_context"] == 2  # one per length bucket
  for p in _prompts(4, seed=6):
    engine.generate(p, max_new_tokens=4, block_size=LEARNED)
  after = dict(engine.compiled.counts)
  assert after["prefill"] == before["prefill"] and after["draft_context"] == 2


def test_precompile_warm_runs_each_lone_prefill_and_its_drafter_context_once(models,
                                                                             monkeypatch):
  """`precompile(warm=True)` at batch 1 (a benchmark's or decode.py's start-up) runs each
  prefill program it compiles once, in every form (the drafter's context built in it, left for
  later, none), and the program that builds that context later, into the engine's own buffers:
  no request then makes a prefill program's first run (its fixed cost, otherwise in the
  `prefill_s` of the first request of its length bucket and form), and the requests decode what
  they decode without the warm-up. Without `warm` precompile runs none."""
  from jax._src import stages
  calls = []  # every compiled program called, in order
  call = stages.Compiled.__call__
  monkeypatch.setattr(stages.Compiled, "__call__",
                      lambda self, *a, **kw: calls.append(self) or call(self, *a, **kw))
  monkeypatch.setattr(Engine, "may_start_plain", property(lambda self: True))
  prompts, outs = _prompts(6, seed=9), {}
  for warm in (True, False):
    engine = _engine(models)
    plain_now = {"plain": False}
    monkeypatch.setattr(engine, "start_choice",
                        lambda b: StartChoice(4.0, 3.0, plain_now["plain"]))
    calls.clear()
    engine.precompile(SIZES, policy=True, warm=warm)
    # Another sampling form's learned prefills share the drafter context's program: run once.
    engine.precompile((), length_buckets=(16,), policy=True, plain_prefill=False,
                      forms=(SamplingForm.SAMPLED,), warm=warm)
    programs = {k: engine.compiled._fns[k] for k in engine.compiled.keys()
                if k[0] in ("prefill", "draft_context")}
    context = lambda k: k[-1] if k[-1] in {c.value for c in DraftContext} else "built"
    forms = {(engine.policy_key in k, context(k)) for k in programs if k[0] == "prefill"}
    assert forms == {(True, "built"), (True, DraftContext.LATER.value), (False, "built"),
                     (False, DraftContext.NONE.value)}, forms
    assert sum(k[0] == "prefill" and context(k) == DraftContext.LATER.value
               for k in programs) == 3  # each bucket's, and the other form's
    assert "draft_context" in {k[0] for k in programs}
    ran = [p for p in programs.values() if any(c is p for c in calls)]
    assert len(ran) == (len(programs) if warm else 0), (warm, len(ran), len(programs))
    assert (engine.prefill_warmup_seconds > 0) == warm
    assert all(sum(c is p for c in calls) == warm for p in programs.values())  # each once
    calls.clear()
    gens = []
    for i, p in enumerate(prompts):  # both learned forms, and a fixed size's plain start
      plain_now["plain"] = i % 2 == 1
      gens.append(engine.generate(p, max_new_tokens=8, block_size=LEARNED if i % 3 else 5))
    used = [p for p in programs.values() if any(c is p for c in calls)]
    assert {k for k in engine.compiled.keys() if k[0] in ("prefill", "draft_context")} == set(
        programs)  # no request used a program that precompile did not build (and run)
    assert len(used) >= 3  # the learned prefill's two forms and the context built later
    outs[warm] = [g.output_ids for g in gens]
  assert outs[True] == outs[False]


def test_with_priced_starts_the_prefill_follows_the_start_rule(models, monkeypatch):
  """Where priced starts may route a learned request plain, its prefill leaves the drafter's
  context for later only while the start rule would route a request plain now
  (`Engine.start_choice`): a request that is likely to draft is prefilled with the drafter, in
  one program. Both forms are precompiled; the tokens are the same either way."""
  engine = _engine(models)
  monkeypatch.setattr(Engine, "may_start_plain", property(lambda self: True))
  plain_now = {"plain": False}
  monkeypatch.setattr(engine, "start_choice",
                      lambda b: StartChoice(4.0, 3.0, plain_now["plain"]))
  engine.precompile(SIZES, policy=True)
  compiled = {k for k in engine.compiled.seconds if k[0] == "prefill"}
  assert {("prefill", L, engine.policy_key) + tail for L in engine.length_buckets
          for tail in ((), (DraftContext.LATER.value,))} <= compiled
  prompt, got = _prompts(1, seed=8)[0], {}
  for plain in (False, True):
    plain_now["plain"] = plain
    assert engine.defers_context() == plain
    assert engine._prefill_form(True, 0, False)[0] == (DraftContext.LATER if plain
                                                       else DraftContext.BUILT)
    got[plain] = engine.generate(prompt, max_new_tokens=8, block_size=LEARNED).output_ids
  assert got[False] == got[True]
  assert {k for k in engine.compiled.seconds if k[0] == "prefill"} == compiled
  assert not engine.defers_context(return_features=True)


def test_a_batchs_learned_request_routed_plain_is_prefilled_without_its_policy(models,
                                                                              monkeypatch):
  """In a batch whose learned picks decode at one size that may start plain
  (`Engine.routes_learned_early`), the start rule routes a learned request before its
  prefill. One it routes plain is prefilled by the target alone, as a plain request of the
  joint size: its policy does not run (no pick: `policy_block_size` and `policy_probs` None),
  no drafter context, AR's tokens. A server's warm-up (`precompile(policy=True)`) compiles that
  prefill, so such a batch builds no XLA program. One routed to draft is picked for as
  before."""
  from compile_counting import BackendCompiles
  from bp_jax.decoding.options import LoopOptions
  target, drafter = models
  engine = Engine(target, drafter=drafter, policy=_policy("last_hidden"), policy_sizes=SIZES,
                  shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, P),
                                      block_sizes=SIZES),
                  loop=LoopOptions(controller="priced", start_backoff=True, start_plain=True,
                                   controller_costs="1,3,6", controller_draft_cost=3.0),
                  batching=BatchOptions(batch_size=2, sync_cycles=2))
  assert engine.routes_learned_early and engine.joint_size == 5
  prompts = _prompts(5, seed=9)
  ar = Engine(target, shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, P)))
  want = [ar.generate(p, max_new_tokens=8).output_ids for p in prompts]
  route_plain = {"plain": True}
  original = engine.starts_plain
  monkeypatch.setattr(engine, "starts_plain", lambda b, start, forced=False: (
      b > 1 and route_plain["plain"]) or original(b, start, forced))
  engine.precompile(engine.learned_sizes, policy=True, plain_prefill=False, all_windows=True)
  with BackendCompiles() as compiles:
    gens = engine.generate_batch(prompts, max_new_tokens=8, block_size=LEARNED)
  assert compiles.n == 0
  assert [g.output_ids for g in gens] == want
  for g in gens:
    assert (g.block_size, g.plain_start, g.policy_block_size, g.policy_probs) == (
        5, True, None, None)
    assert g.drafter_passes == 0
  route_plain["plain"] = False  # drafting where the rule lets it: the policy picks
  engine.starts.batch_prior_tau = None
  gens = engine.generate_batch(prompts, max_new_tokens=8, block_size=LEARNED)
  assert [g.output_ids for g in gens] == want
  assert all(g.policy_block_size in SIZES and len(g.policy_probs) == len(SIZES) for g in gens)


@pytest.mark.parametrize("path", ["generate", "scheduler"])
def test_a_learned_request_alone_routed_plain_is_prefilled_without_its_policy(models,
                                                                             monkeypatch, path):
  """Alone (`Engine.routes_learned_early` at batch 1: `generate`, and the scheduler a server
  runs at batch 1), the start rule routes a learned request before its prefill, as a request
  of `route_size`: one it routes plain is prefilled by the target alone and decodes plain at
  that size, its policy not run (`policy_block_size` None), AR's tokens, nothing compiled past
  `precompile(policy=True)`; one it routes to draft runs its policy and decodes at the pick
  (routed as either speculative size: a pick that differs from the route's size takes its own
  bucket). Either way one start is counted per request."""
  from compile_counting import BackendCompiles
  from bp_jax.decoding.options import LoopOptions
  target, drafter = models
  engine = Engine(target, drafter=drafter, policy=_policy("last_hidden"), policy_sizes=SIZES,
                  shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, P),
                                      block_sizes=SIZES),
                  loop=LoopOptions(controller="priced", start_backoff=True, start_plain=True,
                                   controller_costs="1,3,6", controller_draft_cost=3.0))
  assert engine.routes_learned_early and engine.joint_size is None
  size = engine.route_size
  assert size in SIZES and size > 1
  decode = ((lambda p: engine.generate(p, max_new_tokens=8, block_size=LEARNED))
            if path == "generate" else
            (lambda p: engine.generate_batch([p], max_new_tokens=8, block_size=LEARNED)[0]))
  prompts = _prompts(4, seed=9)
  ar = Engine(target, shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, P)))
  want = [ar.generate(p, max_new_tokens=8).output_ids for p in prompts]
  route_plain, starts = {"plain": True}, []
  original_start = engine.request_start
  monkeypatch.setattr(engine, "starts_plain", lambda b, start, forced=False: (
      b > 1 and route_plain["plain"]))
  monkeypatch.setattr(engine, "request_start", lambda b, rows=1: (  # (size 1: no start)
      b > 1 and starts.append(b)) or original_start(b, rows))
  engine.precompile(engine.learned_sizes, policy=True)
  if path == "scheduler":  # its batched programs at batch 1 too (as a server's warm-up request)
    decode(prompts[0])
    starts.clear()
  with BackendCompiles() as compiles:
    gens = [decode(p) for p in prompts]
  assert compiles.n == 0
  assert [g.output_ids for g in gens] == want
  for g in gens:
    assert (g.block_size, g.plain_start, g.policy_block_size, g.policy_probs) == (
        size, True, None, None)
    assert g.drafter_passes == 0
  assert starts == [size] * len(prompts)
  route_plain["plain"] = False  # drafting where the rule lets it: the policy picks
  for size in (b for b in SIZES if b > 1):
    engine._route_alone, starts[:] = size, []
    calls = lambda: collections.Counter({b: t.calls for (b, _), t in engine.loop_calls.items()})
    before = calls()
    gens = [decode(p) for p in prompts]
    assert [g.output_ids for g in gens] == want
    assert all(g.policy_block_size in SIZES and len(g.policy_probs) == len(SIZES) for g in gens)
    assert all(g.block_size == g.policy_block_size for g in gens), size
    assert set(calls() - before) == {g.block_size for g in gens}  # the loops that ran
    assert starts == [size] * len(prompts)
