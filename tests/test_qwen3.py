"""Our Qwen3 target (bp_jax/models/qwen3.py) against transformers' Qwen3ForCausalLM on tiny random
checkpoints: logits, per-layer hidden states, both RoPE config forms, bfloat16."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from bp_jax.models.config import Qwen3Config
from bp_jax.weights.convert import convert_from_hf
from bp_jax.weights.hf_mapping import target_params_from_hf
from bp_jax.weights.loading import load_target
from bp_jax.models.nnx_utils import module_from_params
from bp_jax.models.qwen3 import Qwen3, with_head_apart
from hf_fixtures import jax_qwen3_from_torch, make_hf_qwen3, save_hf_qwen3, state_dict_getters

F32_TOL = 1e-4

# Every variant has head_dim != hidden_size / num_attention_heads and >= 2 query heads per kv
# head; rope_theta differs from our default (1e6) so a RoPE base that is not read would show.
VARIANTS = {
    "untied_gqa2": dict(tie=False),
    "tied_gqa2": dict(tie=True),
    "untied_gqa3": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                        rope_theta=500.0),
    "tied_gqa4_4layers": dict(tie=True, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                              num_hidden_layers=4, rope_theta=2000.0),
}


def _tokens(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def _hf_forward(model, tokens: np.ndarray):
  """(logits, [output of decoder layer j for every j]) from transformers.

  HF's `hidden_states[j + 1]` is decoder layer j's output for all but the last layer; its last
  entry is after the final norm, so the last layer's output is captured with a forward hook.
  """
  captured = {}

  def hook(module, args, output):
    captured["last"] = output[0] if isinstance(output, tuple) else output

  handle = model.model.layers[-1].register_forward_hook(hook)
  try:
    with torch.no_grad():
      out = model(torch.from_numpy(tokens).long(), output_hidden_states=True)
  finally:
    handle.remove()
  n = model.config.num_hidden_layers
  layers = [out.hidden_states[j + 1].numpy() for j in range(n - 1)] + [captured["last"].numpy()]
  return out.logits.numpy(), layers


def _ours(model: Qwen3, tokens: np.ndarray, hidden_layers=()):
  B, T = tokens.shape
  return model(jnp.asarray(tokens), model.init_cache(B, T + 3), hidden_layers)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_hidden_states_match_transformers_float32(variant):
  hf = make_hf_qwen3(seed=1, **VARIANTS[variant])
  cfg = hf.config
  assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
  assert cfg.num_attention_heads // cfg.num_key_value_heads >= 2
  ours = jax_qwen3_from_torch(hf)
  tokens = _tokens(2, 13, cfg.vocab_size)
  ref_logits, ref_layers = _hf_forward(hf, tokens)
  n = cfg.num_hidden_layers
  out = _ours(ours, tokens, hidden_layers=tuple(range(n)))
  assert out.logits.dtype == jnp.float32 and out.logits.shape == ref_logits.shape
  np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=F32_TOL, rtol=0)
  assert out.layer_hiddens.shape == (n, 2, 13, cfg.hidden_size)
  for j in range(n):
    np.testing.assert_allclose(np.asarray(out.layer_hiddens[j]), ref_layers[j], atol=F32_TOL,
                               rtol=0, err_msg=f"decoder layer {j}")


def test_a_tied_head_stored_apart_keeps_the_logits():
  """`with_head_apart` (what a CPU engine decodes with): lm_head [D, V] holds the embedding
  transposed, the embedding itself is the same array (no copy), and the logits are still
  transformers'; an untied model comes back as it is."""
  hf = make_hf_qwen3(seed=1, **VARIANTS["tied_gqa2"])
  ours = jax_qwen3_from_torch(hf)
  apart = with_head_apart(ours)
  assert not apart.cfg.tie_word_embeddings and ours.cfg.tie_word_embeddings
  assert apart.embed[...] is ours.embed[...]
  np.testing.assert_array_equal(np.asarray(apart.lm_head[...]), np.asarray(ours.embed[...]).T)
  tokens = _tokens(2, 13, hf.config.vocab_size)
  ref_logits, _ = _hf_forward(hf, tokens)
  np.testing.assert_allclose(np.asarray(_ours(apart, tokens).logits), ref_logits, atol=F32_TOL,
                             rtol=0)
  untied = jax_qwen3_from_torch(make_hf_qwen3(seed=1, **VARIANTS["untied_gqa2"]))
  assert with_head_apart(untied) is untied


