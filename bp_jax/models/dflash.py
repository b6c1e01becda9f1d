"""DFlash block-diffusion drafter in Flax NNX (docs/design.md §2); draft layers stacked,
run by `lax.scan`.

Parameters (Linear weights stored `[in, out]`; the tree of `hf_mapping.drafter_params_from_hf`):
  layers.<name> [L, ...] for name in `layers.LAYER_PARAM_NAMES`; fc [n*D, D]; hidden_norm [D];
  norm [D].
The drafter has no embedding and no lm_head: the caller embeds the block with the target's embedding
and multiplies `draft`'s output by the target's head weight.

One draft step, per draft layer (checked against z-lab's public `Qwen3DFlashAttention`):
  x_n = input_layernorm(x); queries = RoPE(q_norm(q_proj(x_n))) for the block only;
  keys/values over [c ; x_n] with the same k_proj/v_proj, k_norm on all keys, RoPE at absolute
  positions. The context features `c = hidden_norm(fc(concat))` are shared by every layer and are
  NOT passed through the layer's input_layernorm. Attention is not causal.

Because `c` does not depend on the layer's input, every layer's context keys/values are computed
once when the context is committed (`add_context`) and kept in a context-only `KVCache` whose slot
index is the absolute position. `draft` reads slots `j < lengths` and never writes the cache.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.models import layers as L
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.errors import BadInputError
from bp_jax.models.kv_cache import KVCache, write_all_layers
from bp_jax.models.qwen3 import LayerStack


def _two_part_attend(q_BTNH: jax.Array, k_ctx_ZSH: jax.Array, v_ctx_ZHS: jax.Array,
                     ctx_mask_BS: jax.Array, k_blk_BTKH: jax.Array,
                     v_blk_BTKH: jax.Array) -> jax.Array:
  """Non-causal GQA of block queries over (masked context slots) + (the whole block); [B, T, N*H].

  The context is one `KVCache` layer (rows Z = B * K). One softmax over both parts, computed in
  float32 without concatenating the cache with the block: shared row max, exponentials of each
  part, one normaliser. The block part is never empty, so every row has at least one visible key.
  """
  B, T, _, H = q_BTNH.shape
  K = k_blk_BTKH.shape[2]
  scale = H ** -0.5
  q_ZGTH = L.queries_to_rows(q_BTNH, K)
  k_blk_ZUH, v_blk_ZUH = L.heads_to_rows(k_blk_BTKH), L.heads_to_rows(v_blk_BTKH)
  s_ctx_ZGTS = jnp.einsum("zgth,zsh->zgts", q_ZGTH, k_ctx_ZSH,
                          preferred_element_type=jnp.float32) * scale
  s_blk_ZGTU = jnp.einsum("zgth,zuh->zgtu", q_ZGTH, k_blk_ZUH,
                          preferred_element_type=jnp.float32) * scale
  mask_Z11S = jnp.repeat(ctx_mask_BS, K, axis=0)[:, None, None, :]
  s_ctx_ZGTS = jnp.where(mask_Z11S, s_ctx_ZGTS, -jnp.inf)
  m_ZGT1 = jnp.maximum(jnp.max(s_ctx_ZGTS, axis=-1, keepdims=True),
                       jnp.max(s_blk_ZGTU, axis=-1, keepdims=True))
  e_ctx_ZGTS = jnp.exp(s_ctx_ZGTS - m_ZGT1)  # masked slots: exp(-inf) = 0
  e_blk_ZGTU = jnp.exp(s_blk_ZGTU - m_ZGT1)
  denom_ZGT1 = (jnp.sum(e_ctx_ZGTS, axis=-1, keepdims=True)
                + jnp.sum(e_blk_ZGTU, axis=-1, keepdims=True))
  o_ZGTH = (jnp.einsum("zgts,zhs->zgth", e_ctx_ZGTS.astype(v_ctx_ZHS.dtype), v_ctx_ZHS,
                       preferred_element_type=jnp.float32)
            + jnp.einsum("zgtu,zuh->zgth", e_blk_ZGTU.astype(v_blk_ZUH.dtype), v_blk_ZUH,
                         preferred_element_type=jnp.float32))
  return L.rows_to_outputs(o_ZGTH / denom_ZGT1, B).astype(q_BTNH.dtype)


class DFlashDrafter(nnx.Module):
  """z-lab DFlashDraftModel: draft layers + `fc`/`hidden_norm` (context) + final `norm`."""

  def __init__(self, cfg: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    c = cfg.layers
    D, n = c.hidden_size, len(cfg.target_layer_ids)
    self.layers = LayerStack(c, c.num_hidden_layers, dtype, rngs)
    self.fc = nnx.Param((0.02 * jax.random.normal(rngs.params(), (n * D, D))).astype(dtype))
    self.hidden_norm = nnx.Param(jnp.ones((D,), dtype))
    self.norm = nnx.Param(jnp.ones((D,), dtype))

  def loop_layers(self) -> list[dict[str, jax.Array]]:
    """The per-layer weights in the form a single-device decode loop runs them
    (`Engine._loop_weights`, the start-up cost probe): the separate matrices. A drafter pass
    projects a whole block (matrix-matrix products, not the target's AR matrix-vector ones),
    and k|v and gate|up fused made it no faster on the 2-core EPYC model-1 VM (0.95-1.05x a
    pass at batch 1 and 8, seven runs of four forms; the paper's b = 8 loop 0.97-1.09x the
    time per request, four runs; docs/results/controller.md)."""
    return self.layers.per_layer()

  # ---- context -------------------------------------------------------------------------------

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    """An empty context-only cache: one k/v entry per draft layer and committed position."""
    c = self.cfg.layers
    return KVCache.create(c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim,
                          self.dtype)

  def context_inputs(self, target_hiddens_nBCD: jax.Array) -> jax.Array:
    """[B, C, n * D] the target's chosen-layer hidden states concatenated in `target_layer_ids`
    order (layer-major, as the rows of `fc`), in the drafter's dtype: what `fc` projects."""
    n = target_hiddens_nBCD.shape[0]
    if n != len(self.cfg.target_layer_ids):
      raise ValueError(f"expected hidden states of {len(self.cfg.target_layer_ids)} target layers, "
                       f"got {n}")
    return jnp.concatenate(list(target_hiddens_nBCD.astype(self.dtype)), axis=-1)

  def context_features(self, target_hiddens_nBCD: jax.Array) -> jax.Array:
    """c [B, C, D] = hidden_norm(fc(concat_n hiddens)), concatenated in `target_layer_ids` order."""
    return self._project_context(self.context_inputs(target_hiddens_nBCD))

  def _project_context(self, inputs_BCX: jax.Array) -> jax.Array:
    # fc is used as stored (no weight copy).
    return L.rms_norm(inputs_BCX @ self.fc[...], self.hidden_norm[...],
                      self.cfg.layers.rms_norm_eps)

  def add_context(self, target_hiddens_nBCD: jax.Array, cache: KVCache,
                  layers: list[dict[str, jax.Array]] | None = None) -> KVCache:
    """Writes every draft layer's k/v of C new context entries at slots `cache.lengths + arange(C)`.

    RoPE uses those absolute positions. Slots past the cache end are dropped. `cache.lengths` is
    left unchanged: the caller then sets it to the number of valid context entries
    (`cache.with_lengths(...)`), so a fixed-size chunk may carry invalid tail entries.
    `layers`: per-layer parameters (`self.layers.per_layer()`), taken once outside a decode
    loop; None slices them here.
    """
    return self.add_context_inputs(self.context_inputs(target_hiddens_nBCD), cache, layers)

  def add_context_inputs(self, inputs_BCX: jax.Array, cache: KVCache,
                         layers: list[dict[str, jax.Array]] | None = None) -> KVCache:
    """`add_context` from the concatenated hidden states (`context_inputs`), e.g. kept aside
    while the target took AR steps and added in one go before the next drafter pass."""
    c = self.cfg.layers
    ctx_BCD = self._project_context(inputs_BCX)
    C = ctx_BCD.shape[1]
    pos_BC = cache.lengths[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]
    cos_BCH, sin_BCH = L.rope_cos_sin(pos_BC, c.head_dim, c.rope_theta)
    # c is not passed through the layers' input_layernorm: every layer projects c itself.
    kv = [L.project_kv(ctx_BCD, p, cos_BCH, sin_BCH, c.num_key_value_heads, c.head_dim,
                       c.rms_norm_eps) for p in (layers or self.layers.per_layer())]
    return write_all_layers(cache, jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv]),
                            pos_BC)

  # ---- drafting ------------------------------------------------------------------------------

  def draft(self, block_emb_BbD: jax.Array, cache: KVCache,
            layers: list[dict[str, jax.Array]] | None = None,
            window: int | None = None) -> jax.Array:
    """Final-normed hidden states [B, b, D] of a block at positions `cache.lengths + arange(b)`.

    `block_emb_BbD` is the target's embedding of `[t, MASK, ..., MASK]`. Each block position sees
    the valid context (slots `j < cache.lengths`) and the whole block. The cache is only read.
    Multiply by the target's head weight for logits; positions 1..b-1 give the draft tokens.
    `layers`: as for `Qwen3.__call__` (None = `lax.scan`; `self.layers.per_layer()` = unrolled).
    `window`: read context slots [0, window) only (static; the context must lie below it).
    """
    c = self.cfg.layers
    eps, K, H = c.rms_norm_eps, c.num_key_value_heads, c.head_dim
    B, b, _ = block_emb_BbD.shape
    pos_Bb = cache.lengths[:, None] + jnp.arange(b, dtype=jnp.int32)[None, :]
    cos_BbH, sin_BbH = L.rope_cos_sin(pos_Bb, H, c.rope_theta)
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    ctx_mask_BS = jnp.arange(W)[None, :] < cache.lengths[:, None]
    in_window = (lambda k, v: (k, v)) if W == cache.max_len else (
        lambda k, v: (k[..., :W, :], v[..., :W]))

    def body(x_BbD, xs):
      p, k_ctx_ZSH, v_ctx_ZHS = xs
      k_ctx_ZSH, v_ctx_ZHS = in_window(k_ctx_ZSH, v_ctx_ZHS)
      xn_BbD = L.rms_norm(x_BbD, p["input_norm"], eps)
      q_BbNH, k_blk_BbKH, v_blk_BbKH = L.project_qkv(xn_BbD, p, cos_BbH, sin_BbH,
                                                     c.num_attention_heads, K, H, eps)
      attn_BbX = _two_part_attend(q_BbNH, k_ctx_ZSH, v_ctx_ZHS, ctx_mask_BS, k_blk_BbKH,
                                  v_blk_BbKH)
      h_BbD = x_BbD + attn_BbX @ p["o_proj"]
      x_BbD = h_BbD + L.swiglu_mlp(L.rms_norm(h_BbD, p["post_norm"], eps), p)
      return x_BbD, None

    x_BbD = block_emb_BbD.astype(self.dtype)
    if layers is None:
      if cache.is_per_layer:
        raise ValueError("a per-layer context cache needs the unrolled draft (pass `layers`)")
      x_BbD, _ = jax.lax.scan(body, x_BbD, (self.layers.as_dict(), cache.k, cache.v))
    else:
      for i, p in enumerate(layers):
        x_BbD, _ = body(x_BbD, (p, cache.k[i], cache.v[i]))
    return L.rms_norm(x_BbD, self.norm[...], eps)

  # ---- compatibility -------------------------------------------------------------------------

  def validate_against_target(self, target_cfg: Qwen3Config, source: str) -> None:
    validate_drafter_for_target(self.cfg, target_cfg, source)


