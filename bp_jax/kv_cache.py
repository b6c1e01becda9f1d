"""A preallocated KV cache whose slot index is the token's absolute position.

`lengths[b]` is the pointer: the number of committed tokens of sequence b. A forward over T new
tokens writes slots `lengths .. lengths+T-1`; committing moves the pointer forward, rolling back
moves it back. Attention masks by position (a query at position q sees slots <= q), so entries
past the pointer are never read before they are overwritten.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """k/v are stacked `[L, B, S, K, H]` arrays, or (inside decode loops that run layers
  unrolled, see `per_layer`) tuples of L per-layer `[B, S, K, H]` arrays."""
  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, num_kv: int, head_dim: int,
             dtype) -> "KVCache":
    shape = (num_layers, batch, max_len, num_kv, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]  # layer 0's [B, S, K, H], in either layout

  @property
  def is_per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  def per_layer(self) -> "KVCache":
    """The same cache as one array per layer. A decode loop that runs layers unrolled carries
    this form: each layer then reads and writes its own buffer in place, where slicing a layer
    out of the stack copies it at every step."""
    if self.is_per_layer:
      return self
    return self.replace(k=tuple(self.k), v=tuple(self.v))

  def stacked(self) -> "KVCache":
    """The stacked `[L, B, S, K, H]` form (what callers outside the decode loops see)."""
    if not self.is_per_layer:
      return self
    return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_layer(buf_LBSKH: jax.Array, layer: jax.Array, new_BTKH: jax.Array,
                slots_BT: jax.Array) -> jax.Array:
  """Writes new entries of one layer at the given slots; slots beyond the cache are dropped."""
  B = new_BTKH.shape[0]
  b_idx = jnp.arange(B)[:, None]
  return buf_LBSKH.at[layer, b_idx, slots_BT].set(new_BTKH.astype(buf_LBSKH.dtype), mode="drop")


def write_slots(buf_BSKH: jax.Array, new_BTKH: jax.Array, slots_BT: jax.Array) -> jax.Array:
  """`write_layer` for one layer's own buffer (the per-layer cache form)."""
  b_idx = jnp.arange(new_BTKH.shape[0])[:, None]
  return buf_BSKH.at[b_idx, slots_BT].set(new_BTKH.astype(buf_BSKH.dtype), mode="drop")


def causal_mask(q_pos_BT: jax.Array, num_slots: int) -> jax.Array:
  """[B, T, S]: a query at position q sees key slots 0..q."""
  return jnp.arange(num_slots)[None, None, :] <= q_pos_BT[:, :, None]
