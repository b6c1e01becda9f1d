"""DFlash drafter (models/dflash.py) against a plain-PyTorch statement of docs/design.md §2."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bp_jax.models.config import DFlashConfig, Qwen3Config, default_target_layer_ids
from bp_jax.models.dflash import validate_drafter_for_target
from bp_jax.errors import BadInputError
from bp_jax.weights.hf_mapping import drafter_params_to_hf
from bp_jax.models.nnx_utils import module_params
from hf_fixtures import jax_drafter_from_state_dict, make_dflash_state_dict

V, D, BLOCK, MASK = 128, 64, 8, 127
TARGET_LAYERS = 6
TARGET_CFG = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=96,
                         num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=24, rope_theta=10000.0)
DRAFTER_HF = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
                  rope_theta=10000.0, block_size=BLOCK, num_target_layers=TARGET_LAYERS,
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 3, 4]})
CFG = DFlashConfig.from_hf_dict(DRAFTER_HF, "tiny-dflash/config.json")
N_FEAT = len(CFG.target_layer_ids)


# ---- PyTorch re-statement of docs/design.md §2 (float64, one sequence, no cache) ----

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_THH: torch.Tensor, pos_T: torch.Tensor, theta: float) -> torch.Tensor:
  """Rotate-half RoPE of [T, heads, head_dim] at absolute positions."""
  hd = x_THH.shape[-1]
  inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
  ang = pos_T.double()[:, None] * inv_freq[None, :]
  ang = torch.cat([ang, ang], -1)[:, None, :]
  x1, x2 = x_THH[..., : hd // 2], x_THH[..., hd // 2:]
  return x_THH * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def ref_draft_logits(sd: dict, cfg: DFlashConfig, feats_CnD: torch.Tensor,
                     ctx_pos_C: torch.Tensor, block_emb_bD: torch.Tensor, blk_pos_b: torch.Tensor,
                     lm_head_VD: torch.Tensor) -> torch.Tensor:
  """Draft logits [b, V] for one sequence: context features at ctx_pos, block at blk_pos."""
  c = cfg.layers
  eps, N, K, H = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
  w = {k: v.double() for k, v in sd.items()}
  ctx = _rms(feats_CnD.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
  x = block_emb_bD.double()
  b = x.shape[0]
  kv_pos = torch.cat([ctx_pos_C, blk_pos_b])
  for i in range(c.num_hidden_layers):
    p = lambda name: w[f"layers.{i}.{name}.weight"]
    xn = _rms(x, p("input_layernorm"), eps)
    q = _rope(_rms((xn @ p("self_attn.q_proj").T).view(b, N, H), p("self_attn.q_norm"), eps),
              blk_pos_b, c.rope_theta)
    kv_in = torch.cat([ctx, xn])  # context features are NOT re-normalised by input_layernorm
    k = (kv_in @ p("self_attn.k_proj").T).view(-1, K, H)
    k = _rope(_rms(k, p("self_attn.k_norm"), eps), kv_pos, c.rope_theta)
    v = (kv_in @ p("self_attn.v_proj").T).view(-1, K, H)
    k = k.repeat_interleave(N // K, dim=1)  # query head j uses kv head j // (N/K)
    v = v.repeat_interleave(N // K, dim=1)
    att = torch.softmax(torch.einsum("tnh,snh->nts", q, k) * H ** -0.5, dim=-1)  # not causal
    o = torch.einsum("nts,snh->tnh", att, v).reshape(b, N * H)
    x = x + o @ p("self_attn.o_proj").T
    hn = _rms(x, p("post_attention_layernorm"), eps)
    x = x + (torch.nn.functional.silu(hn @ p("mlp.gate_proj").T) * (hn @ p("mlp.up_proj").T)
             ) @ p("mlp.down_proj").T
  return _rms(x, w["norm.weight"], eps) @ lm_head_VD.double().T


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup():
  sd = make_dflash_state_dict(CFG, seed=0)
  g = torch.Generator().manual_seed(1)
  embed = 0.5 * torch.randn(V, D, generator=g)
  lm_head = 0.3 * torch.randn(V, D, generator=g)
  drafter = jax_drafter_from_state_dict(CFG, sd)
  return sd, embed, lm_head, drafter


@nnx.jit
def _add_context(drafter, hiddens, cache):
  return drafter.add_context(hiddens, cache)


@nnx.jit
def _draft(drafter, emb, cache):
  return drafter.draft(emb, cache)


def _block(tok_B: np.ndarray) -> np.ndarray:
  ids = np.full((len(tok_B), BLOCK), MASK, np.int64)
  ids[:, 0] = tok_B
  return ids


def _our_logits(drafter, embed, lm_head, ids_Bb, cache) -> np.ndarray:
  emb = jnp.take(jnp.asarray(embed.numpy()), jnp.asarray(ids_Bb), axis=0)
  h = _draft(drafter, emb, cache)
  return np.asarray(h @ jnp.asarray(lm_head.numpy()).T)


def _feats(rng, B, C) -> np.ndarray:
  """Target hidden states [n, B, C, D] of the chosen layers (scaled like real residual streams)."""
  return (3.0 * rng.standard_normal((N_FEAT, B, C, D))).astype(np.float32)


def _concat(h_nBCD: np.ndarray, b: int, rows) -> torch.Tensor:
  """The features of one sequence, concatenated over layers: [C', n*D]."""
  return torch.from_numpy(np.concatenate([h_nBCD[j, b, rows] for j in range(N_FEAT)], -1))


# ---- tests ---------------------------------------------------------------------------------------

def test_param_tree_round_trips(setup):
  sd, _, _, drafter = setup
  params = module_params(drafter)
  out = dict(drafter_params_to_hf(params))
  assert set(out) == set(sd)
  for k, v in sd.items():
    np.testing.assert_array_equal(out[k], v.numpy())


def test_context_at_once_matches_reference(setup):
  sd, embed, lm_head, drafter = setup
  rng = np.random.default_rng(0)
  B, C = 2, 7
  h = _feats(rng, B, C)
  cache = drafter.init_cache(B, 32)
  cache = _add_context(drafter, jnp.asarray(h), cache).with_lengths(jnp.full((B,), C))
  ids = _block(rng.integers(0, V, B))
  ours = _our_logits(drafter, embed, lm_head, ids, cache)
  for b in range(B):
    ref = ref_draft_logits(sd, CFG, _concat(h, b, slice(0, C)), torch.arange(C),
                           embed[torch.from_numpy(ids[b])], torch.arange(C, C + BLOCK), lm_head)
    assert np.abs(ours[b] - ref.numpy()).max() <= 1e-4
  assert ours.std() > 0.1  # logits are not degenerate


def test_chunked_context_with_stale_entries_matches_reference(setup):
  """Two context chunks, ragged valid counts, garbage written past the pointer, rollback."""
  sd, embed, lm_head, drafter = setup
  rng = np.random.default_rng(1)
  B, C1, C2, max_len = 2, 5, 4, 24
  h1, junk, h2 = _feats(rng, B, C1), 10 * _feats(rng, B, 6), _feats(rng, B, C2)
  valid1, valid2 = np.array([5, 4]), np.array([3, 1])  # row 1: prompt padded by one entry

  cache = drafter.init_cache(B, max_len)
  cache = _add_context(drafter, jnp.asarray(h1), cache).with_lengths(valid1)
  # A chunk that turns out to be dead: written, pointer advanced, then rolled back.
  cache = _add_context(drafter, jnp.asarray(junk), cache).with_lengths(valid1 + 6)
  cache = cache.with_lengths(valid1)
  _ = _our_logits(drafter, embed, lm_head, _block(rng.integers(0, V, B)), cache)
  # The next cycle's fixed-size chunk, of which only valid2 entries are real.
  cache = _add_context(drafter, jnp.asarray(h2), cache).with_lengths(valid1 + valid2)
  ids = _block(rng.integers(0, V, B))
  ours = _our_logits(drafter, embed, lm_head, ids, cache)
  for b in range(B):
    feats = torch.cat([_concat(h1, b, slice(0, valid1[b])), _concat(h2, b, slice(0, valid2[b]))])
    n_ctx = int(valid1[b] + valid2[b])
    ref = ref_draft_logits(sd, CFG, feats, torch.arange(n_ctx), embed[torch.from_numpy(ids[b])],
                           torch.arange(n_ctx, n_ctx + BLOCK), lm_head)
    assert np.abs(ours[b] - ref.numpy()).max() <= 1e-4


def test_add_context_writes_only_its_slots_and_drops_past_end(setup):
  _, _, _, drafter = setup
  rng = np.random.default_rng(2)
  cache = drafter.init_cache(2, 8).with_lengths(np.array([2, 6]))
  new = drafter.add_context(jnp.asarray(_feats(rng, 2, 4)), cache)
  assert np.array_equal(np.asarray(new.lengths), [2, 6])
  for x_LBSKH in new.as_LBSKH():
    written = np.abs(np.asarray(x_LBSKH)).sum(axis=(0, 3, 4)) > 0  # [B, S]
    assert written.tolist() == [[False, False, True, True, True, True, False, False],
                                [False] * 6 + [True, True]]


def test_draft_leaves_cache_unchanged(setup):
  _, embed, _, drafter = setup
  rng = np.random.default_rng(3)
  cache = drafter.init_cache(1, 16)
  cache = drafter.add_context(jnp.asarray(_feats(rng, 1, 5)), cache).with_lengths(np.array([5]))
  before = jax.tree.map(np.asarray, cache)
  emb = jnp.take(jnp.asarray(embed.numpy()), jnp.asarray(_block(np.array([3]))), axis=0)
  h = drafter.draft(emb, cache)
  assert h.shape == (1, BLOCK, D)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_unrolled_draft_equals_scanned_draft(setup):
  _, embed, _, drafter = setup
  # Jitted (run eagerly, each operation is compiled apart).
  add_context = nnx.jit(lambda d, feats, cache: d.add_context(feats, cache))
  scanned = nnx.jit(lambda d, emb, cache: d.draft(emb, cache))
  unrolled = nnx.jit(lambda d, emb, cache: d.draft(emb, cache, d.layers.per_layer()))
  rng = np.random.default_rng(4)
  cache = add_context(drafter, jnp.asarray(_feats(rng, 2, 6)), drafter.init_cache(2, 16))
  cache = cache.with_lengths(np.array([6, 4]))
  emb = jnp.take(jnp.asarray(embed.numpy()), jnp.asarray(_block(np.array([3, 9]))), axis=0)
  want = np.asarray(scanned(drafter, emb, cache))
  np.testing.assert_allclose(np.asarray(unrolled(drafter, emb, cache)), want, atol=1e-5, rtol=0)
  # The per-layer cache form: the same context written and read layer by layer.
  split = add_context(drafter, jnp.asarray(_feats(np.random.default_rng(4), 2, 6)),
                      drafter.init_cache(2, 16).per_layer())
  split = split.with_lengths(np.array([6, 4]))
  for a, b in zip(jax.tree.leaves(split.stacked()), jax.tree.leaves(cache)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_allclose(np.asarray(unrolled(drafter, emb, split)), want, atol=1e-5, rtol=0)


def test_default_target_layer_ids():
  assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert default_target_layer_ids(36, 1) == (18,)
  assert default_target_layer_ids(TARGET_LAYERS, 3) == (1, 2, 3)
  # Without a list, one target layer per draft layer (the tiny drafter has 2 layers).
  d = dict(DRAFTER_HF, dflash_config={"mask_token_id": MASK})
  assert DFlashConfig.from_hf_dict(d).target_layer_ids == (1, 3)


def test_validate_against_target(setup):
  _, _, _, drafter = setup
  drafter.validate_against_target(TARGET_CFG, "tiny-dflash")  # compatible: no error
  bad = {
      "hidden_size": (CFG, dataclasses.replace(TARGET_CFG, hidden_size=32)),
      "num_target_layers": (CFG, dataclasses.replace(TARGET_CFG, num_hidden_layers=5)),
      "target_layer_ids": (dataclasses.replace(CFG, target_layer_ids=(1, 3, 6)), TARGET_CFG),
      "mask_token_id": (dataclasses.replace(CFG, mask_token_id=V), TARGET_CFG),
      "vocab_size": (dataclasses.replace(
          CFG, layers=dataclasses.replace(CFG.layers, vocab_size=100)), TARGET_CFG),
  }
  for what, (dcfg, tcfg) in bad.items():
    with pytest.raises(BadInputError, match=what) as err:
      validate_drafter_for_target(dcfg, tcfg, "/ckpt/my-drafter")
    assert "/ckpt/my-drafter" in str(err.value)


def test_empty_context_sees_only_the_block(setup):
  sd, embed, lm_head, drafter = setup
  ids = _block(np.array([5]))
  ours = _our_logits(drafter, embed, lm_head, ids, drafter.init_cache(1, 8))
  ref = ref_draft_logits(sd, CFG, torch.zeros(0, N_FEAT * D), torch.arange(0),
                         embed[torch.from_numpy(ids[0])], torch.arange(BLOCK), lm_head)
  assert np.abs(ours[0] - ref.numpy()).max() <= 1e-4