def validate_drafter_for_target(cfg: DFlashConfig, target_cfg: Qwen3Config, source: str) -> None:
  """Raises BadInputError naming `source` (the drafter checkpoint) if it cannot serve the target."""
  c, t = cfg.layers, target_cfg
  if c.hidden_size != t.hidden_size:
    raise BadInputError(f"{source}: drafter hidden_size={c.hidden_size} differs from the target's "
                        f"hidden_size={t.hidden_size}")
  if cfg.num_target_layers != t.num_hidden_layers:
    raise BadInputError(f"{source}: drafter was trained for num_target_layers="
                        f"{cfg.num_target_layers} but the target has {t.num_hidden_layers} layers")
  bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers]
  if bad:
    raise BadInputError(f"{source}: target_layer_ids {bad} out of range for a target with "
                        f"{t.num_hidden_layers} layers")
  if not 0 <= cfg.mask_token_id < t.vocab_size:
    raise BadInputError(f"{source}: mask_token_id={cfg.mask_token_id} is outside the target's "
                        f"vocabulary (vocab_size={t.vocab_size})")
  if c.vocab_size and c.vocab_size != t.vocab_size:
    raise BadInputError(f"{source}: drafter vocab_size={c.vocab_size} differs from the target's "
                        f"vocab_size={t.vocab_size}")


def refuse_last_layer_features(target_layer_ids: Sequence[int], num_target_layers: int,
                               what: str) -> None:
  """Refuses a drafter that reads the target's last layer (docs/design.md §1, "Trap").

  bp_jax feeds the drafter each chosen layer's output before the final norm; transformers'
  `output_hidden_states[-1]`, which transformers-based DFlash code reads for the last layer, is
  after the final norm. A drafter on layer L-1 would see different features in the two.
  `what` names the ids in the message (a flag, or a file and its field).
  """
  last = num_target_layers - 1
  if last in target_layer_ids:
    raise BadInputError(
        f"{what} includes the target's last layer {last}, whose feature is the final-normed "
        "output in transformers-based DFlash code but the plain layer output in bp_jax; use "
        f"layers below {last} (z-lab DFlash drafters read layers 1..L-3)")
