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
from bp_jax.decoding import controller as control
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
  # [C] float32 the policy's decision scores (`BlockPolicy.decide`): class probabilities for a
  # classify head, shrunk expected value ratios (not probabilities) for a value head.
  policy_probs: jax.Array | None = None
  policy_class: jax.Array | None = None  # [] int32 the chosen class = index of the chosen bucket
  bad_logits: jax.Array | None = None    # [] bool: the last prompt position's logits hold NaN/inf


class LoopOut(NamedTuple):
  seq: jax.Array             # [1, S] tokens at absolute positions
  n_gen: jax.Array           # [] generated tokens (may overshoot max_new by < block size)
  accept_lens: jax.Array     # [S] committed tokens per target forward (first `forwards` valid)
  is_cycle: jax.Array        # [S] bool: that forward verified drafts (False: a plain AR step)
  # [S] int32 per forward: k + 1 for a target forward over k + 1 tokens after a drafter pass (a
  # cycle verifying k drafts), 0 for a forward without a drafter pass (AR loop, AR steps).
  verified: jax.Array
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
  compilation serves every policy of the same architecture), the policy's decision
  (`BlockPolicy.decide`) runs once on its feature and its class is returned: the host then runs
  that bucket's compiled loop.
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
      scores_1C, cls_1 = policy.decide(features[policy.arch.feature_type])
      probs, cls = scores_1C[0], cls_1[0]
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


def _active(c) -> jax.Array:
  """[B] bool: rows still decoding (not stopped, below their max_new_tokens). Empty slots have
  max_new = 0."""
  return (~c["done"]) & (c["n_gen"] < c["max_new"])


def _parked(c, active: jax.Array) -> jax.Array:
  """[B] the cache pointer a forward uses per row: the row's position, or the cache length for
  a row that is not decoding, so that every write of that row falls past the cache and is
  dropped (a finished row or an empty slot makes no write while the others go on)."""
  return jnp.where(active, c["pos"], c["seq"].shape[1])


def _row_keys(seed_keys_B: jax.Array, pos_BT: jax.Array) -> jax.Array:
  """[B, T] typed keys: each request's own seed folded with absolute positions."""
  return jax.vmap(position_keys)(seed_keys_B, pos_BT)


def _ar_draw(c, out, sp) -> jax.Array:
  """[B, 1] the target's sample at pos + 1 from a one-token forward: what plain AR decoding
  commits there (each row's own key)."""
  keys_B = _row_keys(c["seed_keys"], (c["pos"] + 1)[:, None])[:, 0]
  return sample(out.logits[:, 0], sp, keys_B)[:, None]


def _commit(c, out, y_Bb, a_B, is_cycle: bool, verified: int, stop_ids, drafter=None,
            draft_layers=None, fallback=None) -> dict:
  """The carry after a target forward that commits y[r, 0..a_r] for every decoding row r (a_r
  drafts accepted). `is_cycle` and `verified` (static) are that forward's records: a cycle or
  not, and k + 1 when it verified k drafts after a drafter pass (0: no drafter pass). A row
  that is not decoding commits nothing and writes nothing; a forward with NaN/inf logits at a
  committed position commits nothing there and stops that row (`bad`)."""
  B, S = c["seq"].shape
  active = _active(c)
  pos = c["pos"]
  offs = jnp.arange(y_Bb.shape[1], dtype=jnp.int32)
  # NaN/inf logits at a position a committed token is sampled from (positions past the
  # accepted prefix are discarded, whatever they hold).
  finite_Bb = jnp.all(jnp.isfinite(out.logits), axis=-1)
  bad = active & jnp.any(~finite_Bb & (offs[None] <= a_B[:, None]), axis=-1)
  a_B = jnp.where(bad | ~active, -1, a_B)
  kept = a_B >= 0
  new_pos = pos + a_B + 1
  rows = jnp.arange(B)
  write_at = jnp.where(active[:, None], pos[:, None] + 1 + offs[None], S)
  seq = c["seq"].at[rows[:, None], write_at].set(y_Bb, mode="drop")
  stop_hit = jnp.any(_is_stop(y_Bb, stop_ids) & (offs[None] <= a_B[:, None]), axis=-1)
  fwd_at = jnp.where(active, c["forwards"], S)
  new = dict(c, seq=seq, cache=out.cache.with_lengths(new_pos), pos=new_pos,
             tok=jnp.where(kept, y_Bb[rows, jnp.maximum(a_B, 0)], c["tok"]),
             n_gen=c["n_gen"] + a_B + 1, done=c["done"] | (active & (stop_hit | bad)),
             bad=c["bad"] | bad,
             accept=c["accept"].at[rows, fwd_at].set(a_B + 1, mode="drop"),
             is_cycle=c["is_cycle"].at[rows, fwd_at].set(is_cycle, mode="drop"),
             verified=c["verified"].at[rows, fwd_at].set(verified, mode="drop"),
             forwards=c["forwards"] + kept.astype(jnp.int32))
  if drafter is not None:
    draft_cache = drafter.add_context(out.layer_hiddens,
                                      c["draft_cache"].with_lengths(_parked(c, active)),
                                      draft_layers)
    new["draft_cache"] = draft_cache.with_lengths(new_pos)
  if fallback is not None:
    new.update({k: jnp.where(active, v, c[k]) for k, v in fallback(c, a_B).items()})
  return new


