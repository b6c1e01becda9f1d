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
  k: jax.Array        # [L, B, K, S, H]: kv-head major, so attention reads it without transposes
  v: jax.Array        # [L, B, K, S, H]
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, num_kv: int, head_dim: int,
             dtype) -> "KVCache":
    shape = (num_layers, batch, num_kv, max_len, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_chunk(buf_LBKSH: jax.Array, new_LBTKH: jax.Array, slots_BT: jax.Array) -> jax.Array:
  """Writes every layer's new entries at the given slots; slots beyond the cache are dropped."""
  b_idx = jnp.arange(new_LBTKH.shape[1])[:, None]
  # Advanced indices split by a slice put their broadcast dims first: updates are [B, T, L, K, H].
  upd_BTLKH = jnp.transpose(new_LBTKH, (1, 2, 0, 3, 4)).astype(buf_LBKSH.dtype)
  return buf_LBKSH.at[:, b_idx, :, slots_BT].set(upd_BTLKH, mode="drop")
