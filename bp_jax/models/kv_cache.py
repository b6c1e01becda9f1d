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

from bp_jax.models.layers import heads_to_rows


@flax.struct.dataclass
class KVCache:
  """Keys `[L, Z, S, H]` and values `[L, Z, H, S]`, Z = B * K (row `b * K + k` holds kv head k
  of sequence b); inside decode loops that run layers unrolled (see `per_layer`), tuples of L
  per-layer `[Z, S, H]` / `[Z, H, S]` arrays.

  These are the operands XLA:CPU's decode-time attention matmuls read in place, with one batch
  dimension: scores_SR = k [S, H] @ q [H, R] and out_HR = v [H, S] @ w [S, R] (the cache is the
  big operand, its contraction dim minor). The obvious `[B, S, K, H]` made XLA transpose every
  layer's whole cache at every decode step, and `[B, K, ...]` made it copy each buffer three
  times per step; this form halves a demo AR step's attention time (tests/test_spec_decode.py
  checks the compiled decode loops hold no cache-sized copy).
  """
  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, num_kv: int, head_dim: int,
             dtype) -> "KVCache":
    z = batch * num_kv
    return cls(k=jnp.zeros((num_layers, z, max_len, head_dim), dtype),
               v=jnp.zeros((num_layers, z, head_dim, max_len), dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]  # layer 0's keys [Z, S, H], in either form

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
    """The stacked form (what callers outside the decode loops see)."""
    if not self.is_per_layer:
      return self
    return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

  def as_LBSKH(self) -> tuple[jax.Array, jax.Array]:
    """Keys and values as `[L, B, S, K, H]` arrays (for inspection and tests; copies)."""
    c = self.stacked()
    L, Z, S, H = c.k.shape
    B = self.lengths.shape[0]
    k = c.k.reshape(L, B, Z // B, S, H).transpose(0, 1, 3, 2, 4)
    v = c.v.reshape(L, B, Z // B, H, S).transpose(0, 1, 4, 2, 3)
    return k, v

  def put_rows(self, src: "KVCache", row: jax.Array) -> "KVCache":
    """This cache with sequence `row` replaced by the one-sequence cache `src` (entries and
    pointer): how a prefilled request enters a batch slot. A slot-sized copy, in place when the
    caller donates this cache; either cache form."""
    rows = src.k[0].shape[0]  # Z of a one-sequence cache = its kv heads
    start = row * rows
    src_k, src_v = (src.k, src.v) if src.is_per_layer == self.is_per_layer else (
        (src.per_layer().k, src.per_layer().v) if self.is_per_layer else
        (src.stacked().k, src.stacked().v))
    axis = 0 if self.is_per_layer else 1
    put = lambda dst, new: jax.lax.dynamic_update_slice_in_dim(dst, new.astype(dst.dtype),
                                                               start, axis)
    if self.is_per_layer:
      k = tuple(put(d, n) for d, n in zip(self.k, src_k))
      v = tuple(put(d, n) for d, n in zip(self.v, src_v))
    else:
      k, v = put(self.k, src_k), put(self.v, src_v)
    return self.replace(k=k, v=v, lengths=self.lengths.at[row].set(src.lengths[0]))

  def take_rows(self, rows_R: jax.Array) -> "KVCache":
    """A cache of R sequences, sequence i a copy of this cache's sequence `rows_R[i]` (entries
    and pointer): a batch's state shrunk to the rows it still decodes, or grown back. Copies
    the R sequences once; either cache form."""
    B = self.lengths.shape[0]
    heads = self.k[0].shape[0] // B if self.is_per_layer else self.k.shape[1] // B
    z_Z = (rows_R[:, None] * heads + jnp.arange(heads)[None]).reshape(-1)
    axis = 0 if self.is_per_layer else 1
    take = lambda x: jnp.take(x, z_Z, axis=axis)
    k, v = ((tuple(map(take, self.k)), tuple(map(take, self.v))) if self.is_per_layer
            else (take(self.k), take(self.v)))
    return self.replace(k=k, v=v, lengths=self.lengths[rows_R])

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def _rows_and_slots(new_BTKH: jax.Array,
                    slots_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """New entries [Z, T, H], their slots [Z, T] and row indices [Z, 1]."""
  new_ZTH = heads_to_rows(new_BTKH)
  slots_ZT = jnp.repeat(slots_BT, new_BTKH.shape[2], axis=0)
  return new_ZTH, slots_ZT, jnp.arange(new_ZTH.shape[0])[:, None]


# Writers of new entries [B, T, K, H] at the given slots [B, T]; slots beyond the cache are
# dropped, never clamped. Row index and slot are the scatter's indexed dims.

def write_keys(k_ZSH: jax.Array, new_BTKH: jax.Array, slots_BT: jax.Array) -> jax.Array:
  """One layer's own key buffer (the per-layer cache form)."""
  new_ZTH, slots_ZT, rows = _rows_and_slots(new_BTKH, slots_BT)
  return k_ZSH.at[rows, slots_ZT].set(new_ZTH.astype(k_ZSH.dtype), mode="drop")


def write_values(v_ZHS: jax.Array, new_BTKH: jax.Array, slots_BT: jax.Array) -> jax.Array:
  """One layer's own value buffer (the per-layer cache form)."""
  new_ZTH, slots_ZT, rows = _rows_and_slots(new_BTKH, slots_BT)
  # Advanced indices split by a slice: the indexed dims [Z, T] lead, then H.
  return v_ZHS.at[rows, :, slots_ZT].set(new_ZTH.astype(v_ZHS.dtype), mode="drop")


def write_layer(k_LZSH: jax.Array, v_LZHS: jax.Array, layer: jax.Array, k_new_BTKH: jax.Array,
                v_new_BTKH: jax.Array, slots_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """New stacked (k, v) with one layer's entries written; `layer` may be traced (under scan)."""
  k_ZTH, slots_ZT, rows = _rows_and_slots(k_new_BTKH, slots_BT)
  v_ZTH = heads_to_rows(v_new_BTKH)
  k = k_LZSH.at[layer, rows, slots_ZT].set(k_ZTH.astype(k_LZSH.dtype), mode="drop")
  v = v_LZHS.at[layer, rows, :, slots_ZT].set(v_ZTH.astype(v_LZHS.dtype), mode="drop")
  return k, v


def write_all_layers(cache: KVCache, k_new_LBTKH: jax.Array, v_new_LBTKH: jax.Array,
                     slots_BT: jax.Array) -> KVCache:
  """Writes every layer's entries at the same slots, in either cache form."""
  if cache.is_per_layer:
    return cache.replace(
        k=tuple(write_keys(k, k_new_LBTKH[i], slots_BT) for i, k in enumerate(cache.k)),
        v=tuple(write_values(v, v_new_LBTKH[i], slots_BT) for i, v in enumerate(cache.v)))
  k, v = cache.k, cache.v
  for i in range(k.shape[0]):
    k, v = write_layer(k, v, i, k_new_LBTKH[i], v_new_LBTKH[i], slots_BT)
  return cache.replace(k=k, v=v)


def causal_mask(q_pos_BT: jax.Array, num_slots: int) -> jax.Array:
  """[B, T, S]: a query at position q sees key slots 0..q."""
  return jnp.arange(num_slots)[None, None, :] <= q_pos_BT[:, :, None]
