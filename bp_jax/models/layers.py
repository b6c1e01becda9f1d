"""Pure building blocks shared by the Qwen3 target and the DFlash drafter.

Shape suffixes: B batch, T query tokens, S key slots, N query heads, K kv heads, G query heads per
kv head, H head_dim, D hidden, F MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Per-layer parameter names (a leading layer axis when stacked). Shapes for one layer:
#   input_norm [D], q_proj [D, N*H], k_proj [D, K*H], v_proj [D, K*H], o_proj [N*H, D],
#   q_norm [H], k_norm [H], post_norm [D], gate_proj [D, F], up_proj [D, F], down_proj [F, D]
LAYER_PARAM_NAMES = ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                     "post_norm", "gate_proj", "up_proj", "down_proj")
# A decode loop's per-layer weights may hold these instead (`fuse_projections`):
#   qkv_proj [D, N*H + 2*K*H] = q_proj | k_proj | v_proj, gate_up_proj [D, 2F] = gate_proj | up_proj
QKV, GATE_UP = "qkv_proj", "gate_up_proj"


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, returned in the input dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(pos_BT: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables [B, T, H] for rotate-half RoPE at absolute positions."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  ang_BTh = pos_BT.astype(jnp.float32)[..., None] * inv_freq
  ang_BTH = jnp.concatenate([ang_BTh, ang_BTh], axis=-1)
  return jnp.cos(ang_BTH), jnp.sin(ang_BTH)


def apply_rope(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
  """Rotate-half RoPE (first half / second half of head_dim), computed in float32."""
  x = x_BTNH.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
  return out.astype(x_BTNH.dtype)


def fuse_projections(p: dict[str, jax.Array], qkv: bool, mlp: bool) -> dict[str, jax.Array]:
  """One layer's weights with, where `qkv`, q_proj | k_proj | v_proj concatenated into QKV
  and, where `mlp`, gate_proj | up_proj into GATE_UP (the separate matrices dropped): one
  product each where there were three and two. A decode step's products are matrix-vector
  ones that stream their weights, and on a 2-core CPU VM fewer, wider ones read them faster
  (the demo's AR loop: 0.91-0.97x the time per token in three alternated runs,
  `docs/cpu_epyc/fused_loop_ab.py`). Taken once per engine, in place of the separate slices
  (`Engine._loop_weights`)."""
  groups = ((QKV, ("q_proj", "k_proj", "v_proj")) if qkv else None,
            (GATE_UP, ("gate_proj", "up_proj")) if mlp else None)
  fused = dict(p)
  for name, parts in filter(None, groups):
    fused[name] = jnp.concatenate([fused.pop(part) for part in parts], axis=-1)
  return fused


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
  if GATE_UP in p:
    gate, up = jnp.split(x @ p[GATE_UP], 2, axis=-1)
  else:
    gate, up = x @ p["gate_proj"], x @ p["up_proj"]
  return (jax.nn.silu(gate) * up) @ p["down_proj"]


def _queries(q_BTX: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_heads: int,
             head_dim: int, eps: float) -> jax.Array:
  """Projected queries [B, T, N*H] as heads [B, T, N, H], q_norm then RoPE."""
  B, T, _ = q_BTX.shape
  q_BTNH = q_BTX.reshape(B, T, num_heads, head_dim)
  return apply_rope(rms_norm(q_BTNH, p["q_norm"], eps), cos, sin)


def _keys_values(k_BSX: jax.Array, v_BSX: jax.Array, p: dict, cos: jax.Array, sin: jax.Array,
                 num_kv: int, head_dim: int, eps: float) -> tuple[jax.Array, jax.Array]:
  """Projected keys and values [B, S, K*H] as heads [B, S, K, H], the keys k_norm then RoPE."""
  B, S, _ = k_BSX.shape
  k_BSKH = k_BSX.reshape(B, S, num_kv, head_dim)
  v_BSKH = v_BSX.reshape(B, S, num_kv, head_dim)
  return apply_rope(rms_norm(k_BSKH, p["k_norm"], eps), cos, sin), v_BSKH


def project_qkv(x_BTD: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_heads: int,
                num_kv: int, head_dim: int, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Queries [B, T, N, H], keys and values [B, T, K, H] of the same normalised inputs (as
  `project_q` and `project_kv`): one product where the layer's weights hold QKV."""
  if QKV in p:
    nq, nk = num_heads * head_dim, num_kv * head_dim
    q, k, v = jnp.split(x_BTD @ p[QKV], [nq, nq + nk], axis=-1)
  else:
    q, k, v = x_BTD @ p["q_proj"], x_BTD @ p["k_proj"], x_BTD @ p["v_proj"]
  return (_queries(q, p, cos, sin, num_heads, head_dim, eps),
          *_keys_values(k, v, p, cos, sin, num_kv, head_dim, eps))