def test_drafter_features_are_transformers_hidden_states_except_the_last_layer():
  """docs/design.md §1 (the last layer), pinned: the drafter's feature for target layer j
  (the target forward's `layer_hiddens`) is transformers' `hidden_states[j + 1]` for every
  j < L-1, but for j = L-1 transformers' entry is the last layer's output after the final norm. Transformers-based
  DFlash code reading layer L-1 would see other features than bp_jax, which is why drafter
  conversion and training refuse layer L-1."""
  L = 4
  hf = make_hf_qwen3(seed=4, num_hidden_layers=L)
  ours = jax_qwen3_from_torch(hf)
  tokens = _tokens(2, 11, hf.config.vocab_size, seed=8)
  with torch.no_grad():
    hf_states = hf(torch.from_numpy(tokens).long(), output_hidden_states=True).hidden_states
  assert len(hf_states) == L + 1  # embeddings, then one entry per layer
  features = np.asarray(_ours(ours, tokens, hidden_layers=tuple(range(L))).layer_hiddens)
  for j in range(L - 1):
    np.testing.assert_allclose(features[j], hf_states[j + 1].numpy(), atol=F32_TOL, rtol=0,
                               err_msg=f"layer {j}")
  last, hf_last = features[L - 1], hf_states[L].numpy()
  assert np.abs(last - hf_last).max() > 0.1 * np.abs(hf_last).max()  # not the same feature
  norm_weight = hf.model.norm.weight.detach().numpy()
  normed = last / np.sqrt(np.mean(last**2, -1, keepdims=True) + hf.config.rms_norm_eps)
  np.testing.assert_allclose(normed * norm_weight, hf_last, atol=F32_TOL, rtol=0)


def test_unrolled_layers_equal_the_scanned_forward(tiny_pair):
  """`layers=per_layer()` (decode loops) computes what `lax.scan` over the stacks computes:
  logits, requested hidden states and the cache, on top of a partly filled cache."""
  _, ours = tiny_pair
  first, more = _tokens(2, 7, 128, seed=5), _tokens(2, 4, 128, seed=6)
  # Jitted (run eagerly, each operation is compiled apart).
  scan = nnx.jit(lambda model, tokens, cache: model(tokens, cache, (2, 0)))
  unroll = nnx.jit(lambda model, tokens, cache: model(tokens, cache, (2, 0),
                                                      layers=model.layers.per_layer()))
  cache = scan(ours, jnp.asarray(first), ours.init_cache(2, 16)).cache.with_lengths(
      np.array([7, 7]))
  scanned = scan(ours, jnp.asarray(more), cache)
  unrolled = unroll(ours, jnp.asarray(more), cache)
  per_layer = unroll(ours, jnp.asarray(more), cache.per_layer())
  assert per_layer.cache.is_per_layer and len(per_layer.cache.k) == 3
  per_layer = per_layer._replace(cache=per_layer.cache.stacked())
  for other in (unrolled, per_layer):
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="per-layer KV cache needs the unrolled forward"):
    ours(jnp.asarray(more), cache.per_layer())
  with pytest.raises(ValueError, match="parameters of 2 layers for a model with 3"):
    ours(jnp.asarray(more), cache, layers=ours.layers.per_layer()[:2])


