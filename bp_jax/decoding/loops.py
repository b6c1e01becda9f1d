"""The jitted core of decoding: prefill, the autoregressive loop and the speculative loop.

Each builder returns a pure function of (model states, buffers, scalars) to be compiled once per
static bucket by `CompiledCache`. A request's whole generation runs in one `lax.while_loop`.

Conventions inside a loop: `seq_1S` holds the request's tokens at their absolute positions; `pos`
is the position of the newest token `tok`, which the target has not seen yet, so the target
cache pointer equals `pos`; `n_gen` counts generated tokens (including `tok`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.models.kv_cache import KVCache
from bp_jax.policy.features import prefill_features
from bp_jax.decoding import verify as verify_rules
from bp_jax.decoding.sampling import as_sampling, position_keys, sample


class PrefillOut(NamedTuple):
  first_tok: jax.Array       # [] int32: the first generated token (position n)
  cache: KVCache             # target cache, pointer = n
  draft_cache: KVCache | None  # drafter context cache holding the prompt, pointer = n
  last_logits: jax.Array     # [1, V] logits at the last prompt position
  last_hidden: jax.Array     # [1, D] final hidden state (after the final norm) there
  # The block-size policy's inputs (`policy_features.prefill_features`): name -> [1, F] float32;
  # `pooled_layers` and `draft_confidence` only with a drafter.
  features: dict[str, jax.Array] | None = None
  policy_probs: jax.Array | None = None  # [C] float32 class probabilities (with a policy)
  policy_class: jax.Array | None = None  # [] int32 argmax class = index of the chosen bucket
  bad_logits: jax.Array | None = None    # [] bool: the last prompt position's logits hold NaN/inf


class LoopOut(NamedTuple):
  seq: jax.Array             # [1, S] tokens at absolute positions
  n_gen: jax.Array           # [] generated tokens (may overshoot max_new by < block size)
  accept_lens: jax.Array     # [S] committed tokens per target forward (first `forwards` valid)
  is_cycle: jax.Array        # [S] bool: that forward verified drafts (False: a plain AR step)
  forwards: jax.Array        # [] target forwards in the loop (speculative cycles + AR steps)
  bad_logits: jax.Array      # [] bool: a forward produced NaN/inf logits (the loop stopped)
  cache: KVCache
  draft_cache: KVCache | None


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def _nonfinite(logits: jax.Array) -> jax.Array:
  """[] bool: any NaN/inf among the logits a token is sampled from (e.g. float16 overflow):
  the loop stops there and the engine raises, instead of committing a meaningless id."""
  return ~jnp.all(jnp.isfinite(logits))


def make_prefill(graphdef, draft_graphdef=None, policy_graphdef=None) -> Callable:
  """prefill(state, draft_state, tokens_1P, n, cache, draft_cache, seed_key, sampling,
  policy_state=None) -> PrefillOut.

  `sampling`: a `sampling.SamplingParams` (or a temperature scalar), as in the loops.

  Runs the target over the padded prompt, samples the first token, and (with a drafter) writes
  the prompt's chosen-layer features into the drafter's context cache, all in one jit. The
  policy features come from that same forward. With `policy_graphdef` (a
  `bp_jax.policy.mlp.BlockPolicy`; its parameters arrive as `policy_state`, an argument, so one
  compilation serves every policy of the same architecture), the policy runs once on its feature
  and the argmax class is returned: the host then runs that bucket's compiled loop.
  """

  def prefill(state, draft_state, tokens_1P, n, cache, draft_cache, seed_key, sampling,
              policy_state=None):
    model = nnx.merge(graphdef, state)
    drafter = None if draft_graphdef is None else nnx.merge(draft_graphdef, draft_state)
    layer_ids = () if drafter is None else drafter.cfg.target_layer_ids
    zero = jnp.zeros((1,), jnp.int32)
    out = model(tokens_1P, cache.with_lengths(zero), layer_ids, logits_at=(n - 1)[None])
    logits_1V = out.logits[:, 0]
    first = sample(logits_1V, sampling, position_keys(seed_key, n[None]))[0]
    draft_logits = None
    if drafter is not None:
      draft_cache = drafter.add_context(out.layer_hiddens, draft_cache.with_lengths(zero))
      draft_cache = draft_cache.with_lengths(n[None])
      # The drafter's first block from the prompt's context (the `draft_confidence` feature).
      b0 = drafter.cfg.block_size
      block_1b = jnp.full((1, b0), drafter.cfg.mask_token_id, jnp.int32).at[0, 0].set(first)
      h_1bD = drafter.draft(model.embed_tokens(block_1b), draft_cache)
      draft_logits = model.project_to_vocab(h_1bD[:, 1:])
    features = prefill_features(logits_1V, out.final_hidden[:, 0],
                                out.layer_hiddens if drafter is not None else None, n,
                                draft_logits)
    probs = cls = None
    if policy_graphdef is not None:
      policy = nnx.merge(policy_graphdef, policy_state)
      probs = jax.nn.softmax(policy(features[policy.arch.feature_type])[0])
      cls = jnp.argmax(probs).astype(jnp.int32)
    return PrefillOut(first, out.cache.with_lengths(n[None]), draft_cache, logits_1V,
                      out.final_hidden[:, 0], features, probs, cls, _nonfinite(logits_1V))

  return prefill


def _layers_of(module, scan_layers: bool):
  """The `layers=` argument of a forward inside a decode loop: None runs `lax.scan` over the
  stacked weights; otherwise per-layer weights, sliced once here, outside the `while_loop`."""
  return None if scan_layers else module.layers.per_layer()


def _loop_cache(cache: KVCache | None, scan_layers: bool) -> KVCache | None:
  """The cache form a loop carries: per-layer buffers when layers run unrolled (split once per
  request here; `KVCache.stacked` joins them again after the loop)."""
  return cache if cache is None or scan_layers else cache.per_layer()


def make_ar_loop(graphdef, scan_layers: bool = False) -> Callable:
  """ar_loop(state, seq, cache, first_tok, n, max_new, sampling, seed_key, stop_ids) -> LoopOut.

  `sampling`: a `sampling.SamplingParams` (or a temperature scalar).

  `scan_layers`: run the target's layers with `lax.scan` (faster to compile for deep models)
  instead of unrolled with per-layer weights (faster per step; the default)."""

  def ar_loop(state, seq_1S, cache, first_tok, n, max_new, sampling, seed_key, stop_ids):
    sp = as_sampling(sampling)
    model = nnx.merge(graphdef, state)
    layers = _layers_of(model, scan_layers)
    S = seq_1S.shape[1]
    seq_1S = seq_1S.at[0, n].set(first_tok, mode="drop")
    accept0 = jnp.zeros((S,), jnp.int32)

    def cond(c):
      _, _, _, n_gen, done, _, _, _ = c
      return (~done) & (n_gen < max_new)

    def body(c):
      seq, cache, pos, n_gen, done, tok, steps, bad = c
      out = model(tok[None, None], cache.with_lengths(pos[None]), layers=layers)
      bad = _nonfinite(out.logits)
      miss = bad.astype(jnp.int32)
      nxt = sample(out.logits[:, 0], sp, position_keys(seed_key, (pos + 1)[None]))[0]
      # A step with NaN/inf logits commits nothing (n_gen does not count its write): the loop
      # ends and the engine raises.
      seq = seq.at[0, pos + 1].set(nxt, mode="drop")
      return (seq, out.cache, pos + 1, n_gen + 1 - miss, _is_stop(nxt, stop_ids) | bad, nxt,
              steps + 1 - miss, bad)

    init = (seq_1S, _loop_cache(cache, scan_layers), n, jnp.int32(1),
            _is_stop(first_tok, stop_ids), first_tok, jnp.int32(0), jnp.bool_(False))
    seq, cache, pos, n_gen, _, _, steps, bad = jax.lax.while_loop(cond, body, init)
    # Plain AR decoding is speculative decoding with block size 1: each step is a cycle that
    # drafts nothing and commits one token (τ = 1).
    accept = jnp.where(jnp.arange(S) < steps, 1, accept0)
    return LoopOut(seq, n_gen, accept, accept > 0, steps, bad,
                   cache.stacked().with_lengths(pos[None]), None)

  return ar_loop


def make_spec_loop(graphdef, draft_graphdef, block_size: int, scan_layers: bool = False,
                   ar_fallback: int = 0, ar_fallback_accept: int = 1,
                   forced_drafts: bool = False, verify: str = "exact") -> Callable:
  """spec_loop(state, draft_state, seq, cache, draft_cache, first_tok, n, max_new, sampling,
  seed_key, stop_ids[, forced_seq]) -> LoopOut.

  One cycle: the drafter proposes b-1 tokens after `tok` in one pass, the target verifies the b
  tokens [tok, d_1..d_{b-1}] in one forward, the `verify` rule (`verify.VERIFY_MODES`, static)
  decides y_0..y_a (a drafts accepted; `exact`: the drafter's argmax, kept while it equals the
  target's own sample at its position; `rejection`: drafts drawn from the drafter's
  distribution, speculative rejection sampling at T > 0), commits them, and both caches roll
  back by pointer to p + a + 1. The target features of block positions 0..a become drafter
  context. `sampling`: a `sampling.SamplingParams` (or a temperature scalar).

  `ar_fallback` > 0 (a static bucket parameter): after a cycle that accepts at most
  `ar_fallback_accept` drafts, the loop runs plain AR steps instead of cycles, 2, 4, 8, ... in
  a row for consecutive poor cycles (at most `ar_fallback`), then drafts again. An AR step is
  one target forward over `tok` whose chosen-layer features still become drafter context, so
  the next cycle drafts from the full context. Every token is still the target's own sample at
  its position (same keys), so the output is unchanged; only the time differs: on hardware
  where a cycle costs several AR steps, stretches the drafter cannot predict cost less.
  `LoopOut.is_cycle` tells cycles from AR steps (τ counts cycles only).

  `forced_drafts` (static; tests and benchmarks): the loop takes one more argument,
  `forced_seq` [1, S], and drafts the tokens stored there at their positions instead of the
  drafter's argmax: a perfect drafter that still pays the drafter's full compute. It is a
  separately compiled variant, so production loops carry no trace of it.
  `scan_layers`: as in `make_ar_loop`, for the target and the drafter.
  """
  b = block_size
  if ar_fallback < 0 or ar_fallback_accept < 0:
    raise ValueError("ar_fallback and ar_fallback_accept must be >= 0")
  verify_rules.check_verify_mode(verify, "verify")
  if forced_drafts and verify != "exact":
    raise ValueError("forced drafts are not draws from the drafter: only verify='exact'")

  def spec_loop(state, draft_state, seq_1S, cache, draft_cache, first_tok, n, max_new,
                sampling, seed_key, stop_ids, *forced):
    sp = as_sampling(sampling)
    model = nnx.merge(graphdef, state)
    drafter = nnx.merge(draft_graphdef, draft_state)
    layers, draft_layers = _layers_of(model, scan_layers), _layers_of(drafter, scan_layers)
    mask_id = drafter.cfg.mask_token_id
    layer_ids = drafter.cfg.target_layer_ids
    S = seq_1S.shape[1]
    seq_1S = seq_1S.at[0, n].set(first_tok, mode="drop")

    def cond(c):
      return (~c["done"]) & (c["n_gen"] < max_new)

    def commit(c, out, y, a, is_cycle, fallback):
      """The carry after a target forward at `pos` that commits y[0..a] (a drafts accepted); a
      forward with NaN/inf logits commits nothing and ends the loop (`bad_logits`)."""
      pos = c["pos"]
      # NaN/inf logits at a position a committed token is sampled from (positions past the
      # accepted prefix are discarded, whatever they hold).
      offs = jnp.arange(y.shape[0], dtype=jnp.int32)
      bad = jnp.any(~jnp.all(jnp.isfinite(out.logits[0]), axis=-1) & (offs <= a))
      a = jnp.where(bad, -1, a)
      new_pos = pos + a + 1
      seq = c["seq"].at[0, pos + 1 + offs].set(y, mode="drop")
      stop_hit = jnp.any(_is_stop(y, stop_ids) & (offs <= a)) | bad
      draft_cache = drafter.add_context(out.layer_hiddens, c["draft_cache"], draft_layers)
      kept = jnp.where(bad, 0, 1)
      return dict(seq=seq, cache=out.cache.with_lengths(new_pos[None]),
                  draft_cache=draft_cache.with_lengths(new_pos[None]), pos=new_pos,
                  tok=jnp.where(bad, c["tok"], y[jnp.maximum(a, 0)]), n_gen=c["n_gen"] + a + 1,
                  done=stop_hit, bad=bad,
                  accept=c["accept"].at[c["forwards"]].set(a + 1, mode="drop"),
                  is_cycle=c["is_cycle"].at[c["forwards"]].set(is_cycle, mode="drop"),
                  forwards=c["forwards"] + kept, **fallback)

    def draft_tokens(c):
      """(the b-1 drafts after `tok`, the drafter's logits [b-1, V]): one drafter pass over
      [tok, MASK, ..., MASK]."""
      block_1b = jnp.full((1, b), mask_id, jnp.int32).at[0, 0].set(c["tok"])
      h_1bD = drafter.draft(model.embed_tokens(block_1b), c["draft_cache"], draft_layers)
      logits_kV = model.project_to_vocab(h_1bD[:, 1:])[0]
      drafted = verify_rules.propose(logits_kV, verify, sp, seed_key, c["pos"])
      if forced_drafts:
        drafted = jax.lax.dynamic_slice_in_dim(forced[0][0], c["pos"] + 1, b - 1)
      return drafted.astype(jnp.int32), logits_kV

    def spec_cycle(c):
      pos, tok = c["pos"], c["tok"]
      draft, draft_logits_kV = draft_tokens(c)
      # Verify the whole block in one target forward.
      verify_1b = jnp.concatenate([tok[None], draft])[None]
      out = model(verify_1b, c["cache"].with_lengths(pos[None]), layer_ids, layers=layers)
      y, a = verify_rules.verify(out.logits[0], draft_logits_kV, draft, verify, sp, seed_key,
                                 pos)
      poor = a <= ar_fallback_accept
      misses = jnp.where(poor, c["misses"] + 1, 0)
      wait = jnp.where(poor, jnp.minimum(2 ** jnp.minimum(misses, 30), ar_fallback), 0)
      return commit(c, out, y, a, True, dict(misses=misses, wait=wait.astype(jnp.int32)))

    def ar_step(c):
      pos = c["pos"]
      out = model(c["tok"][None, None], c["cache"].with_lengths(pos[None]), layer_ids,
                  layers=layers)
      y = sample(out.logits[0], sp, position_keys(seed_key, (pos + 1)[None]))
      return commit(c, out, y, jnp.int32(0), False,
                    dict(misses=c["misses"], wait=c["wait"] - 1))

    def body(c):
      c = spec_cycle(c)
      if ar_fallback == 0:
        return c
      # The AR steps a poor cycle asked for, as a nested loop (zero trips otherwise): a
      # `lax.cond` between a cycle and a step would copy every cache buffer at every step.
      return jax.lax.while_loop(lambda c: (c["wait"] > 0) & cond(c), ar_step, c)

    init = dict(seq=seq_1S, cache=_loop_cache(cache, scan_layers),
                draft_cache=_loop_cache(draft_cache, scan_layers), pos=n, tok=first_tok,
                n_gen=jnp.int32(1), done=_is_stop(first_tok, stop_ids), bad=jnp.bool_(False),
                accept=jnp.zeros((S,), jnp.int32), is_cycle=jnp.zeros((S,), jnp.bool_),
                forwards=jnp.int32(0), misses=jnp.int32(0), wait=jnp.int32(0))
    c = jax.lax.while_loop(cond, body, init)
    return LoopOut(c["seq"], c["n_gen"], c["accept"], c["is_cycle"], c["forwards"], c["bad"],
                   c["cache"].stacked(), c["draft_cache"].stacked())

  return spec_loop