def project_kv(x_BSD: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_kv: int,
               head_dim: int, eps: float) -> tuple[jax.Array, jax.Array]:
  """Keys (k_norm, then RoPE) and values [B, S, K, H] of already-normalised inputs."""
  return _keys_values(x_BSD @ p["k_proj"], x_BSD @ p["v_proj"], p, cos, sin, num_kv, head_dim,
                      eps)


def project_q(x_BTD: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_heads: int,
              head_dim: int, eps: float) -> jax.Array:
  """Queries [B, T, N, H] (q_norm, then RoPE) of already-normalised inputs."""
  return _queries(x_BTD @ p["q_proj"], p, cos, sin, num_heads, head_dim, eps)


def heads_to_rows(x_BTKH: jax.Array) -> jax.Array:
  """Keys or values [Z, T, H] in the `KVCache` row order (Z = B * K, row b * K + k)."""
  B, T, K, H = x_BTKH.shape
  return x_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H)


def queries_to_rows(q_BTNH: jax.Array, num_kv: int) -> jax.Array:
  """Queries [Z, G, T, H] in the KV cache's row order (Z = B * K, G = N // K query heads per
  kv head)."""
  B, T, N, H = q_BTNH.shape
  q_BTKGH = q_BTNH.reshape(B, T, num_kv, N // num_kv, H)
  return q_BTKGH.transpose(0, 2, 3, 1, 4).reshape(B * num_kv, N // num_kv, T, H)


def rows_to_outputs(o_ZGTH: jax.Array, batch: int) -> jax.Array:
  """Inverse of `queries_to_rows` for attention outputs, flattened to [B, T, N*H]."""
  Z, G, T, H = o_ZGTH.shape
  o_BKGTH = o_ZGTH.reshape(batch, Z // batch, G, T, H)
  return o_BKGTH.transpose(0, 3, 1, 2, 4).reshape(batch, T, -1)


def attend(q_BTNH: jax.Array, k_ZSH: jax.Array, v_ZHS: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
  """Grouped-query attention over a `KVCache` layer with a boolean visibility mask; [B, T, N*H].

  Scores and softmax are in float32. A query row whose mask is all False returns zeros (only
  padding rows can be in that state; they are never read).
  """
  B, T, _, H = q_BTNH.shape
  Z, S, _ = k_ZSH.shape
  q_ZGTH = queries_to_rows(q_BTNH, Z // B)
  s_ZGTS = jnp.einsum("zgth,zsh->zgts", q_ZGTH, k_ZSH,
                      preferred_element_type=jnp.float32) * (H ** -0.5)
  mask_Z1TS = jnp.repeat(mask_BTS, Z // B, axis=0)[:, None]
  s_ZGTS = jnp.where(mask_Z1TS, s_ZGTS, -1e30)
  w_ZGTS = jax.nn.softmax(s_ZGTS, axis=-1)
  w_ZGTS = jnp.where(mask_Z1TS, w_ZGTS, 0.0).astype(v_ZHS.dtype)
  return rows_to_outputs(jnp.einsum("zgts,zhs->zgth", w_ZGTS, v_ZHS), B)


def attend_BSKH(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                mask_BTS: jax.Array) -> jax.Array:
  """`attend` over keys and values given as plain [B, S, K, H] arrays (not a cache)."""
  return attend(q_BTNH, heads_to_rows(k_BSKH), heads_to_rows(v_BSKH).transpose(0, 2, 1),
                mask_BTS)
