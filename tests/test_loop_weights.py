"""The decode loops take per-layer weights the engine sliced once (`loops.LoopWeights`): a loop
call slices no stacked layer weight (each call used to copy every layer's weights), and its
outputs stay AR's."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from bp_jax.decoding import loops
from bp_jax.decoding.engine import keeps_head_apart
from bp_jax.models import layers as L
from bp_jax.models.qwen3 import Qwen3
from toy_models import toy_ar_outputs, toy_engine, toy_requests, zeros_drafter_pair


@pytest.fixture(scope="module")
def models():
  return zeros_drafter_pair(64)


def _slices(fn, *args) -> int:
  """Slices of the call's own arguments in the lowered loop (the stacked weights are
  arguments; a fused product's outputs, sliced into q, k and v, are not)."""
  return len(re.findall(r"stablehlo\.slice %arg\d+", jax.jit(fn).lower(*args).as_text()))


def test_a_loop_call_slices_no_stacked_weight(models):
  target, drafter = models
  eng = toy_engine(models, "priced", batch_size=2, sync_cycles=2)
  assert len(eng.t_weights.layers) == target.cfg.num_hidden_layers
  assert len(eng.d_weights.layers) == drafter.cfg.layers.num_hidden_layers
  # The target's q|k|v and gate|up as one product each (`layers.fuse_projections`), the
  # drafter's separate (`DFlashDrafter.loop_layers`: fused, its passes ran no faster).
  fused = eng.t_weights.layers[0]
  assert {L.QKV, L.GATE_UP} <= set(fused) and "q_proj" not in fused
  assert "q_proj" in eng.d_weights.layers[0] and L.QKV not in eng.d_weights.layers[0]
  per_call = len(L.LAYER_PARAM_NAMES) * target.cfg.num_hidden_layers
  opts = eng.programs.options.for_loop(1)
  ar = loops.make_batched_ar_loop(eng.t_graph, opts)
  carry, stop = eng.slot_carry(1), eng._stop_arr
  # The same loop on a bare state slices every stacked weight of every layer in each call.
  assert _slices(ar, eng.t_state, carry, stop) - _slices(ar, eng.t_weights, carry, stop) >= per_call
  spec = loops.make_batched_spec_loop(eng.t_graph, eng.d_graph,
                                      eng.programs.options.for_loop(4))
  carry = eng.slot_carry(4)
  # (The toy drafter has one layer: its "slices" are whole stacks, which lower to no slice.)
  assert (_slices(spec, eng.t_state, eng.d_state, carry, stop)
          - _slices(spec, eng.t_weights, eng.d_weights, carry, stop)) >= per_call


def test_scanned_layers_take_no_slices_and_outputs_stay_ar(models):
  eng = toy_engine(models, "priced", scan_layers=True)
  assert eng.t_weights.layers is None and eng.d_weights.layers is None
  prompts, max_news = toy_requests(3)
  got = [eng.generate(p, max_new_tokens=m, block_size=4).output_ids
         for p, m in zip(prompts, max_news)]
  assert got == toy_ar_outputs(models, 3)
  assert not eng.cache.is_per_layer and not eng.draft_cache.is_per_layer  # the scan's form


def _tied(target):
  """A tied model of the untied toy target's shapes: its embedding is the toy's lm_head^T."""
  graph, state = nnx.split(Qwen3(dataclasses.replace(target.cfg, tie_word_embeddings=True),
                                 rngs=nnx.Rngs(0)))
  weights = nnx.state(target).to_pure_dict()
  weights["embed"] = jnp.transpose(weights.pop("lm_head"))
  nnx.replace_by_pure_dict(state, weights)
  return nnx.merge(graph, state)


def test_a_tied_head_apart_decodes_the_same_tokens(models):
  """A tied target's head is stored apart, transposed, where `keeps_head_apart` (on a CPU,
  where the product with the embedding as stored ran slower): its engine holds lm_head [D, V],
  decodes exactly what the tied engine decodes (AR and speculative: all equal), and
  `head_apart=False` keeps the model as given."""
  target, drafter = models
  tied = _tied(target)
  assert keeps_head_apart() == (jax.default_backend() == "cpu")
  engines = {}
  for apart in (True, False):
    engines[apart] = toy_engine((tied, drafter), "none", head_apart=apart)
    assert ("lm_head" in engines[apart].t_state.to_pure_dict()) == apart
  V, D = target.cfg.vocab_size, target.cfg.hidden_size
  assert engines[True].t_state.to_pure_dict()["lm_head"].shape == (D, V)
  prompts, max_news = toy_requests(2)
  got = {(apart, size): [eng.generate(p, max_new_tokens=m, block_size=size).output_ids
                         for p, m in zip(prompts, max_news)]
         for apart, eng in engines.items() for size in (1, 4)}
  assert len({str(v) for v in got.values()}) == 1, got


def test_the_engine_keeps_its_caches_in_the_loops_form(models):
  """The one-request caches are made per layer, the form the loops carry, and come back from
  prefill and every loop in that form: no call copies them into another form and back (a
  stacked cache cost every call two cache-sized copies, ~0.4 ms per request on the demo's AR
  loop and 0.7 ms on its speculative one). Scanned layers keep them stacked (above)."""
  prompts, max_news = toy_requests(2)
  eng = toy_engine(models, "priced")
  for size in (1, 4):
    for p, m in zip(prompts, max_news):
      eng.generate(p, max_new_tokens=m, block_size=size)
      assert eng.cache.is_per_layer and eng.draft_cache.is_per_layer
  # One compiled loop per block size: the form never changed between calls.
  assert eng.compiled.counts["spec_loop"] == 1 and eng.compiled.counts["ar_loop"] == 1
