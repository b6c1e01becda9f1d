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


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
  return (jax.nn.silu(x @ p["gate_proj"]) * (x @ p["up_proj"])) @ p["down_proj"]


def project_kv(x_BSD: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_kv: int,
               head_dim: int, eps: float) -> tuple[jax.Array, jax.Array]:
  """Keys (k_norm, then RoPE) and values [B, S, K, H] of already-normalised inputs."""
  B, S, _ = x_BSD.shape
  k_BSKH = (x_BSD @ p["k_proj"]).reshape(B, S, num_kv, head_dim)
  v_BSKH = (x_BSD @ p["v_proj"]).reshape(B, S, num_kv, head_dim)
  k_BSKH = apply_rope(rms_norm(k_BSKH, p["k_norm"], eps), cos, sin)
  return k_BSKH, v_BSKH


def project_q(x_BTD: jax.Array, p: dict, cos: jax.Array, sin: jax.Array, num_heads: int,
              head_dim: int, eps: float) -> jax.Array:
  """Queries [B, T, N, H] (q_norm, then RoPE) of already-normalised inputs."""
  B, T, _ = x_BTD.shape
  q_BTNH = (x_BTD @ p["q_proj"]).reshape(B, T, num_heads, head_dim)
  return apply_rope(rms_norm(q_BTNH, p["q_norm"], eps), cos, sin)


def attend(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
           mask_BTS: jax.Array) -> jax.Array:
  """Grouped-query attention with a boolean visibility mask; returns [B, T, N*H].

  Scores and softmax are in float32. A query row whose mask is all False returns zeros (only
  padding rows can be in that state; they are never read).
  """
  B, T, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                       preferred_element_type=jnp.float32) * (H ** -0.5)
  s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, -1e30)
  w_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
  w_BKGTS = jnp.where(mask_BTS[:, None, None], w_BKGTS, 0.0).astype(v_BSKH.dtype)
  o_BTKGH = jnp.einsum("bkgts,bskh->btkgh", w_BKGTS, v_BSKH)
  return o_BTKGH.reshape(B, T, N * H)