def test_fused_projections_compute_what_the_separate_ones_do(tiny_pair):
  """`per_layer(fuse_qkv=True, fuse_mlp=True)` (the target's per-layer weights in an engine):
  q|k|v and gate|up as one product each, the separate matrices gone; the same logits, hidden
  states and cache as the separate products, and the same with gate|up fused alone (the form a
  drafter-like caller may take)."""
  _, ours = tiny_pair
  fused = ours.layers.per_layer(fuse_qkv=True, fuse_mlp=True)
  c = ours.cfg
  D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
  assert set(fused[0]) == {"input_norm", "o_proj", "q_norm", "k_norm", "post_norm",
                           "down_proj", "qkv_proj", "gate_up_proj"}
  assert fused[0]["qkv_proj"].shape == (D, (N + 2 * K) * H)
  assert fused[0]["gate_up_proj"].shape == (D, 2 * c.intermediate_size)
  mlp_only = ours.layers.per_layer(fuse_mlp=True)
  assert "q_proj" in mlp_only[0] and "gate_proj" not in mlp_only[0]
  first, more = _tokens(2, 7, 128, seed=5), _tokens(2, 4, 128, seed=6)
  run = nnx.jit(lambda model, tokens, cache, layers: model(tokens, cache, (2, 0), layers=layers))
  cache = run(ours, jnp.asarray(first), ours.init_cache(2, 16).per_layer(),
              ours.layers.per_layer()).cache.with_lengths(np.array([7, 7]))
  separate = run(ours, jnp.asarray(more), cache, ours.layers.per_layer())
  for layers in (fused, mlp_only):
    other = run(ours, jnp.asarray(more), cache, layers)
    for a, b in zip(jax.tree.leaves(separate), jax.tree.leaves(other)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_requested_hidden_layers_come_back_in_requested_order(tiny_pair):
  hf, ours = tiny_pair
  tokens = _tokens(1, 9, 128, seed=3)
  _, ref_layers = _hf_forward(hf, tokens)
  out = _ours(ours, tokens, hidden_layers=(2, 0))
  assert out.layer_hiddens.shape[0] == 2
  np.testing.assert_allclose(np.asarray(out.layer_hiddens[0]), ref_layers[2], atol=F32_TOL, rtol=0)
  np.testing.assert_allclose(np.asarray(out.layer_hiddens[1]), ref_layers[0], atol=F32_TOL, rtol=0)
  assert _ours(ours, tokens).layer_hiddens.shape[0] == 0


def test_logits_at_returns_the_row_of_each_sequence(tiny_pair):
  _, ours = tiny_pair
  tokens = _tokens(2, 10, 128, seed=4)
  full = _ours(ours, tokens).logits
  at = jnp.asarray([3, 9], jnp.int32)
  picked = ours(jnp.asarray(tokens), ours.init_cache(2, 12), logits_at=at)
  assert picked.logits.shape == (2, 1, 128)
  np.testing.assert_allclose(np.asarray(picked.logits[0, 0]), np.asarray(full[0, 3]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(picked.logits[1, 0]), np.asarray(full[1, 9]), atol=1e-5)


def _hf_dict_in_form(hf, form: str) -> dict:
  """The model's config dict with its RoPE base in one of the two on-disk forms."""
  d = hf.config.to_dict()
  theta = d.pop("rope_parameters")["rope_theta"]
  d.pop("rope_theta", None)
  if form == "top_level_rope_theta":     # official Qwen3 checkpoints
    d["rope_theta"] = theta
  else:                                  # files written by transformers 5.x
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
  return d


@pytest.mark.parametrize("form", ["top_level_rope_theta", "rope_parameters"])
def test_both_rope_config_forms_parse_and_match_transformers(form):
  hf = make_hf_qwen3(seed=2, rope_theta=321.0)
  d = _hf_dict_in_form(hf, form)
  cfg = Qwen3Config.from_hf_dict(d, f"edited/{form}/config.json")
  assert cfg.rope_theta == 321.0
  get, shape_of, keys = state_dict_getters(hf)
  params = target_params_from_hf(get, shape_of, keys, cfg, "torch")
  ours = module_from_params(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), params)
  tokens = _tokens(1, 40, cfg.vocab_size, seed=5)  # long enough for the base to matter
  ref_logits, _ = _hf_forward(hf, tokens)
  np.testing.assert_allclose(np.asarray(_ours(ours, tokens).logits), ref_logits, atol=F32_TOL,
                             rtol=0)


def test_official_config_json_with_top_level_rope_theta_converts_and_matches(tmp_path):
  hf = make_hf_qwen3(seed=3, tie=True, rope_theta=777.0)
  src = save_hf_qwen3(str(tmp_path / "hf"), hf)
  path = os.path.join(src, "config.json")
  with open(path) as f:
    d = json.load(f)
  assert "rope_parameters" in d and "rope_theta" not in d  # what transformers 5 writes
  with open(path, "w") as f:
    json.dump(_hf_dict_in_form(hf, "top_level_rope_theta") | {"dtype": "float32"}, f)
  # transformers reads the official form too, with the same base.
  reloaded = transformers.Qwen3ForCausalLM.from_pretrained(src).eval()
  assert reloaded.config.rope_parameters["rope_theta"] == 777.0
  convert_from_hf(src, str(tmp_path / "ckpt"), show_progress=False)
  ours = load_target(str(tmp_path / "ckpt"))
  assert ours.cfg.rope_theta == 777.0 and ours.cfg.tie_word_embeddings
  tokens = _tokens(2, 33, ours.cfg.vocab_size, seed=6)
  ref_logits, _ = _hf_forward(reloaded, tokens)
  np.testing.assert_allclose(np.asarray(_ours(ours, tokens).logits), ref_logits, atol=F32_TOL,
                             rtol=0)


def test_bfloat16_runs_and_stays_close_to_float32_reference(tiny_pair):
  hf, _ = tiny_pair
  ours = jax_qwen3_from_torch(hf, dtype=jnp.bfloat16)
  assert ours.embed[...].dtype == jnp.bfloat16
  tokens = _tokens(2, 16, 128, seed=7)
  ref_logits, ref_layers = _hf_forward(hf, tokens)
  out = _ours(ours, tokens, hidden_layers=(0,))
  assert out.cache.k.dtype == jnp.bfloat16 and out.logits.dtype == jnp.float32
  got = np.asarray(out.logits)
  assert np.all(np.isfinite(got))
  scale = np.abs(ref_logits).max()
  assert np.abs(got - ref_logits).max() <= 0.1 * scale
  # Loose, but far tighter than unrelated logits would be.
  corr = np.corrcoef(got.ravel(), ref_logits.ravel())[0, 1]
  assert corr > 0.99
  assert np.mean(got.argmax(-1) == ref_logits.argmax(-1)) >= 0.8
  np.testing.assert_allclose(np.asarray(out.layer_hiddens[0], np.float32), ref_layers[0],
                             atol=0.05 * np.abs(ref_layers[0]).max())