def _run(cond_rows: Callable, body: Callable, c: dict, sync_cycles: int) -> dict:
  """Runs `body` while some row decodes (`cond_rows`), at most `sync_cycles` times when > 0
  (then the host gets the carry back to refill finished slots), in one `while_loop`."""
  if sync_cycles <= 0:
    return jax.lax.while_loop(cond_rows, body, c)

  def cond(ic):
    return (ic[0] < sync_cycles) & cond_rows(ic[1])

  return jax.lax.while_loop(cond, lambda ic: (ic[0] + 1, body(ic[1])), (jnp.int32(0), c))[1]


def slot_carry(seq_BS: jax.Array, cache: KVCache, draft_cache: KVCache | None,
               forced_BS: jax.Array | None = None) -> dict:
  """The carry of a batched loop with every slot empty (max_new = 0): per-row position, token,
  counts, acceptance lengths and seed keys beside the shared buffers."""
  B, S = seq_BS.shape
  zeros = lambda: jnp.zeros((B,), jnp.int32)  # one buffer per field: the carry is donated
  c = dict(seq=seq_BS, cache=cache, pos=zeros(), tok=zeros(), n_gen=zeros() + 1,
           max_new=zeros(), done=jnp.zeros((B,), jnp.bool_), bad=jnp.zeros((B,), jnp.bool_),
           accept=jnp.zeros((B, S), jnp.int32), is_cycle=jnp.zeros((B, S), jnp.bool_),
           verified=jnp.zeros((B, S), jnp.int32),
           forwards=zeros(), misses=zeros(), wait=zeros(),
           seed_keys=jax.random.split(jax.random.key(0), B))
  if draft_cache is not None:
    c["draft_cache"] = draft_cache
  if forced_BS is not None:
    c["forced"] = forced_BS
  return c


def start_row(c: dict, row, first_tok, n, max_new, seed_key, stop_ids,
              forced_S: jax.Array | None = None) -> dict:
  """`c` with slot `row` starting a request whose prompt (n tokens) and first generated token
  are in place: the caches' rows are the caller's to fill (`KVCache.put_rows`)."""
  S = c["seq"].shape[1]
  new = dict(c, seq=c["seq"].at[row, n].set(first_tok, mode="drop"),
             pos=c["pos"].at[row].set(n), tok=c["tok"].at[row].set(first_tok),
             n_gen=c["n_gen"].at[row].set(1), max_new=c["max_new"].at[row].set(max_new),
             done=c["done"].at[row].set(_is_stop(first_tok, stop_ids)),
             bad=c["bad"].at[row].set(False),
             accept=c["accept"].at[row].set(jnp.zeros((S,), jnp.int32)),
             is_cycle=c["is_cycle"].at[row].set(jnp.zeros((S,), jnp.bool_)),
             verified=c["verified"].at[row].set(jnp.zeros((S,), jnp.int32)),
             forwards=c["forwards"].at[row].set(0), misses=c["misses"].at[row].set(0),
             wait=c["wait"].at[row].set(0), seed_keys=c["seed_keys"].at[row].set(seed_key))
  if forced_S is not None:
    new["forced"] = c["forced"].at[row].set(forced_S)
  return new


