"""The engine's jobs kept apart and its answers to bad numbers: NaN/inf logits stop a request
with a clear error; compile time and the loops' first runs are measured apart; the perfect-
drafter path of tests is a separate program, absent from production loops; block sizes < 1 are
refused before anything is compiled; the options are checked, hashable compile keys and the loop
state's fields have the shapes their names say."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bp_jax.decoding.programs import LoopPrograms
from bp_jax.decoding import compiled as compiled_lib
from bp_jax.decoding.engine import Engine
from bp_jax.decoding import controller as control
from bp_jax.decoding.options import OPTION_NAMES, BatchOptions, LoopOptions, ShapeOptions
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.errors import BadInputError, named_as_flags
from bp_jax.models.config import DFlashConfig
from hf_fixtures import (jax_drafter_from_state_dict, jax_qwen3_from_torch, make_dflash_state_dict,
                         make_hf_qwen3)

V = 128
MAX_LEN = 64
DRAFTER_HF = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                  rope_theta=10000.0, block_size=4, num_target_layers=3,
                  dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 1]})
PROMPT = [5, 17, 33, 2, 9, 41]


@pytest.fixture(scope="module")
def models():
  target = jax_qwen3_from_torch(make_hf_qwen3(seed=3))
  cfg = DFlashConfig.from_hf_dict(DRAFTER_HF, "tiny-dflash/config.json")
  return target, jax_drafter_from_state_dict(cfg, make_dflash_state_dict(cfg, seed=4))


def _engine(target, drafter=None, **kw):
  return Engine(target, drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16,), block_sizes=(4,)),
                loop=LoopOptions(**kw))


def _poison_embedding(target, token: int):
  """A copy of `target` whose input embedding of `token` is NaN (untied lm_head: the logits
  stay finite until the token is fed back in)."""
  from flax import nnx
  graph, state = nnx.split(target)
  copy = nnx.merge(graph, jax.tree.map(jnp.copy, state))
  copy.embed.value = copy.embed.value.at[token].set(jnp.nan)
  return copy


@pytest.mark.parametrize("block_size", (1, 4))
def test_nan_logits_stop_the_request_with_a_clear_error(models, block_size):
  target, drafter = models
  clean = _engine(target, drafter).generate(PROMPT, max_new_tokens=12, block_size=1).output_ids
  bad_tok = next(t for t in clean[2:] if t not in PROMPT and t not in clean[:2])
  poisoned = _poison_embedding(target, bad_tok)
  eng = _engine(poisoned, drafter)
  with pytest.raises(BadInputError, match="NaN/inf logits at position"):
    eng.generate(PROMPT, max_new_tokens=12, block_size=block_size)
  # Prompts that never feed the poisoned token decode as before.
  short = clean.index(bad_tok)
  assert eng.generate(PROMPT, max_new_tokens=short, block_size=block_size).output_ids == \
      clean[:short]


def test_nan_in_the_prompt_fails_in_the_prefill(models):
  target, _ = models
  eng = _engine(_poison_embedding(target, PROMPT[-1]))
  with pytest.raises(BadInputError, match="the prefill produced NaN/inf logits"):
    eng.generate(PROMPT, max_new_tokens=4, block_size=1)


@pytest.mark.parametrize("sizes", [(0,), (-3, 0), (4, 0)])
def test_block_sizes_below_one_are_refused_up_front(models, sizes):
  target, drafter = models
  with pytest.raises(BadInputError, match="block sizes must be integers >= 1"):
    Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=MAX_LEN, block_sizes=sizes))
  with pytest.raises(BadInputError, match=">= 1"):
    _engine(target, drafter).generate(PROMPT, max_new_tokens=4, block_size=sizes[-1])


def test_compile_time_and_first_run_are_measured_apart(models, monkeypatch):
  """A compile made 0.5 s slower shows in compile time only, not in the loop's first run."""
  target, drafter = models
  real_get = compiled_lib.CompiledCache.get

  def slow_get(self, key, make, args, **kw):
    if key not in self:
      time.sleep(0.5)
    return real_get(self, key, make, args, **kw)

  monkeypatch.setattr(compiled_lib.CompiledCache, "get", slow_get)
  eng = _engine(target, drafter)
  eng.generate(PROMPT, max_new_tokens=8, block_size=4)
  assert set(eng.warmup_seconds) == {4}
  # (the sleep sits outside CompiledCache's own clock, so compile seconds do not include it)
  assert eng.warmup_seconds[4] < 0.5, eng.warmup_seconds


