"""The jitted core of decoding: prefill, the autoregressive loop and the speculative loop.

Each builder returns a pure function of (model states, buffers, scalars) to be compiled once per
static bucket by `CompiledCache`. A request's whole generation runs in one `lax.while_loop`.

Conventions inside a loop: `seq_1S` holds the request's tokens at their absolute positions; `pos`
is the position of the newest token `tok`, which the target has not seen yet, so the target
cache pointer equals `pos`; `n_gen` counts generated tokens (including `tok`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.kv_cache import KVCache
from bp_jax.sampling import position_keys, sample


class PrefillOut(NamedTuple):
  first_tok: jax.Array       # [] int32: the first generated token (position n)
  cache: KVCache             # target cache, pointer = n
  ctx_hiddens: jax.Array     # [n_layers, 1, P, D] chosen target layers over the prompt
  last_logits: jax.Array     # [1, V] logits at the last prompt position
  last_hidden: jax.Array     # [1, D] final hidden state (after the final norm) there


class LoopOut(NamedTuple):
  seq: jax.Array             # [1, S] tokens at absolute positions
  n_gen: jax.Array           # [] generated tokens (may overshoot max_new by < block size)
  accept_lens: jax.Array     # [S] committed tokens per cycle (first `cycles` entries valid)
  cycles: jax.Array          # [] target forwards in the loop
  cache: KVCache
  draft_cache: KVCache | None


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def make_prefill(graphdef, hidden_layers: Sequence[int]) -> Callable:
  """prefill(state, tokens_1P, n, cache, seed_key, temperature) -> PrefillOut."""
  hidden_layers = tuple(hidden_layers)

  def prefill(state, tokens_1P, n, cache, seed_key, temperature):
    model = nnx.merge(graphdef, state)
    out = model(tokens_1P, cache.with_lengths(jnp.zeros((1,), jnp.int32)), hidden_layers,
                logits_at=(n - 1)[None])
    logits_1V = out.logits[:, 0]
    first = sample(logits_1V, temperature, position_keys(seed_key, n[None]))[0]
    return PrefillOut(first, out.cache.with_lengths(n[None]), out.layer_hiddens, logits_1V,
                      out.final_hidden[:, 0])

  return prefill


def make_ar_loop(graphdef) -> Callable:
  """ar_loop(state, seq, cache, first_tok, n, max_new, temperature, seed_key, stop_ids) -> LoopOut."""

  def ar_loop(state, seq_1S, cache, first_tok, n, max_new, temperature, seed_key, stop_ids):
    model = nnx.merge(graphdef, state)
    S = seq_1S.shape[1]
    seq_1S = seq_1S.at[0, n].set(first_tok, mode="drop")
    accept0 = jnp.zeros((S,), jnp.int32)

    def cond(c):
      _, _, _, n_gen, done, _, _ = c
      return (~done) & (n_gen < max_new)

    def body(c):
      seq, cache, pos, n_gen, done, tok, cycles = c
      out = model(tok[None, None], cache.with_lengths(pos[None]))
      nxt = sample(out.logits[:, 0], temperature, position_keys(seed_key, (pos + 1)[None]))[0]
      seq = seq.at[0, pos + 1].set(nxt, mode="drop")
      return (seq, out.cache, pos + 1, n_gen + 1, _is_stop(nxt, stop_ids), nxt, cycles + 1)

    init = (seq_1S, cache, n, jnp.int32(1), _is_stop(first_tok, stop_ids), first_tok, jnp.int32(0))
    seq, cache, pos, n_gen, _, _, cycles = jax.lax.while_loop(cond, body, init)
    accept = jnp.where(jnp.arange(S) < cycles, 1, accept0)
    return LoopOut(seq, n_gen, accept, cycles, cache.with_lengths(pos[None]), None)

  return ar_loop