def make_insert() -> Callable:
  """insert(carry, row, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids
  [, forced_S]) -> carry: a request prefilled into one-sequence caches (`make_prefill`) takes
  slot `row` of a batched carry (compiled once per carry shape; the carry is donated)."""

  def insert(c, row, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids, *forced):
    c = start_row(c, row, first_tok, n, max_new, seed_key, stop_ids, *forced)
    c["cache"] = c["cache"].put_rows(cache, row)
    if draft_cache is not None:
      c["draft_cache"] = c["draft_cache"].put_rows(draft_cache, row)
    return c

  return insert


def _fits(c, span: int, window: int | None) -> jax.Array:
  """[] bool: every decoding row's next forward of `span` tokens lies inside the attention
  window (always, without one)."""
  if window is None:
    return jnp.bool_(True)
  return jnp.all(~_active(c) | (c["pos"] + span <= window))


def make_batched_ar_loop(graphdef, scan_layers: bool = False, sync_cycles: int = 0,
                         window: int | None = None) -> Callable:
  """ar_loop(state, carry, sampling, stop_ids) -> carry: plain AR decoding of every row of a
  `slot_carry` (rows at their own positions), until no row decodes or, with `sync_cycles` > 0
  (static), after that many steps.

  `window` (static): attention reads cache slots [0, window) only, and the loop returns to the
  host before a row's next step would reach past it (the host then picks a larger window,
  `window_for`): a step reads the live part of the cache instead of all its slots.

  `sampling`: a `sampling.SamplingParams` (or a temperature scalar) shared by the batch; each
  row draws with its own seed key at its own positions, so a row's tokens are those it gets
  decoded alone. `scan_layers`: run the target's layers with `lax.scan` (faster to compile for
  deep models) instead of unrolled with per-layer weights (faster per step; the default)."""

  def ar_loop(state, c, sampling, stop_ids):
    sp = as_sampling(sampling)
    model = nnx.merge(graphdef, state)
    layers = _layers_of(model, scan_layers)

    def body(c):
      out = model(c["tok"][:, None], c["cache"].with_lengths(_parked(c, _active(c))),
                  layers=layers, window=window)
      y_B1 = _ar_draw(c, out, sp)
      # Plain AR decoding is speculative decoding with block size 1: each step is a cycle that
      # drafts nothing and commits one token (τ = 1).
      return _commit(c, out, y_B1, jnp.zeros_like(c["pos"]), True, 0, stop_ids)

    c = dict(c, cache=_loop_cache(c["cache"], scan_layers))
    return _run(lambda c: jnp.any(_active(c)) & _fits(c, 1, window), body, c, sync_cycles)

  return ar_loop