def test_engines_of_one_architecture_share_programs_and_keep_their_own_weights(models,
                                                                             monkeypatch):
  """A second engine over a target of the same architecture and the same options takes the
  first one's executables (no compilation, no trace) and decodes with its own weights: its
  outputs are those of an engine that compiled its own. Other JAX settings: other programs;
  other loop options: other loops. (The process's memory maps do not limit them here: a full
  run's worker maps more than the budget, test_shared_programs_yield_where_...)"""
  from compile_counting import BackendCompiles
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: None)
  target, drafter = models
  other = jax_qwen3_from_torch(make_hf_qwen3(seed=5))  # same shapes, other weights
  decode = lambda eng: [eng.generate(PROMPT, max_new_tokens=12, block_size=b).output_ids
                        for b in (1, 4)]
  with compiled_lib.shared_programs_set_aside():  # nothing shared from the tests before
    first = _engine(target, drafter)
    first_out = decode(first)
    assert first.compiled.shared == 0
    second = _engine(other, drafter)
    with BackendCompiles() as compiles:
      got = decode(second)
    assert compiles.n == 0
    # The prefill with the drafter and without (block size 1's), the AR and speculative loops.
    assert second.compiled.shared == second.compiled.total == first.compiled.total == 4
    # Set aside (a test that patches traced code): compiled anew inside, back after it.
    with compiled_lib.shared_programs_set_aside():
      alone = _engine(other, drafter)
      assert decode(alone) == got != first_out and alone.compiled.shared == 0
      fallback = _engine(other, drafter, ar_fallback=2)
      decode(fallback)  # its loops are forgotten with the block
    again = _engine(other, drafter)
    assert decode(again) == got and again.compiled.shared == again.compiled.total == 4
    # Under another matmul precision (--config.matmul_precision): programs of its own.
    with jax.default_matmul_precision("highest"):
      precise = _engine(other, drafter)
      assert decode(precise) == got and precise.compiled.shared == 0
    # Another loop form (AR fallback steps): the speculative loop compiles anew; the prefills
    # and the AR loop, which no controller option reaches (`LoopOptions.ar_program`), are shared.
    fallback = _engine(other, drafter, ar_fallback=2)
    decode(fallback)
    assert fallback.compiled.shared == 3 and fallback.compiled.total == 4
    assert fallback.compiled.counts["spec_loop"] == 1
    # Another AR step form (two-token forwards): an AR loop of its own.
    padded = _engine(other, drafter, ar_step_tokens=2)
    assert padded.generate(PROMPT, max_new_tokens=12, block_size=1).output_ids == got[0]
    assert padded.compiled.shared == 1  # the prefill (the target's alone)
    assert "shared_programs" in fallback.compiled.summary()


def test_priced_engines_of_other_costs_and_host_options_share_their_loops(models, monkeypatch):
  """The priced controller reads its prices at run time (`LoopState.break_even_N`) and the
  start rule and online costs only on the host (`LoopOptions.spec_program`): engines that
  differ only there share the speculative loop, and each decodes by its own prices (with
  perfect drafts, cheap verifies draft and dear ones take AR steps). The confidence
  controller's costs are compiled into its loop: other costs, another program."""
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: None)
  target, drafter = models
  priced = lambda costs, draft, **kw: _engine(target, drafter, controller="priced",
                                              controller_costs=costs,
                                              controller_draft_cost=draft, **kw)
  with compiled_lib.shared_programs_set_aside():
    cheap = priced((1.0, 1.5, 1.6), 0.1)  # both decline (`options.declines_by_costs`)
    ar = cheap.generate(PROMPT, max_new_tokens=16, block_size=1).output_ids
    decode = lambda eng: eng.generate(PROMPT, max_new_tokens=16, block_size=4,
                                      forced_continuation=ar)
    g_cheap = decode(cheap)
    dear = priced((1.0, 8.0, 16.0), 8.0, start_backoff=False, online_costs=False)
    g_dear = decode(dear)
    assert dear.compiled.counts["spec_loop_forced"] == 1 and dear.compiled.shared == 2
    assert g_cheap.output_ids == g_dear.output_ids == ar
    assert g_dear.ar_steps > g_cheap.ar_steps, (g_dear.ar_steps, g_cheap.ar_steps)
    confident = lambda costs: _engine(target, drafter, controller="confidence",
                                      controller_costs=costs, controller_draft_cost=0.5)
    confident((1.0, 1.0, 1.0)).generate(PROMPT, max_new_tokens=8, block_size=4)
    other = confident((1.0, 1.5, 2.0))
    other.generate(PROMPT, max_new_tokens=8, block_size=4)
    assert other.compiled.shared == 1  # the prefill: the loop compiled anew


