"""The static KV cache (bp_jax/models/kv_cache.py) driven through Qwen3.__call__: incremental extends,
padding to a length bucket, rollback by pointer, and writes past the end of the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.models.kv_cache import KVCache, causal_mask, write_layer

TOL = 1e-5
V = 128
S = 32   # cache slots in most tests
REF = 20  # reference sequences are this long (few distinct shapes = few compilations)


class Jitted:
  """`model(tokens, cache)` compiled once per shape (the eager call costs ~0.5 s on CPU)."""

  def __init__(self, model):
    graph, self.state = nnx.split(model)
    self.fn = jax.jit(lambda state, tokens, cache: nnx.merge(graph, state)(tokens, cache))
    self.init_cache = model.init_cache

  def __call__(self, tokens, cache):
    return self.fn(self.state, jnp.asarray(tokens, jnp.int32), cache)


@pytest.fixture(scope="module")
def model(tiny_pair):
  return Jitted(tiny_pair[1])


def _seq(length: int, seed: int, batch: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, V, (batch, length)).astype(np.int32)


def _full_logits(model, tokens: np.ndarray) -> np.ndarray:
  """Logits of one forward over the whole sequence from an empty cache (causal, so a prefix's
  logits do not depend on what follows: sequences are padded to REF tokens)."""
  B, T = tokens.shape
  padded = np.concatenate([tokens, np.zeros((B, REF - T), np.int32)], axis=1)
  return np.asarray(model(padded, model.init_cache(B, S)).logits)[:, :T]


def _extend(model, tokens: np.ndarray, cache: KVCache, chunk: int) -> tuple[np.ndarray, KVCache]:
  """Feeds `tokens` `chunk` at a time, committing each chunk; returns logits of all of them."""
  logits = []
  for s in range(0, tokens.shape[1], chunk):
    piece = tokens[:, s:s + chunk]
    out = model(piece, cache)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), np.asarray(cache.lengths))
    cache = out.cache.with_lengths(cache.lengths + piece.shape[1])
    logits.append(np.asarray(out.logits))
  return np.concatenate(logits, axis=1), cache


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_prefill_then_extend_in_chunks_matches_one_full_forward(model, chunk):
  tokens = _seq(20, seed=0)
  full = _full_logits(model, tokens)
  prompt = 7
  cache = model.init_cache(1, S)
  pre, cache = _extend(model, tokens[:, :prompt], cache, chunk=prompt)
  rest, cache = _extend(model, tokens[:, prompt:], cache, chunk=chunk)
  assert int(cache.lengths[0]) == 20
  np.testing.assert_allclose(np.concatenate([pre, rest], axis=1), full, atol=TOL, rtol=0)


def test_batch_of_different_length_prompts_padded_to_one_bucket_matches_unpadded(model):
  lengths, bucket, steps = (5, 11), 16, 4
  seqs = [_seq(n + steps, seed=10 + i)[0] for i, n in enumerate(lengths)]
  # Pad with non-zero junk: padding must be invisible whatever its value.
  padded = np.full((2, bucket), 77, np.int32)
  for i, n in enumerate(lengths):
    padded[i, :n] = seqs[i][:n]
  out = model(padded, model.init_cache(2, S))
  cache = out.cache.with_lengths(jnp.asarray(lengths))
  step_logits = []
  for t in range(steps):  # then decode step by step, each row at its own position
    nxt = np.asarray([[seqs[i][n + t]] for i, n in enumerate(lengths)], np.int32)
    o = model(nxt, cache)
    step_logits.append(np.asarray(o.logits[:, 0]))
    cache = o.cache.with_lengths(cache.lengths + 1)
  for i, n in enumerate(lengths):
    ref = _full_logits(model, seqs[i][None])[0]
    np.testing.assert_allclose(np.asarray(out.logits[i, :n]), ref[:n], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.stack([s[i] for s in step_logits]), ref[n:], atol=TOL, rtol=0)


def test_rollback_then_rewrite_matches_a_fresh_run_on_the_new_sequence(model):
  old = _seq(14, seed=20)
  new_tail = _seq(3, seed=21)
  assert np.all(new_tail != old[:, 8:11])
  _, cache = _extend(model, old, model.init_cache(1, S), chunk=7)
  # Roll back to 8 and write only 3 different tokens: slots 11..13 still hold the old sequence's
  # keys and values and must not be attended.
  cache = cache.with_lengths(jnp.asarray([8]))
  got, cache = _extend(model, new_tail, cache, chunk=3)
  new_seq = np.concatenate([old[:, :8], new_tail], axis=1)
  ref = _full_logits(model, new_seq)
  np.testing.assert_allclose(got, ref[:, 8:], atol=TOL, rtol=0)
  # And one more step from there, after a second rollback of a single token.
  cache = cache.with_lengths(jnp.asarray([10]))
  got2, _ = _extend(model, old[:, 5:6], cache, chunk=1)
  ref2 = _full_logits(model, np.concatenate([new_seq[:, :10], old[:, 5:6]], axis=1))
  np.testing.assert_allclose(got2[:, 0], ref2[:, 10], atol=TOL, rtol=0)


def test_stale_entries_past_the_pointer_do_not_change_the_logits(model):
  tokens = _seq(5, seed=30)
  clean = model.init_cache(1, S)
  k_noise = jax.random.normal(jax.random.key(0), clean.k.shape) * 5
  v_noise = jax.random.normal(jax.random.key(1), clean.v.shape) * 5
  dirty = clean.replace(k=clean.k + k_noise, v=clean.v - v_noise)
  a = model(tokens, clean).logits
  b = model(tokens, dirty).logits
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)


def test_writes_past_the_cache_end_are_dropped_not_clamped(model):
  slots = 8
  tokens = _seq(10, seed=40)
  _, cache = _extend(model, tokens[:, :5], model.init_cache(1, slots), chunk=5)
  before = cache
  # 5 tokens at positions 5..9 into an 8-slot cache: 8 and 9 have no slot.
  over = model(tokens[:, 5:10], cache)
  fits = model(tokens[:, 5:8], cache)
  for got, want, old in zip(*(c.as_LBSKH() for c in (over.cache, fits.cache, before))):
    got, want, old = np.asarray(got), np.asarray(want), np.asarray(old)
    assert got.shape[2] == slots
    np.testing.assert_array_equal(got[:, :, :5], old[:, :, :5])
    np.testing.assert_allclose(got[:, :, 5:8], want[:, :, 5:8], atol=TOL, rtol=0)
    assert not np.allclose(got[:, :, 7], old[:, :, 7])  # slot 7 was written (by position 7)
  ref = _full_logits(model, tokens[:, :8])
  np.testing.assert_allclose(np.asarray(over.logits[:, :3]), ref[:, 5:8], atol=TOL, rtol=0)


def test_write_layer_drops_out_of_range_slots_and_touches_only_its_layer():
  # 2 layers, batch 2, 2 kv heads (Z = 4 rows), 4 slots, head_dim 2.
  cache = KVCache.create(2, 2, 4, 2, 2, jnp.float32)
  new = jnp.arange(1, 25, dtype=jnp.float32).reshape(2, 3, 2, 2)  # [B, T, K, H]
  slots = jnp.asarray([[2, 3, 4], [0, 1, 2]])  # sequence 0's third entry has no slot
  k, v = (np.asarray(x) for x in write_layer(cache.k, cache.v, jnp.int32(1), new, -new, slots))
  assert np.all(k[0] == 0) and np.all(v[0] == 0)
  new = np.asarray(new)
  for b in range(2):
    for h in range(2):  # row b * K + h holds kv head h of sequence b
      want = np.zeros((4, 2), np.float32)
      for t, s in enumerate(np.asarray(slots)[b]):
        if s < 4:
          want[s] = new[b, t, h]
      np.testing.assert_array_equal(k[1, 2 * b + h], want)
      np.testing.assert_array_equal(v[1, 2 * b + h], -want.T)


def test_causal_mask_is_by_absolute_position():
  m = np.asarray(causal_mask(jnp.asarray([[2, 3], [0, 1]]), 4))
  np.testing.assert_array_equal(m[0], [[1, 1, 1, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(m[1], [[1, 0, 0, 0], [1, 1, 0, 0]])