def make_batched_spec_loop(graphdef, draft_graphdef, block_size: int, scan_layers: bool = False,
                           ar_fallback: int = 0, ar_fallback_accept: int = 1,
                           forced_drafts: bool = False, verify: str = "exact",
                           sync_cycles: int = 0, window: int | None = None,
                           controller: str | None = None,
                           controller_costs=control.DEFAULT_COSTS,
                           controller_draft_cost: float = control.DEFAULT_DRAFT_COST,
                           controller_poor_miss: bool = False,
                           controller_calibration: tuple[float, ...] | None = None
                           ) -> Callable:
  """spec_loop(state, draft_state, carry, sampling, stop_ids) -> carry: speculative decoding of
  every row of a `slot_carry`, each at its own position, until no row decodes or, with
  `sync_cycles` > 0 (static), after that many cycles.

  One cycle: the drafter proposes b-1 tokens after each row's `tok` in one pass, the target
  verifies the rows' b tokens [tok, d_1..d_{b-1}] in one forward, the `verify` rule
  (`verify.VERIFY_MODES`, static; applied per row with the row's seed key) decides y_0..y_a
  (a drafts accepted; `exact`: the drafter's argmax, kept while it equals the target's own
  sample at its position; `rejection`: drafts drawn from the drafter's distribution,
  speculative rejection sampling at T > 0), commits them, and both caches roll back by pointer
  to p + a + 1, row by row. The target features of block positions 0..a become drafter context.
  `sampling`: a `sampling.SamplingParams` (or a temperature scalar) shared by the batch.

  `ar_fallback` > 0 (a static bucket parameter): after a cycle that accepts at most
  `ar_fallback_accept` drafts, a row asks for plain AR steps instead of cycles, 2, 4, 8, ... in
  a row for consecutive poor cycles (at most `ar_fallback`), then drafts again. The batch takes
  AR steps while every decoding row asks for them (a row alone: exactly its own schedule). An
  AR step is one target forward over `tok` whose chosen-layer features still become drafter
  context, so the next cycle drafts from the full context. Every token is still the target's
  own sample at its position (same keys), so the output is unchanged; only the time differs.
  `carry["is_cycle"]` tells cycles from AR steps (τ counts cycles only); `carry["verified"]`
  records per forward k + 1 for a forward verifying k drafts after a drafter pass, 0 for one
  without a drafter pass (the AR steps).

  `forced_drafts` (static; tests and benchmarks): the carry has `forced` [B, S], and each row
  drafts the tokens stored there at its positions (where >= 0; elsewhere the drafter's own)
  instead of the drafter's: a perfect drafter that still pays the drafter's full compute (its
  tokens stay live: overwriting them outright let XLA drop the whole drafter pass as dead code
  under `exact`). It is a separately compiled variant, so production loops carry no trace of
  it.
  `scan_layers`, `window`: as in `make_batched_ar_loop`, for the target and the drafter (a
  cycle needs b slots of room, an AR step one).

  `controller` (static; `controller.CONTROLLERS`, None = "backoff" with `ar_fallback` > 0, else
  "none"): "none" verifies every draft and ignores `ar_fallback`; "backoff" is the AR fallback
  above; "confidence" verifies k of the b-1 drafts, k from `controller.verify_buckets(b)`
  chosen per cycle (one k for the batch) by `controller.choose` with the cost table
  `controller_costs` / `controller_draft_cost`; a cycle whose best rate is below the AR rate is a
  miss (with `controller_poor_miss`, also one that verified more than `ar_fallback_accept`
  drafts and accepted at most that many), and after it the rows take AR steps without drafter
  passes, 2, 4, ... for consecutive misses, at most `ar_fallback` (`controller.loop_form`: 16
  when 0), the count reset by a cycle that is no miss; `controller_calibration` (acceptance
  rates per p bin, `controller.calibrated`) replaces the drafter's p_i in the rule. "fixed:k"
  (tests) verifies k drafts every cycle through the same machinery. Each bucket is its own
  verify shape [B, k+1] run as a nested `while_loop` of zero or one trips (a `lax.switch` would
  copy every cache buffer); a cycle verifying k = 0 drafts still counts as a cycle (its drafter
  pass was paid).
  """
  b = block_size
  if ar_fallback < 0 or ar_fallback_accept < 0:
    raise ValueError("ar_fallback and ar_fallback_accept must be >= 0")
  controller, ar_fallback = control.loop_form(controller, ar_fallback)
  fixed = control.fixed_k(controller, b)
  if fixed is None:
    control.check_controller(controller, "controller")
  confidence = controller == "confidence"
  buckets = control.verify_buckets(b) if (confidence or fixed is not None) else None
  if buckets is not None:
    costs = control.parse_costs(controller_costs, "controller_costs")
    cost_K = control.bucket_costs(b, costs, control.check_draft_cost(controller_draft_cost))
    ar_cost = control.verify_cost(1, costs)
  verify_rules.check_verify_mode(verify, "verify")
  if forced_drafts and verify != "exact":
    raise ValueError("forced drafts are not draws from the drafter: only verify='exact'")

  def spec_loop(state, draft_state, c, sampling, stop_ids):
    sp = as_sampling(sampling)
    model = nnx.merge(graphdef, state)
    drafter = nnx.merge(draft_graphdef, draft_state)
    layers, draft_layers = _layers_of(model, scan_layers), _layers_of(drafter, scan_layers)
    mask_id = drafter.cfg.mask_token_id
    layer_ids = drafter.cfg.target_layer_ids

    def draft_tokens(c, parked):
      """(each row's b-1 drafts after `tok` [B, b-1], the drafter's logits [B, b-1, V]): one
      drafter pass over [tok, MASK, ..., MASK]."""
      B = parked.shape[0]
      block_Bb = jnp.full((B, b), mask_id, jnp.int32).at[:, 0].set(c["tok"])
      h_BbD = drafter.draft(model.embed_tokens(block_Bb), c["draft_cache"].with_lengths(parked),
                            draft_layers, window)
      logits_BkV = model.project_to_vocab(h_BbD[:, 1:])
      drafted = jax.vmap(lambda lg, key, p: verify_rules.propose(lg, verify, sp, key, p))(
          logits_BkV, c["seed_keys"], c["pos"])
      if forced_drafts:  # the forced token where one is given (>= 0), else the drafter's own:
        # the drafter's tokens stay live, so XLA cannot drop the drafter pass as dead code
        forced_Bk = jax.vmap(lambda f, p: jax.lax.dynamic_slice_in_dim(f, p + 1, b - 1))(
            c["forced"], c["pos"])
        drafted = jnp.where(forced_Bk >= 0, forced_Bk, drafted)
      return drafted.astype(jnp.int32), logits_BkV

    def backed_off(c, miss_B):
      """Each row's consecutive misses after this cycle and the AR steps it asks for (the
      back-off schedule; a cycle that is no miss resets both)."""
      misses = jnp.where(miss_B, c["misses"] + 1, 0)
      return dict(misses=misses,
                  wait=jnp.where(miss_B, control.backoff_steps(misses, ar_fallback), 0))

    def fallback_after(c, a_B):
      """`backoff`: a cycle accepting at most `ar_fallback_accept` drafts is a miss."""
      return backed_off(c, a_B <= ar_fallback_accept)

    def skip_after(draft_next, k: int):
      """The `fallback` of a confidence cycle verifying k drafts: each row's consecutive misses
      (the controller declined to draft next, or with `controller_poor_miss` the cycle verified
      more than `ar_fallback_accept` drafts and accepted at most that many) and the AR steps
      without drafter passes it asks for."""
      def after(c, a_B):
        miss = ~draft_next | jnp.zeros_like(a_B, jnp.bool_)
        if controller_poor_miss and k > ar_fallback_accept:
          miss = miss | (a_B <= ar_fallback_accept)
        return backed_off(c, miss)
      return after

    def verify_k(c, k, draft_Bk, draft_logits_BkV, fallback=None):
      """The carry after the target verifies each row's first k drafts ([B, k+1] tokens, one
      forward) and commits what the `verify` rule keeps."""
      verify_Bt = jnp.concatenate([c["tok"][:, None], draft_Bk[:, :k]], axis=1)
      out = model(verify_Bt, c["cache"].with_lengths(_parked(c, _active(c))), layer_ids,
                  layers=layers, window=window)
      if k == 0:  # the AR step's own draw at pos + 1 under either verify rule
        y_Bt, a_B = _ar_draw(c, out, sp), jnp.zeros_like(c["pos"])
      else:
        y_Bt, a_B = jax.vmap(
            lambda tl, dl, d, key, p: verify_rules.verify(tl, dl, d, verify, sp, key, p))(
                out.logits, draft_logits_BkV[:, :k], draft_Bk[:, :k], c["seed_keys"], c["pos"])
      return _commit(c, out, y_Bt, a_B, True, k + 1, stop_ids, drafter, draft_layers, fallback)

    def spec_cycle(c):
      """The paper's cycle: every row's whole block verified in one target forward."""
      draft_Bk, draft_logits_BkV = draft_tokens(c, _parked(c, _active(c)))
      return verify_k(c, b - 1, draft_Bk, draft_logits_BkV,
                      fallback_after if ar_fallback else None)

    def controlled_cycle(c):
      """One cycle verifying the bucket the controller picks (one nested loop per bucket,
      exactly one of which runs once)."""
      active = _active(c)
      draft_Bk, draft_logits_BkV = draft_tokens(c, _parked(c, active))
      if fixed is not None:
        idx, draft_next = jnp.int32(buckets.index(fixed)), jnp.bool_(True)
      else:
        p_Bk = control.calibrated(control.drafted_probs(draft_logits_BkV, draft_Bk),
                                  controller_calibration)
        idx, draft_next = control.choose(p_Bk, active, buckets, cost_K, ar_cost)
      for i, k in enumerate(buckets):
        after = skip_after(draft_next, k) if confidence else None
        run = lambda s, k=k, after=after: (
            jnp.bool_(False), verify_k(s[1], k, draft_Bk, draft_logits_BkV, after))
        c = jax.lax.while_loop(lambda s: s[0], run, (idx == i, c))[1]
      return c

    def ar_step(c):
      out = model(c["tok"][:, None], c["cache"].with_lengths(_parked(c, _active(c))),
                  layer_ids, layers=layers, window=window)
      return _commit(c, out, _ar_draw(c, out, sp), jnp.zeros_like(c["pos"]), False, 0,
                     stop_ids, drafter, draft_layers, lambda c, a: dict(wait=c["wait"] - 1))

    def wants_ar(c):
      active = _active(c)
      return jnp.any(active) & jnp.all(~active | (c["wait"] > 0)) & _fits(c, 1, window)

    def body(c):
      c = spec_cycle(c) if buckets is None else controlled_cycle(c)
      if ar_fallback == 0 and not confidence:
        return c
      # The AR steps the rows' poor cycles asked for, as a nested loop (zero trips otherwise):
      # a `lax.cond` between a cycle and a step would copy every cache buffer at every step.
      return jax.lax.while_loop(wants_ar, ar_step, c)

    c = dict(c, cache=_loop_cache(c["cache"], scan_layers),
             draft_cache=_loop_cache(c["draft_cache"], scan_layers))
    return _run(lambda c: jnp.any(_active(c)) & _fits(c, b, window), body, c, sync_cycles)

  return spec_loop