def test_engines_of_other_sync_cycles_or_rules_at_t0_share_their_loops(models, monkeypatch):
  """A batched loop's budget of forwards per call is an argument (`BatchOptions.sync_cycles`),
  and a greedy loop verifies with the greedy rule whatever the engine's (`LoopOptions.for_loop`):
  batched engines of other budgets, and engines of either rule decoding greedy requests, run
  one program each, and decode what their own options say (a call of a 1-forward budget
  returns after each forward: more calls for the same tokens)."""
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: None)
  target, drafter = models
  batched = lambda sync, **kw: Engine(
      target, drafter=drafter, loop=LoopOptions(controller="none", **kw),
      shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16,), block_sizes=(4,)),
      batching=BatchOptions(batch_size=2, sync_cycles=sync, shrink=False))
  prompts = [PROMPT, PROMPT[:3]]
  with compiled_lib.shared_programs_set_aside():
    outs, calls = [], []
    for eng in (batched(4), batched(1), batched(0, verify="rejection")):
      gens = eng.generate_batch(prompts, max_new_tokens=12, block_size=4)
      outs.append([g.output_ids for g in gens])
      calls.append(sum(t.calls for (b, _), t in eng.loop_calls.items() if b == 4))
      if len(outs) > 1:
        assert eng.compiled.counts["batch_spec_loop"] == 1
        assert eng.compiled.shared == eng.compiled.total, eng.compiled.summary()
    assert outs[0] == outs[1] == outs[2]
    assert calls[1] > calls[0] > calls[2] == 1, calls
    with_rule = lambda rule: _engine(target, drafter, controller="none", verify=rule)
    with_rule("exact").generate(PROMPT, max_new_tokens=8, block_size=4)
    rejection = with_rule("rejection")
    rejection.generate(PROMPT, max_new_tokens=8, block_size=4)
    assert rejection.compiled.shared == rejection.compiled.total == 2  # prefill, greedy loop
    rejection.generate(PROMPT, max_new_tokens=8, block_size=4, temperature=1.0)
    assert rejection.compiled.shared == 2  # a drawing loop: the rule's own
  assert LoopOptions(verify="rejection").for_loop(4, form=SamplingForm.GREEDY).verify == "exact"
  assert LoopOptions(verify="rejection").for_loop(4, form=SamplingForm.SAMPLED).verify == (
      "rejection")


def test_shared_programs_yield_where_the_process_maps_too_much(models, monkeypatch):
  """XLA:CPU maps each executable's code into hundreds of memory regions, and past the
  kernel's limit the next compilation segfaults: where the process maps more than half the
  limit, the shared programs drop to the newest; under it they stay."""
  use = compiled_lib.maps_in_use()
  assert use is None or 0 < use[0] < use[1]  # this process's, on Linux
  target, drafter = models
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: (40000, 65530))
  eng = _engine(target, drafter)
  eng.generate(PROMPT, max_new_tokens=6, block_size=4)
  assert eng.compiled.total >= 2 and len(compiled_lib._shared) == 1
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: (1000, 65530))
  eng.generate(PROMPT, max_new_tokens=6, block_size=1)  # its prefill (the target's alone) and
  assert len(compiled_lib._shared) == 3  # AR loop join the newest


def test_a_compilation_that_would_pass_the_map_limit_is_refused(models, monkeypatch):
  """Past `vm.max_map_count` XLA:CPU's JIT aborts the process: a compilation whose kind has
  mapped more regions than the process has left is refused with an error that says so and
  what to change, after the shared programs and the engines' (none here) yield; the engine
  serves again once there is room."""
  target, drafter = models
  monkeypatch.setattr(compiled_lib, "_caches", weakref.WeakSet())  # this engine's alone
  eng = _engine(target, drafter)
  monkeypatch.setattr(compiled_lib, "_added", {"prefill": 900})
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: (61_500, 65_530))
  with pytest.raises(compiled_lib.MapLimitError, match=r"compiling \('prefill'.*needs about "
                     r"900 more memory regions.*61,500 memory regions.*vm.max_map_count=65,530"):
    eng.generate(PROMPT, max_new_tokens=6, block_size=1)
  assert eng.compiled.total == 0 and not compiled_lib._shared
  monkeypatch.setattr(compiled_lib, "maps_in_use", lambda: (1_000, 65_530))
  assert eng.generate(PROMPT, max_new_tokens=6, block_size=1).output_ids


