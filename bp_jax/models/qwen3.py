"""Dense Qwen3 decoder in Flax NNX (docs/design.md §1), layers stacked and run with `lax.scan`.

Parameters (Linear weights stored `[in, out]`, layer weights with a leading layer axis L):
  embed [V, D]; layers.<name> [L, ...] for name in `layers.LAYER_PARAM_NAMES`;
  final_norm [D]; lm_head [D, V] (absent when `tie_word_embeddings`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.models import layers as L
from bp_jax.models.config import Qwen3Config
from bp_jax.models.kv_cache import KVCache, causal_mask, write_keys, write_layer, write_values


def layer_param_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
  """Shapes of one decoder layer's parameters."""
  D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  N, K = cfg.num_attention_heads, cfg.num_key_value_heads
  return {"input_norm": (D,), "q_proj": (D, N * H), "k_proj": (D, K * H), "v_proj": (D, K * H),
          "o_proj": (N * H, D), "q_norm": (H,), "k_norm": (H,), "post_norm": (D,),
          "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


class LayerStack(nnx.Module):
  """`num_layers` Qwen3-style layers, each parameter stacked along a leading layer axis."""

  def __init__(self, cfg: Qwen3Config, num_layers: int, dtype, rngs: nnx.Rngs):
    for name, shape in layer_param_shapes(cfg).items():
      if len(shape) == 1:  # norm weights
        value = jnp.ones((num_layers, *shape), dtype)
      else:
        value = (0.02 * jax.random.normal(rngs.params(), (num_layers, *shape))).astype(dtype)
      setattr(self, name, nnx.Param(value))

  def as_dict(self) -> dict[str, jax.Array]:
    return {name: getattr(self, name)[...] for name in L.LAYER_PARAM_NAMES}

  def per_layer(self, fuse_qkv: bool = False,
                fuse_mlp: bool = False) -> list[dict[str, jax.Array]]:
    """One parameter dict per layer (static slices of the stacks), for the unrolled forward;
    with `fuse_mlp` / `fuse_qkv`, gate|up and q|k|v concatenated (`layers.fuse_projections`).

    Inside a decode loop, take these once before the `while_loop`: the slices are then loop
    invariants, whereas `lax.scan` over the stacks slices (copies) every layer's weights at
    every step, which on CPU costs as much as the layer's matmuls at decode batch sizes.
    """
    stacked = self.as_dict()
    n = stacked["input_norm"].shape[0]
    layers = [{name: w[i] for name, w in stacked.items()} for i in range(n)]
    if fuse_qkv or fuse_mlp:
      layers = [L.fuse_projections(p, qkv=fuse_qkv, mlp=fuse_mlp) for p in layers]
    return layers


class ForwardOutput(NamedTuple):
  logits: jax.Array          # [B, T', V] float32 (T' = T, or 1 when `logits_at` is given)
  final_hidden: jax.Array    # [B, T', D] after the final norm, where the logits are taken
  layer_hiddens: jax.Array   # [n, B, T, D]: outputs of the requested decoder layers
  cache: KVCache             # k/v written for the new tokens; `lengths` unchanged


class Qwen3(nnx.Module):
  """Qwen3ForCausalLM. `__call__` extends a KV cache by T tokens at positions lengths..lengths+T-1."""

  def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    D, V = cfg.hidden_size, cfg.vocab_size
    self.embed = nnx.Param((0.02 * jax.random.normal(rngs.params(), (V, D))).astype(dtype))
    self.layers = LayerStack(cfg, cfg.num_hidden_layers, dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((D,), dtype))
    if not cfg.tie_word_embeddings:
      self.lm_head = nnx.Param((0.02 * jax.random.normal(rngs.params(), (D, V))).astype(dtype))

  def loop_layers(self) -> list[dict[str, jax.Array]]:
    """The per-layer weights in the form a single-device decode loop runs them
    (`Engine._loop_weights`, the start-up cost probe): q|k|v and gate|up fused, as every layer
    projects its queries, keys and values from one input."""
    return self.layers.per_layer(fuse_qkv=True, fuse_mlp=True)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    c = self.cfg
    return KVCache.create(c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim,
                          self.dtype)

  def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens_BT, axis=0)

  def head_weight(self) -> jax.Array:
    """The output projection [D, V] (the embedding, transposed, when tied)."""
    return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

  def project_to_vocab(self, normed_BTD: jax.Array) -> jax.Array:
    """lm_head on already-normalised states: float32 logits [B, T, V]."""
    if self.cfg.tie_word_embeddings:  # contract with the embedding as stored, no transpose
      return jnp.einsum("btd,vd->btv", normed_BTD, self.embed[...],
                        preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", normed_BTD, self.lm_head[...],
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_BT: jax.Array, cache: KVCache,
               hidden_layers: Sequence[int] = (), logits_at: jax.Array | None = None,
               layers: Sequence[dict[str, jax.Array]] | None = None,
               window: int | None = None) -> ForwardOutput:
    """Runs T tokens through the model on top of `cache`.

    `hidden_layers`: indices of decoder layers whose outputs are returned (same pass).
    `logits_at`: optional [B] index into T, or [B, M] indices; logits are then computed only
    there ([B, 1, V] or [B, M, V]).
    `layers`: None runs the layers with `lax.scan` over the stacked parameters (one traced
    layer: fast to compile); `self.layers.per_layer()` (taken once, outside a decode loop) runs
    them unrolled with static per-layer weights (fast to run; see `LayerStack.per_layer`), on a
    stacked cache or, best, on `cache.per_layer()`.
    `window`: attend over cache slots [0, window) only (static; every query position must be
    below it): a decode step then reads the live part of the cache, not all `max_len` slots.
    """
    c = self.cfg
    B, T = tokens_BT.shape
    pos_BT = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cos, sin = L.rope_cos_sin(pos_BT, c.head_dim, c.rope_theta)
    W = cache.max_len if window is None else min(int(window), cache.max_len)
    mask_BTS = causal_mask(pos_BT, W)
    kept = sorted(set(hidden_layers))  # a layer may be requested more than once
    n_keep = len(kept)
    # Slot of each layer in the returned hidden buffer; unrequested layers go to a spare slot.
    keep_slot = [n_keep] * c.num_hidden_layers
    for i, layer in enumerate(kept):
      keep_slot[layer] = i
    x_BTD = self.embed_tokens(tokens_BT)
    hid = jnp.zeros((n_keep + 1, B, T, c.hidden_size), x_BTD.dtype)

    def body(carry, xs):
      x, k_all, v_all, hid = carry
      p, layer, slot = xs  # layer / slot: traced under scan, Python ints when unrolled
      xn = L.rms_norm(x, p["input_norm"], c.rms_norm_eps)
      q, k_new, v_new = L.project_qkv(xn, p, cos, sin, c.num_attention_heads,
                                      c.num_key_value_heads, c.head_dim, c.rms_norm_eps)
      if isinstance(k_all, tuple):  # per-layer cache (unrolled): layer is a Python int
        k_l = write_keys(k_all[layer], k_new, pos_BT)
        v_l = write_values(v_all[layer], v_new, pos_BT)
        k_all = k_all[:layer] + (k_l,) + k_all[layer + 1:]
        v_all = v_all[:layer] + (v_l,) + v_all[layer + 1:]
      else:
        k_all, v_all = write_layer(k_all, v_all, layer, k_new, v_new, pos_BT)
        k_l, v_l = k_all[layer], v_all[layer]
      if W < cache.max_len:
        k_l, v_l = k_l[:, :W], v_l[:, :, :W]
      attn = L.attend(q, k_l, v_l, mask_BTS)
      h = x + attn @ p["o_proj"]
      x = h + L.swiglu_mlp(L.rms_norm(h, p["post_norm"], c.rms_norm_eps), p)
      hid = jax.lax.dynamic_update_index_in_dim(hid, x, slot, axis=0)
      return (x, k_all, v_all, hid), None

    carry = (x_BTD, cache.k, cache.v, hid)
    if layers is None:
      if cache.is_per_layer:
        raise ValueError("a per-layer KV cache needs the unrolled forward (pass `layers`)")
      xs = (self.layers.as_dict(), jnp.arange(c.num_hidden_layers), jnp.asarray(keep_slot))
      carry, _ = jax.lax.scan(body, carry, xs)
    else:
      if len(layers) != c.num_hidden_layers:
        raise ValueError(f"got parameters of {len(layers)} layers for a model with "
                         f"{c.num_hidden_layers}")
      for i, p in enumerate(layers):
        carry, _ = body(carry, (p, i, keep_slot[i]))
    x_BTD, k_all, v_all, hid = carry
    if logits_at is not None:
      at = logits_at.astype(jnp.int32)
      at_BM1 = at[:, None, None] if at.ndim == 1 else at[:, :, None]
      x_BTD = jnp.take_along_axis(x_BTD, at_BM1, axis=1)
    normed = L.rms_norm(x_BTD, self.final_norm[...], c.rms_norm_eps)
    hid = hid[jnp.asarray([kept.index(layer) for layer in hidden_layers], jnp.int32)]
    return ForwardOutput(self.project_to_vocab(normed), normed, hid,
                         cache.replace(k=k_all, v=v_all))


def with_head_apart(model: Qwen3) -> Qwen3:
  """`model` with a tied output projection stored apart as `lm_head` [D, V] (the embedding,
  transposed once; the config then reads untied): the same weights and logits, one V x D
  matrix more in memory. A product with the embedding as stored, [V, D], contracts the minor
  dimension of both operands, which XLA:CPU runs slower than with a [D, V] operand: on the
  development CPU a head over 8 rows took 168 us against 98 us, and the demo's AR decoding
  ran 8-10% faster with the copy (`Engine`'s `head_apart`). A model without tied embeddings
  is returned as it is."""
  if not model.cfg.tie_word_embeddings:
    return model
  cfg = dataclasses.replace(model.cfg, tie_word_embeddings=False)
  graph, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, dtype=model.dtype,
                                                        rngs=nnx.Rngs(0))))
  weights = nnx.state(model).to_pure_dict()
  weights["lm_head"] = jnp.transpose(weights["embed"])
  nnx.replace_by_pure_dict(state, weights)
  return nnx.merge(graph, state)