def _single(c: dict) -> LoopOut:
  """The LoopOut of a one-row carry (stacked caches, as callers outside the loops expect)."""
  return LoopOut(c["seq"], c["n_gen"][0], c["accept"][0], c["is_cycle"][0], c["verified"][0],
                 c["forwards"][0], c["bad"][0], c["cache"].stacked(),
                 c["draft_cache"].stacked() if "draft_cache" in c else None)


def _one_row(seq_1S, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids,
             forced_1S=None) -> dict:
  c = slot_carry(seq_1S, cache, draft_cache, forced_1S)
  return start_row(c, 0, first_tok, n, max_new, seed_key, stop_ids,
                   None if forced_1S is None else forced_1S[0])


def make_ar_loop(graphdef, scan_layers: bool = False) -> Callable:
  """ar_loop(state, seq, cache, first_tok, n, max_new, sampling, seed_key, stop_ids) -> LoopOut:
  one request, `make_batched_ar_loop` on a one-row carry. `sampling`: a
  `sampling.SamplingParams` (or a temperature scalar)."""
  batched = make_batched_ar_loop(graphdef, scan_layers)

  def ar_loop(state, seq_1S, cache, first_tok, n, max_new, sampling, seed_key, stop_ids):
    c = _one_row(seq_1S, cache, None, first_tok, n, max_new, seed_key, stop_ids)
    return _single(batched(state, c, sampling, stop_ids))

  return ar_loop