def test_forced_drafts_are_a_separate_program(models):
  """The perfect drafter of tests compiles its own loop; the production loop takes no forced
  tokens (one [1, S] int32 buffer, the sequence, instead of two) and is what requests run."""
  target, drafter = models
  eng = _engine(target, drafter)
  ref = eng.generate(PROMPT, max_new_tokens=10, block_size=1).output_ids
  g = eng.generate(PROMPT, max_new_tokens=10, block_size=4, forced_continuation=ref)
  assert g.output_ids == ref and g.acceptance_lengths[0] == 4
  eng.generate(PROMPT, max_new_tokens=10, block_size=4)
  fns = eng.compiled._fns
  assert ("spec_loop", 4) in fns and ("spec_loop_forced", 4) in fns

  def seq_sized_params(key) -> int:
    entry = fns[key].as_text().split("ENTRY", 1)[1].split("\n", 1)[0].split("->")[0]
    return entry.count(f"s32[1,{MAX_LEN}]")

  assert seq_sized_params(("spec_loop", 4)) == 1
  assert seq_sized_params(("spec_loop_forced", 4)) == 2
  assert set(eng.warmup_seconds) == {1, 4}  # production loops only
  # The perfect drafter still pays the drafter's full pass: the optimised programs hold as many
  # matrix products (overwriting the drafts outright once let XLA drop the pass as dead code).
  dots = lambda key: fns[key].as_text().count(" dot(")
  assert dots(("spec_loop_forced", 4)) == dots(("spec_loop", 4)) > 0


def test_generation_figures_have_one_meaning(models):
  """τ counts speculative cycles only; tokens per forward counts every target forward; the
  counted tokens are exactly the kept ones."""
  target, drafter = models
  eng = _engine(target, drafter, ar_fallback=4)
  for max_new in (3, 9, 17):
    g = eng.generate(PROMPT, max_new_tokens=max_new, block_size=4)
    assert sum(g.forward_lengths) == g.new_tokens - 1
    assert g.cycles + g.ar_steps == g.target_forwards == len(g.forward_lengths)
    assert g.tau == pytest.approx(np.mean(g.acceptance_lengths))
    assert g.tokens_per_forward == pytest.approx((g.new_tokens - 1) / g.target_forwards)
  assert g.ar_steps > 0  # the random drafter falls back: AR steps are not cycles
  ar = eng.generate(PROMPT, max_new_tokens=9, block_size=1)
  assert ar.tau == 1.0 and ar.ar_steps == 0 and ar.cycles == 8


def test_loop_options_are_checked_hashable_compile_keys():
  a = LoopOptions(controller="confidence", controller_costs="1,2", controller_draft_cost=0.5)
  b = LoopOptions(controller="confidence", controller_costs=(1.0, 2.0), controller_draft_cost=0.5)
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert a.in_effect().ar_fallback == control.DEFAULT_SKIP_CAP
  assert LoopOptions(ar_fallback=0).in_effect().controller == "none"
  assert LoopOptions(ar_fallback=3).in_effect() == LoopOptions(ar_fallback=3, ar_step_tokens=1)
  # A loop's sampling form (`sampling.SamplingForm`) is part of its key: none for greedy loops
  # (keys as they always read), its name otherwise; ANY where a caller does not say.
  assert a.for_loop(4, form=SamplingForm.GREEDY).key() == ("spec_loop", 4)
  assert a.for_loop(4).key() == ("spec_loop", 4, "any")
  assert a.for_loop(4, form=SamplingForm.SAMPLED).key(3) == ("batch_spec_loop", 4, 3, "all",
                                                             "sampled")
  assert a.for_loop(4, forced=True, form=0).key(3) == ("batch_spec_loop_forced", 4, 3, "all")
  assert LoopOptions(verify="rejection").for_loop(4, forced=True).verify == "exact"
  assert a.for_loop(1, window=128, form=0).key(3) == ("batch_ar_loop", 1, 3, 128)
  with pytest.raises(BadInputError, match="ar_fallback_accept=-1"):
    LoopOptions(ar_fallback_accept=-1)
  with pytest.raises(BadInputError, match="only verify='exact'"):
    LoopOptions(verify="rejection", forced_drafts=True)
  with pytest.raises(BadInputError, match="length bucket 64 exceeds max_len=32"):
    ShapeOptions(max_len=32, length_buckets=(64,))
  # At the command line the same errors name the flags.
  with pytest.raises(BadInputError, match=r"exceeds --config\.max_len=32"):
    with named_as_flags(OPTION_NAMES):
      ShapeOptions(max_len=32, length_buckets=(64,))