def make_spec_loop(graphdef, draft_graphdef, block_size: int, scan_layers: bool = False,
                   ar_fallback: int = 0, ar_fallback_accept: int = 1,
                   forced_drafts: bool = False, verify: str = "exact",
                   controller: str | None = None, controller_costs=control.DEFAULT_COSTS,
                   controller_draft_cost: float = control.DEFAULT_DRAFT_COST,
                   controller_poor_miss: bool = False,
                   controller_calibration: tuple[float, ...] | None = None) -> Callable:
  """spec_loop(state, draft_state, seq, cache, draft_cache, first_tok, n, max_new, sampling,
  seed_key, stop_ids[, forced_seq]) -> LoopOut: one request, `make_batched_spec_loop` (see it
  for the cycle, the fallback, the controller and forced drafts) on a one-row carry;
  `forced_seq` [1, S]."""
  batched = make_batched_spec_loop(graphdef, draft_graphdef, block_size, scan_layers,
                                   ar_fallback, ar_fallback_accept, forced_drafts, verify,
                                   controller=controller, controller_costs=controller_costs,
                                   controller_draft_cost=controller_draft_cost,
                                   controller_poor_miss=controller_poor_miss,
                                   controller_calibration=controller_calibration)

  def spec_loop(state, draft_state, seq_1S, cache, draft_cache, first_tok, n, max_new,
                sampling, seed_key, stop_ids, *forced):
    c = _one_row(seq_1S, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids,
                 forced[0] if forced else None)
    return _single(batched(state, draft_state, c, sampling, stop_ids))

  return spec_loop