def test_loop_state_fields_have_the_shapes_their_names_say(models):
  """`LoopState` (and its records): a field named `x_BS` is [batch, max_len], `x_B` [batch]."""
  target, drafter = models
  eng = Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=MAX_LEN, block_sizes=(4,)),
               batching=BatchOptions(batch_size=3))
  state = eng.slot_carry(4, forced=True)
  named = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
  named.update({f.name: getattr(state.records, f.name)
                for f in dataclasses.fields(state.records)})
  from bp_jax.decoding.state import MAX_ROW_STOP_IDS
  shapes = {"_BS": (3, MAX_LEN), "_B": (3,), "_BK": (3, MAX_ROW_STOP_IDS)}
  checked = 0
  for name, value in named.items():
    suffix = "_" + name.rsplit("_", 1)[-1]
    if suffix in shapes:  # a NamedTuple of per-row fields (sp_B): each of them
      for leaf in (value if isinstance(value, tuple) else (value,)):
        assert leaf.shape == shapes[suffix], name
      checked += 1
  assert checked == 19
  assert state.draft_cache is not None and eng.slot_carry(1).draft_cache is None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["max_new_B", "wait_B", "done_B"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Carry:
  """The part of a `LoopState` a batched warm-up reads: rows not done with new tokens left
  decode."""
  max_new_B: jax.Array
  wait_B: jax.Array
  done_B: jax.Array

  def active_B(self) -> jax.Array:
    return ~self.done_B & (self.max_new_B > 0)

  def replace(self, **fields) -> "_Carry":
    return dataclasses.replace(self, **fields)


def test_batched_warm_up_runs_the_rows_on_a_copy_of_the_carry_only():
  """A batched loop's untimed first run decodes the carry's rows as they are, or every row
  where none decodes (`precompile`'s fresh carries: an idle carry left the loop body's
  first-run cost inside the first timed call, which the online costs then fitted as AR steps
  costing ~0), `WARMUP_FORWARDS` forwards (its budget argument), on a copy of the carry: the
  weights are passed as they are (a copy would hold a second model on the device), once per
  program. A speculative loop runs again with its decoding rows asking for AR steps first
  (`programs.WARMUP_START`), the carry itself untouched."""
  from bp_jax.decoding.programs import WARMUP_FORWARDS, WARMUP_TOKENS
  programs = LoopPrograms(None, None)
  seen = []
  weights, stop, budget = jnp.ones(3), jnp.zeros(1), jnp.asarray(16, jnp.int32)
  no = jnp.zeros(3, bool)
  live = _Carry(jnp.asarray([5, 7, 0]), jnp.asarray([0, 3, 0]), no)
  idle = _Carry(jnp.zeros(3, jnp.int32), jnp.asarray([0, 3, 0]), no)
  for carry, decoding in ((live, [5, 7, 0]), (idle, [WARMUP_TOKENS + 1] * 3)):
    for block_size, args, at in ((4, (weights, weights, carry, stop, budget), 2),
                                 (1, (weights, carry, stop, budget), 1)):
      key = ("loop", block_size, carry is idle)
      programs.warm_batched(key, lambda *a: seen.append(a) or a[at], args, block_size)
      programs.warm_batched(key, lambda *a: seen.append(a), args, block_size)
      runs, seen[:] = list(seen), []  # the second call of a key runs nothing
      assert len(runs) == (2 if block_size > 1 else 1)
      for got in runs:
        assert all(got[i] is args[i] for i in range(len(args) - 1) if i != at)
        assert int(got[-1]) == WARMUP_FORWARDS
        assert got[at].max_new_B is not carry.max_new_B
        assert got[at].max_new_B.tolist() == decoding  # the rows decode
      ar_first = [2 if m else w for m, w in zip(decoding, carry.wait_B.tolist())]
      assert [got[at].wait_B.tolist() for got in runs] == (
          [[0, 3, 0], ar_first] if block_size > 1 else [[0, 3, 0]])
  assert live.wait_B.tolist() == idle.wait_B.tolist() == [0, 3, 0]
  assert live.max_new_B.tolist() == [5, 7, 0] and idle.max_new_B.tolist() == [0, 0, 0]
