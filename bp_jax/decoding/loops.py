"""The jitted core of decoding: prefill, the autoregressive loop and the speculative loop.

Each builder takes the loop's `options.LoopOptions` and returns a pure function of (model states,
buffers, scalars) to be compiled once per static bucket by `CompiledCache`. A request's whole
generation runs in one `lax.while_loop` over a `state.LoopState` (its conventions: there).

After every target forward the same steps run (`_commit`): the NaN check (`_checked`), accept and
roll back (`LoopState.committed`), record (`ForwardRecords.recorded`); the speculative loop adds
the drafter's context and the controller's back-off.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.decoding import controllers
from bp_jax.decoding import evidence
from bp_jax.decoding import verify as verify_rules
from bp_jax.decoding.options import LoopOptions
from bp_jax.decoding.sampling import (SamplingForm, as_sampling, in_form, is_greedy,
                                      position_keys, sample)
from bp_jax.decoding.state import LoopState
from bp_jax.models.kv_cache import KVCache
from bp_jax.policy.features import DRAFT_CONFIDENCE, FEATURE_TYPES, prefill_features


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
  # [] bool: the last prompt position's logits hold NaN/inf (a host bool once `Engine.stage`
  # read it back with the policy's choice)
  bad_logits: jax.Array | bool | None = None
  # [n, 1, P, D] the drafter's chosen target layers' outputs over the padded prompt, kept for
  # its context built later (`make_prefill(context_layers=...)`, `make_draft_context`); None
  # where the prefill built the context itself or none is wanted.
  context_hiddens: jax.Array | None = None


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
  # [N] int32 the loop's target forwards by verify length (`LoopState.forward_counts_N`).
  forward_counts: jax.Array | None = None
  # [7] float32 the priced controller's evidence after the loop (`LoopState.evidence_7`).
  evidence: jax.Array | None = None


def _nonfinite(logits: jax.Array) -> jax.Array:
  """[] bool: any NaN/inf among the logits a token is sampled from (e.g. float16 overflow):
  the loop stops there and the engine raises, instead of committing a meaningless id."""
  return ~jnp.all(jnp.isfinite(logits))


def make_prefill(graphdef, draft_graphdef=None, policy_graphdef=None,
                 form: SamplingForm = SamplingForm.ANY,
                 features: Sequence[str] = FEATURE_TYPES,
                 context_layers: Sequence[int] = ()) -> Callable:
  """prefill(state, draft_state, tokens_1P, n, cache, draft_cache, seed_key, sampling,
  policy_state=None) -> PrefillOut. `state`, `draft_state`: `LoopWeights` (the layers run
  unrolled on their per-layer weights) or bare states (scanned).

  `sampling`: a `sampling.SamplingParams` (or a temperature scalar), as in the loops, read in
  the program's sampling `form` (`sampling.in_form`; the request's, `sampling.form_of`).

  Runs the target over the padded prompt, samples the first token, and (with a drafter) writes
  the prompt's chosen-layer features into the drafter's context cache, all in one jit. Without
  `draft_graphdef`, `context_layers` (the drafter's `target_layer_ids`) makes it return those
  layers' outputs over the prompt instead (`PrefillOut.context_hiddens`), for the drafter's
  context built by `make_draft_context` once the request is known to draft: a request whose
  block size the policy picks here, and which may then decode plain (`Engine.stage`).

  `features`: the policy feature types the prefill returns (`PrefillOut.features`, those the
  models given can make; `policy_features.prefill_features`); the policy's own is computed
  whether or not it is among them. Only `draft_confidence` costs a drafter pass over its first
  block, run only where it is wanted.

  The policy features come from that same forward. With `policy_graphdef` (a
  `bp_jax.policy.mlp.BlockPolicy`; its parameters arrive as `policy_state`, an argument, so one
  compilation serves every policy of the same architecture), the policy's decision
  (`BlockPolicy.decide`) runs once on its feature and its class is returned: the host then runs
  that bucket's compiled loop.
  """
  if draft_graphdef is not None and context_layers:
    raise ValueError("context_layers: only for a prefill without the drafter (its context later)")

  def prefill(state, draft_state, tokens_1P, n, cache, draft_cache, seed_key, sampling,
              policy_state=None):
    # `LoopWeights` run the layers unrolled on the loops' own per-layer weights (no copy, and
    # the loop then finds them in cache); a bare state scans the stacked layers.
    model, layers = _merged(graphdef, state, scan_layers=not _sliced(state))
    drafter, draft_layers = (None, None) if draft_graphdef is None else _merged(
        draft_graphdef, draft_state, scan_layers=not _sliced(draft_state))
    layer_ids = tuple(context_layers) if drafter is None else drafter.cfg.target_layer_ids
    policy = None if policy_graphdef is None else nnx.merge(policy_graphdef, policy_state)
    wanted = set(features) | ({policy.arch.feature_type} if policy is not None else set())
    zero = jnp.zeros((1,), jnp.int32)
    out = model(tokens_1P, cache.with_lengths(zero), layer_ids, logits_at=(n - 1)[None],
                layers=layers)
    logits_1V = out.logits[:, 0]
    first = sample(logits_1V, in_form(as_sampling(sampling), form),
                   position_keys(seed_key, n[None]))[0]
    draft_logits = None
    if drafter is not None:
      draft_cache = prompt_context(drafter, draft_layers, out.layer_hiddens, draft_cache, n)
      if DRAFT_CONFIDENCE in wanted:
        # The drafter's first block from the prompt's context (the `draft_confidence` feature).
        b0 = drafter.cfg.block_size
        block_1b = jnp.full((1, b0), drafter.cfg.mask_token_id, jnp.int32).at[0, 0].set(first)
        h_1bD = drafter.draft(model.embed_tokens(block_1b), draft_cache, draft_layers)
        draft_logits = model.project_to_vocab(h_1bD[:, 1:])
    feats = prefill_features(logits_1V, out.final_hidden[:, 0],
                             out.layer_hiddens if layer_ids else None, n, draft_logits, wanted)
    probs = cls = None
    if policy is not None:
      scores_1C, cls_1 = policy.decide(feats[policy.arch.feature_type])
      probs, cls = scores_1C[0], cls_1[0]
    kept = out.layer_hiddens if drafter is None and layer_ids else None
    return PrefillOut(first, out.cache.with_lengths(n[None]), draft_cache, logits_1V,
                      out.final_hidden[:, 0], {k: v for k, v in feats.items() if k in features},
                      probs, cls, _nonfinite(logits_1V), kept)

  return prefill


def prompt_context(drafter, draft_layers, layer_hiddens_nBPD: jax.Array, draft_cache: KVCache,
                   n: jax.Array) -> KVCache:
  """The drafter's context cache over a prompt of `n` tokens (pointer n) from its chosen target
  layers' outputs over the padded prompt (padding entries written past the pointer, unread)."""
  zero = jnp.zeros((1,), jnp.int32)
  draft_cache = drafter.add_context(layer_hiddens_nBPD, draft_cache.with_lengths(zero),
                                    draft_layers)
  return draft_cache.with_lengths(n[None])


def make_draft_context(draft_graphdef) -> Callable:
  """draft_context(draft_state, layer_hiddens_nBPD, n, draft_cache) -> the drafter's context
  cache over the prompt: what a prefill with the drafter writes (`prompt_context`), from the
  hiddens a prefill without it kept (`make_prefill(context_layers=...)`)."""

  def draft_context(draft_state, layer_hiddens_nBPD, n, draft_cache):
    drafter, draft_layers = _merged(draft_graphdef, draft_state,
                                    scan_layers=not _sliced(draft_state))
    return prompt_context(drafter, draft_layers, layer_hiddens_nBPD, draft_cache, n)

  return draft_context


class LoopWeights(NamedTuple):
  """A model's parameters as the decode loops take them: its state (`nnx.split`; the stacked
  layers stay in it, unread by the loops) and its per-layer weights (`LayerStack.per_layer`),
  sliced once by the engine. Sliced inside a loop's jitted call, every call copied every
  layer's weights (the demo's target and drafter: 19 MB, ~1.3 ms per call on this CPU, as
  about half a cycle; a 4B model's ~7 GB on an accelerator). The engine makes them
  (`Engine._loop_weights`)."""
  state: Any
  layers: tuple[dict[str, jax.Array], ...] | None  # None: the loops scan the stacked layers


def _sliced(weights) -> bool:
  """Whether `weights` carry per-layer weights (`LoopWeights` with layers)."""
  return isinstance(weights, LoopWeights) and weights.layers is not None


def _merged(graphdef, weights, scan_layers: bool):
  """(the module, the `layers=` argument of its forwards inside a decode loop): None runs
  `lax.scan` over the stacked weights; otherwise per-layer weights, those of a `LoopWeights`,
  else sliced here from a bare state (callers outside the engine: one copy per call)."""
  module = nnx.merge(graphdef, weights.state if isinstance(weights, LoopWeights) else weights)
  if scan_layers:
    return module, None
  return module, list(weights.layers) if _sliced(weights) else module.layers.per_layer()


def loop_cache(cache: KVCache | None, scan_layers: bool) -> KVCache | None:
  """The cache form a loop carries: per-layer buffers when layers run unrolled. The engine makes
  its caches in this form; a stacked cache from a caller outside it is split here in each call,
  and the one-request loops stack it again on the way out (`_single`)."""
  return cache if cache is None or scan_layers else cache.per_layer()


def _loop_caches(s: LoopState, scan_layers: bool) -> LoopState:
  return s.replace(cache=loop_cache(s.cache, scan_layers),
                   draft_cache=loop_cache(s.draft_cache, scan_layers))


def _row_keys(seed_keys_B: jax.Array, pos_BT: jax.Array) -> jax.Array:
  """[B, T] typed keys: each request's own seed folded with absolute positions."""
  return jax.vmap(position_keys)(seed_keys_B, pos_BT)


def _forward(model, tokens_Bt: jax.Array, cache, ar_step_tokens: int, **kw):
  """The target's forward over each row's tokens at its cache pointer. A one-token forward with
  `ar_step_tokens` 2 runs over the token and a copy of it at the next position, and returns the
  first position's outputs alone: the copy's cache write lies past the row's position (the next
  forward overwrites it before any read; past the cache it is dropped), and no query attends to
  it (causal). For machines where a one-row matrix product costs more than a two-row one
  (`LoopOptions.ar_step_tokens`)."""
  if tokens_Bt.shape[1] != 1 or ar_step_tokens == 1:
    return model(tokens_Bt, cache, **kw)
  out = model(jnp.concatenate([tokens_Bt, tokens_Bt], axis=1), cache, **kw)
  return out._replace(logits=out.logits[:, :1], final_hidden=out.final_hidden[:, :1],
                      layer_hiddens=out.layer_hiddens[:, :, :1])


def _ar_draw(s: LoopState, out, form: SamplingForm) -> jax.Array:
  """[B, 1] the target's sample at pos + 1 from a one-token forward: what plain AR decoding
  commits there (each row's own settings, read in the loop's sampling `form`, and key; a
  greedy program derives no key)."""
  sp = in_form(s.sp_B, form)
  keys_B = None if is_greedy(sp) else _row_keys(s.seed_keys_B, (s.pos_B + 1)[:, None])[:, 0]
  return sample(out.logits[:, 0], sp, keys_B)[:, None]


def _checked(logits_BtV: jax.Array, a_B: jax.Array, active_B: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
  """The NaN check of a forward: (a_B with -1 where a row commits nothing, bad_B). A decoding row
  with NaN/inf logits at a position a committed token is sampled from (positions past the
  accepted prefix are discarded, whatever they hold) commits nothing there and is `bad`; a row
  that is not decoding commits nothing."""
  offs = jnp.arange(logits_BtV.shape[1], dtype=jnp.int32)
  finite_Bt = jnp.all(jnp.isfinite(logits_BtV), axis=-1)
  bad_B = active_B & jnp.any(~finite_Bt & (offs[None] <= a_B[:, None]), axis=-1)
  return jnp.where(bad_B | ~active_B, -1, a_B), bad_B


def _commit(s: LoopState, out, y_Bt: jax.Array, a_B: jax.Array, active_B: jax.Array,
            is_cycle: bool, verified: int, stop_ids) -> tuple[LoopState, jax.Array]:
  """(the state after a target forward that commits y[r, 0..a_r] for every decoding row r, a_B
  with -1 where a row committed nothing): NaN check, accept and roll back, record. `is_cycle`
  ([] or [B]) and `verified` ([]) are the forward's records (`state.ForwardRecords`), static
  or traced."""
  a_B, bad_B = _checked(out.logits, a_B, active_B)
  s = s.committed(y_Bt, a_B, active_B, bad_B, out.cache, stop_ids)
  return s.replace(records=s.records.recorded(active_B, a_B, is_cycle, verified),
                   forward_counts_N=s.forward_counts_N.at[verified].add(1)), a_B


def _forwards(s: LoopState) -> jax.Array:
  """[] int32 the batch's target forwards since its state was made (cycles and AR steps)."""
  return jnp.sum(s.forward_counts_N)


def _in_budget(s0: LoopState, sync_forwards) -> Callable:
  """s -> [] bool: whether a loop call that started at `s0` may run another target forward (at
  most `sync_forwards` in all when > 0; always when 0). `sync_forwards`: a Python int (the
  one-request loops' 0), or the batched loops' [] int32 argument, a value of the call: engines
  of other `BatchOptions.sync_cycles` run one program."""
  if isinstance(sync_forwards, int) and sync_forwards <= 0:
    return lambda s: jnp.bool_(True)
  start = _forwards(s0)
  return lambda s: (sync_forwards <= 0) | (_forwards(s) - start < sync_forwards)


def _run(cond_rows: Callable, body: Callable, s: LoopState, in_budget: Callable) -> LoopState:
  """Runs `body` (one or more target forwards) in one `while_loop` while some row decodes
  (`cond_rows`) and the call's forward budget (`_in_budget`) is not spent; the host then gets
  the state back to refill finished slots."""
  return jax.lax.while_loop(lambda s: cond_rows(s) & in_budget(s), body, s)


def make_insert() -> Callable:
  """insert(state, row, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids,
  sampling, row_stop_K, start_2[, forced_S]) -> state: a request prefilled into one-sequence
  caches (`make_prefill`) takes slot `row` of a batched `LoopState` with its own sampling
  settings (`sampling.SamplingParams` scalars), stop ids and start of the back-off (`start_2`,
  `LoopState.start_row`); compiled once per state shape, whatever the values; the state is
  donated."""

  def insert(s, row, cache, draft_cache, first_tok, n, max_new, seed_key, stop_ids, sampling,
             row_stop_K, start_2, *forced):
    s = s.start_row(row, first_tok, n, max_new, seed_key, stop_ids, sampling, row_stop_K,
                    *forced, start_2=start_2)
    s = s.replace(cache=s.cache.put_rows(cache, row))
    if draft_cache is not None:
      s = s.replace(draft_cache=s.draft_cache.put_rows(draft_cache, row))
    return s

  return insert


def make_batched_ar_loop(graphdef, opts: LoopOptions = LoopOptions()) -> Callable:
  """ar_loop(state, loop_state, stop_ids, sync_forwards=0) -> loop_state: plain AR decoding of
  every row of a `LoopState` (rows at their own positions), until no row decodes or, with
  `sync_forwards` > 0 (a [] int32 argument: the engine's `BatchOptions.sync_cycles`), after
  that many steps.

  `opts.window`: attention reads cache slots [0, window) only, and the loop returns to the host
  before a row's next step would reach past it (the host then picks a larger window,
  `programs.window_for`): a step reads the live part of the cache instead of all its slots.

  Each row samples with its own settings (`LoopState.sp_B`) and draws with its own seed key at
  its own positions, so a row's tokens are those it gets decoded alone. `opts.scan_layers`: run
  the target's layers with `lax.scan` (faster to compile for deep models) instead of unrolled
  with per-layer weights (faster per step; the default)."""
  window, pad = opts.window, opts.ar_step_tokens_in_effect()

  def ar_loop(state, s: LoopState, stop_ids, sync_forwards=0) -> LoopState:
    model, layers = _merged(graphdef, state, opts.scan_layers)

    def body(s):
      active_B = s.active_B()
      out = _forward(model, s.tok_B[:, None], s.cache.with_lengths(s.pointer_B(active_B)), pad,
                     layers=layers, window=window)
      # Plain AR decoding is speculative decoding with block size 1: each step is a cycle that
      # drafts nothing and commits one token (τ = 1).
      return _commit(s, out, _ar_draw(s, out, opts.sampling_form), jnp.zeros_like(s.pos_B),
                     active_B, True, 0, stop_ids)[0]

    s = _loop_caches(s, opts.scan_layers)
    return _run(lambda s: s.decodes() & s.fits(1, window), body, s,
                _in_budget(s, sync_forwards))

  return ar_loop


def _forced(s: LoopState, drafted_Bk: jax.Array) -> jax.Array:
  """The tests' perfect drafter: the forced token at each draft position where one is given
  (>= 0), else the drafter's own. The drafter's tokens stay live, so XLA cannot drop the
  drafter pass as dead code."""
  k = drafted_Bk.shape[1]
  forced_Bk = jax.vmap(lambda f, p: jax.lax.dynamic_slice_in_dim(f, p + 1, k))(s.forced_BS,
                                                                              s.pos_B)
  return jnp.where(forced_Bk >= 0, forced_Bk, drafted_Bk)


# Positions of drafter context one write adds after AR steps (`pending_BPX`): a run of 64 AR
# steps is added in 8 writes instead of 64, and the room a row keeps for its pending positions
# is the cap rounded up to a multiple of it.
CONTEXT_CHUNK = 8


def make_batched_spec_loop(graphdef, draft_graphdef, opts: LoopOptions) -> Callable:
  """spec_loop(state, draft_state, loop_state, stop_ids, sync_forwards=0) -> loop_state:
  speculative decoding of every row of a `LoopState`, each at its own position, until no row
  decodes or, with `sync_forwards` > 0 (as in `make_batched_ar_loop`), after that many target
  forwards (cycles, and AR steps counted one each: a run of AR steps does not hold the host, a
  stream or a cancel for its length).

  One cycle (b = `opts.block_size`): the drafter proposes b-1 tokens after each row's `tok` in
  one pass, the target verifies the rows' tokens [tok, d_1..d_k] in one forward (k = b-1, or
  the controller's choice), the verify rule (`verify.RULES[opts.verify]`, applied per row with
  the row's seed key) decides y_0..y_a (a drafts accepted; `exact`: the drafter's argmax, kept
  while it equals the target's own sample at its position; `rejection`: drafts drawn from the
  drafter's distribution, speculative rejection sampling at T > 0), commits them, and both
  caches roll back by pointer to p + a + 1, row by row. The target features of block positions
  0..a become drafter context. Each row samples with its own settings (`LoopState.sp_B`).

  The controller (`controllers.controller_of(opts)`, the loop form in effect:
  `LoopOptions.in_effect`): `none` verifies every draft; `backoff` (`opts.ar_fallback` > 0):
  after a cycle that accepts at most `ar_fallback_accept` drafts, a row asks for plain AR steps
  instead of cycles, 2, 4, 8, ... in a row for consecutive poor cycles (at most `ar_fallback`),
  then drafts again. The batch takes AR steps while every decoding row asks for them (a row
  alone: exactly its own schedule). A loop iteration runs the AR steps the rows ask for, then
  cycles until a cycle's misses ask for AR steps (while the rows decode and a cycle fits), so a
  row that starts with AR steps (`LoopState.start_row`'s `start_2`, the engine's
  `start_backoff`) takes them before its first cycle, and a run of cycles evaluates one loop
  predicate per cycle besides its buckets' (on a GPU each is a wait of the host for the
  device). An AR step is one target forward over `tok` whose chosen-layer features still
  become drafter context, so the next cycle drafts from the full context: they wait in
  `LoopState.pending_BPX` and the run's end adds them, CONTEXT_CHUNK positions per drafter
  context write (one write per AR step cost ~8% of the step on the demo). Every token is still
  the target's own sample at its position (same keys), so the output is unchanged; only the
  time differs. `records.is_cycle_BS` tells
  cycles from AR steps (τ counts cycles only); `records.verified_BS` holds k + 1 for a forward
  verifying k drafts after a drafter pass, 0 for one without (the AR steps). `confidence`
  verifies k of the b-1 drafts, k from `controller.verify_buckets(b)` chosen per cycle (one k
  for the batch) by
  `controller.choose` with the cost table; a cycle whose best rate is below the AR rate is a
  miss (with `controller_poor_miss`, also one that verified more than `ar_fallback_accept`
  drafts and accepted at most that many), and after it the rows take AR steps as `backoff`
  does, at most `ar_fallback` (16 when 0). `priced` with `controller_decline` verifies k = 0
  (declines the drafts, a miss) or k = b-1 per cycle (`decline`), and learns the drafter's
  acceptance per expected draft from its full cycles (`LoopState.evidence_7`); a declined
  cycle's forward over `tok` alone is the rows' next AR step (`declined`), recorded as the
  cycle's; with `controller_persist` a miss takes its AR steps only while misses persist
  (`evidence.backs_off`). "fixed:k" (tests) verifies k drafts every cycle through the same
  machinery. Each bucket is its own verify shape [B, k+1] run as a nested `while_loop` of zero
  or one trips (a `lax.switch` among them would copy every cache buffer; the decline's one
  branch, whose other side passes the state through, is a `lax.cond`); a cycle verifying k = 0
  drafts still counts as a cycle (its drafter pass was paid).

  `opts.forced_drafts` (tests and benchmarks; `exact` only): the state has `forced_BS`, and
  each row drafts the tokens stored there at its positions (where >= 0; elsewhere the
  drafter's own) instead of the drafter's (`_forced`): a perfect drafter that still pays the
  drafter's full compute. It is a separately compiled variant, so production loops carry no
  trace of it. `opts.scan_layers`, `opts.window`: as in `make_batched_ar_loop`, for the target
  and the drafter (a cycle needs b slots of room, an AR step one).
  """
  opts = opts.in_effect()
  b, window, pad, form = opts.block_size, opts.window, opts.ar_step_tokens, opts.sampling_form
  rule, ctl = verify_rules.RULES[opts.verify], controllers.controller_of(opts)
  # Room for the AR steps a row may take between two drafter passes (at most the cap).
  pending_len = -(-ctl.cap // CONTEXT_CHUNK) * CONTEXT_CHUNK

  def spec_loop(state, draft_state, s: LoopState, stop_ids, sync_forwards=0) -> LoopState:
    model, layers = _merged(graphdef, state, opts.scan_layers)
    drafter, draft_layers = _merged(draft_graphdef, draft_state, opts.scan_layers)
    layer_ids, mask_id = drafter.cfg.target_layer_ids, drafter.cfg.mask_token_id
    in_budget = _in_budget(s, sync_forwards)  # the call's target forwards

    # ---- the cycle: draft -> verify -> accept, roll back, record -> back off ----------------
    def draft(s):
      """(each row's b-1 drafts after `tok` [B, b-1], the drafter's logits [B, b-1, V], their
      processed form where the rule reads it, else None): one drafter pass over [tok, MASK,
      ..., MASK]."""
      block_Bb = jnp.full((s.tok_B.shape[0], b), mask_id, jnp.int32).at[:, 0].set(s.tok_B)
      context = s.draft_cache.with_lengths(s.pointer_B(s.active_B()))
      h_BbD = drafter.draft(model.embed_tokens(block_Bb), context, draft_layers, window)
      logits_BkV = model.project_to_vocab(h_BbD[:, 1:])
      drafted_Bk, q_BkV = rule.propose(logits_BkV, in_form(s.sp_B, form), s.seed_keys_B,
                                       s.pos_B)
      if opts.forced_drafts:
        drafted_Bk = _forced(s, drafted_Bk)
      return drafted_Bk.astype(jnp.int32), logits_BkV, q_BkV

    def forward(s, tokens_Bt):
      """(the target's output over each decoding row's tokens at pos.., active_B, the cache
      pointers it wrote at); rows not decoding write nothing."""
      active_B = s.active_B()
      pointer_B = s.pointer_B(active_B)
      out = _forward(model, tokens_Bt, s.cache.with_lengths(pointer_B), pad,
                     hidden_layers=layer_ids, layers=layers, window=window)
      return out, active_B, pointer_B

    def commit(s, out, y_Bt, a_B, active_B, pointer_B, is_cycle: bool, verified: int):
      """`_commit`, and the forward's features become drafter context up to the new position."""
      new, a_B = _commit(s, out, y_Bt, a_B, active_B, is_cycle, verified, stop_ids)
      context = drafter.add_context(out.layer_hiddens, s.draft_cache.with_lengths(pointer_B),
                                    draft_layers)
      return new.replace(draft_cache=context.with_lengths(new.pos_B)), a_B

    def verify_k(s, k: int, draft_Bk, q_BkV, draft_next, expected_B):
      """The state after the target verifies each row's first k drafts ([B, k+1] tokens, one
      forward) and commits what the rule keeps; the controller learns from it (`observed`); a
      miss asks for AR steps."""
      out, active_B, pointer_B = forward(
          s, jnp.concatenate([s.tok_B[:, None], draft_Bk[:, :k]], axis=1))
      if k == 0:  # the AR step's own draw at pos + 1 under either verify rule
        y_Bt, a_B = _ar_draw(s, out, form), jnp.zeros_like(s.pos_B)
      else:
        y_Bt, a_B = rule.verify(out.logits, None if q_BkV is None else q_BkV[:, :k],
                                draft_Bk[:, :k], in_form(s.sp_B, form), s.seed_keys_B, s.pos_B)
      new, a_B = commit(s, out, y_Bt, a_B, active_B, pointer_B, True, k + 1)
      return learned(new, k, a_B, active_B, draft_next, expected_B)

    def learned(s, k: int, a_B, active_B, draft_next, expected_B):
      """The state after a cycle that verified k drafts and committed a_B + 1 tokens per row
      (-1: none) of the rows `active_B`: the controller learns from it (`observed`), and a miss
      asks for AR steps (`backed_off`)."""
      s = ctl.observed(s, k, a_B, expected_B)
      if not ctl.cap:
        return s
      return s.backed_off(ctl.miss_B(k, a_B, draft_next, s.break_even_N), active_B, ctl.cap,
                          ctl.shared_backoff, waits=ctl.backs_off(s))

    def declined(s, declines, draft_next, expected_B):
      """The state after a cycle that declines its drafts (`declines` [] bool; unchanged
      where not): a miss, whose rows' next AR step is the cycle's forward over `tok` alone
      (one AR step more than the miss asks for; `declined_B` records it as this cycle's, one
      verifying no draft). A verify of one token beside the full one would be a third target
      forward in the program and a second nested loop in every cycle."""
      active_B = s.active_B()
      # The forward will commit the target's own token (a = 0) for every decoding row.
      new = learned(s, 0, jnp.where(active_B, 0, -1), active_B, draft_next, expected_B)
      pick = lambda x, y: jnp.where(declines, x, y)
      return s.replace(  # a controller that declines keeps evidence: `evidence_7` is set
          misses_B=pick(new.misses_B, s.misses_B),
          wait_B=pick(jnp.where(active_B, new.wait_B + 1, new.wait_B), s.wait_B),
          declined_B=pick(active_B, s.declined_B), evidence_7=pick(new.evidence_7, s.evidence_7))

    def cycle(s):
      """Draft, let the controller pick k, verify k: with several buckets, one nested loop of
      zero or one trips per bucket (exactly one runs); a controller that declines (its bucket
      0) runs the full verify in the one branch where it does not (`declined`)."""
      draft_Bk, draft_logits_BkV, q_BkV = draft(s)
      expected_B = ctl.expected(draft_logits_BkV, draft_Bk)
      idx, draft_next = ctl.choose(draft_logits_BkV, draft_Bk, s, expected_B)
      verify = lambda s, k: verify_k(s, k, draft_Bk, q_BkV, draft_next, expected_B)
      if len(ctl.buckets) == 1:
        return verify(s, ctl.buckets[0])
      if ctl.declines:  # bucket 0 verifies nothing; the full verify where not declined
        (k,) = ctl.buckets[1:]
        s = declined(s, idx == 0, draft_next, expected_B)
        # One branch index copied to the host per cycle on a GPU, where a loop of zero or one
        # trips evaluated its predicate twice; the branch that verifies nothing passes the
        # state through, so XLA updates the caches in place (tests/test_batched_decode.py; the
        # waits are counted in tests/test_loop_predicates.py).
        return jax.lax.cond(idx == 1, lambda t: verify(t, k), lambda t: t, s)
      # Several verifying buckets: a `lax.switch` among them would copy every cache buffer.
      for i, k in enumerate(ctl.buckets):
        run = lambda t, k=k: (jnp.bool_(False), verify(t[1], k))
        s = jax.lax.while_loop(lambda t: t[0], run, (idx == i, s))[1]
      return s
    # ------------------------------------------------------------------------------------------

    def ar_step(s):
      """A fallback AR step: the target over `tok` alone, no drafter pass (or the forward of a
      cycle that declined its drafts, `declined`, recorded as that cycle's); its drafter inputs
      wait in `pending_BPX` (`flush_context` adds them when the run of AR steps ends)."""
      out, active_B, _ = forward(s, s.tok_B[:, None])
      cycle_B = s.declined_B & active_B
      new, _ = _commit(s, out, _ar_draw(s, out, form), jnp.zeros_like(s.pos_B), active_B,
                       cycle_B, jnp.any(cycle_B).astype(jnp.int32), stop_ids)
      new = new.replace(declined_B=jnp.zeros_like(s.declined_B))
      rows_B = jnp.arange(s.pos_B.shape[0])
      at_B = jnp.where(active_B, s.pos_B - s.draft_cache.lengths, pending_len)
      pending = s.pending_BPX.at[rows_B, at_B].set(
          drafter.context_inputs(out.layer_hiddens)[:, 0], mode="drop")
      return new.replace(pending_BPX=pending, wait_B=jnp.where(active_B, s.wait_B - 1, s.wait_B))

    def flush_context(s):
      """The state with each decoding row's pending drafter inputs added to its context (slots
      `draft_cache.lengths` .. pos - 1), CONTEXT_CHUNK positions per drafter context write, as
      many writes as the row with the most needs (none after a cycle)."""
      active_B, base_B = s.active_B(), s.draft_cache.lengths
      left_B = jnp.where(active_B, s.pos_B - base_B, 0)
      nowhere = s.seq_BS.shape[1]  # a row with nothing left writes past the cache: dropped

      def add(j_cache):
        j, cache = j_cache
        x_BCX = jax.lax.dynamic_slice_in_dim(s.pending_BPX, j * CONTEXT_CHUNK, CONTEXT_CHUNK, 1)
        at_B = jnp.where(left_B > j * CONTEXT_CHUNK, base_B + j * CONTEXT_CHUNK, nowhere)
        return j + 1, drafter.add_context_inputs(x_BCX, cache.with_lengths(at_B), draft_layers)

      _, cache = jax.lax.while_loop(lambda jc: jnp.any(left_B > jc[0] * CONTEXT_CHUNK), add,
                                    (jnp.int32(0), s.draft_cache))
      return s.replace(draft_cache=cache.with_lengths(jnp.where(active_B, s.pos_B, base_B)))

    def wants_ar(s):
      active_B = s.active_B()
      return (jnp.any(active_B) & jnp.all(~active_B | (s.wait_B > 0)) & s.fits(1, window)
              & in_budget(s))

    def ar_run(s):
      """The AR steps the rows ask for (after a miss, or from the start:
      `LoopState.start_row`), then their drafter inputs added to the context (`flush_context`),
      so that every drafter pass finds its context whole: the steps' own loop behind one
      branch whose other side passes the state through (XLA then updates the caches in place,
      tests/test_batched_decode.py; on a GPU one branch index copied to the host where a loop of
      zero or one trips around the run evaluated its predicate twice). The run's first step is
      not peeled out of its loop: that would save one predicate per run of AR steps and put a
      second copy of the target's forward in the program (846 of the default's 3,687 lowered
      operations at the test shapes)."""
      steps = lambda s: flush_context(jax.lax.while_loop(wants_ar, ar_step, s))
      return jax.lax.cond(wants_ar(s), steps, lambda t: t, s)

    runs = lambda s: s.decodes() & s.fits(b, window)

    def body(s):
      if not ctl.cap:
        return cycle(s)
      # The AR steps the rows ask for, then cycles until one's misses ask for AR steps: a run
      # of cycles evaluates one loop predicate per cycle, as the paper's loop does (on a GPU
      # each evaluated predicate of a data-dependent loop is a wait of the host for the device).
      return jax.lax.while_loop(lambda s: runs(s) & in_budget(s) & ~wants_ar(s), cycle,
                                ar_run(s))

    s = _loop_caches(s, opts.scan_layers)
    # A state without the decline's state (a caller outside the engine): nothing seen, and
    # nothing kept after the call.
    keep_evidence = s.evidence_7 is not None
    if ctl.stateful and not keep_evidence:
      s = s.replace(evidence_7=jnp.asarray(evidence.empty_state()))
    if ctl.cap:
      width = len(layer_ids) * drafter.cfg.layers.hidden_size
      s = s.replace(pending_BPX=jnp.zeros((s.pos_B.shape[0], pending_len, width),
                                          drafter.dtype))
    s = _run(runs, body, s, in_budget)
    if ctl.cap:
      s = s.replace(pending_BPX=None)
    return s if keep_evidence else s.replace(evidence_7=None)

  return spec_loop


def _single(s: LoopState, stacked: bool) -> LoopOut:
  """The LoopOut of a one-row state, its caches in the form the call got them (`stacked`: the
  stacked form, e.g. a caller outside the engine; the engine keeps its caches per layer, so
  that no call copies them into another form and back)."""
  r = s.records
  form = (lambda c: c if c is None else c.stacked()) if stacked else (lambda c: c)
  return LoopOut(s.seq_BS, s.n_gen_B[0], r.accept_BS[0], r.is_cycle_BS[0], r.verified_BS[0],
                 r.forwards_B[0], s.bad_B[0], form(s.cache), form(s.draft_cache),
                 s.forward_counts_N, s.evidence_7)


def _one_row(seq_1S, cache, draft_cache, first_tok, n, max_new, sampling, seed_key, stop_ids,
             forced_1S=None, max_verify: int = 1, break_even_N=None,
             start_2=None, evidence_7=None) -> LoopState:
  s = LoopState.empty(seq_1S, cache, draft_cache, forced_1S, max_verify, break_even_N,
                      evidence_7)
  return s.start_row(0, first_tok, n, max_new, seed_key, stop_ids, sampling,
                     forced_S=None if forced_1S is None else forced_1S[0], start_2=start_2)


def make_ar_loop(graphdef, opts: LoopOptions = LoopOptions()) -> Callable:
  """ar_loop(state, seq, cache, first_tok, n, max_new, sampling, seed_key, stop_ids) -> LoopOut:
  one request, `make_batched_ar_loop` on a one-row state. `sampling`: a
  `sampling.SamplingParams` (or a temperature scalar). `opts.window`: attend over cache slots
  [0, window) only; the request must fit in it (the loop stops at its end)."""
  batched = make_batched_ar_loop(graphdef, opts)

  def ar_loop(state, seq_1S, cache, first_tok, n, max_new, sampling, seed_key, stop_ids):
    s = _one_row(seq_1S, cache, None, first_tok, n, max_new, sampling, seed_key, stop_ids)
    return _single(batched(state, s, stop_ids), stacked=not cache.is_per_layer)

  return ar_loop


def make_spec_loop(graphdef, draft_graphdef, opts: LoopOptions) -> Callable:
  """spec_loop(state, draft_state, seq, cache, draft_cache, first_tok, n, max_new, sampling,
  seed_key, stop_ids[, forced_seq[, break_even_N[, start_2[, evidence_7]]]]) -> LoopOut: one
  request, `make_batched_spec_loop` (see it for the cycle, the controllers, forced drafts and
  the window) on a one-row state; `forced_seq` [1, S] (None: the drafter's drafts);
  `break_even_N` [N >= block_size + 1] the priced controller's runtime break-even
  (`LoopState.break_even_N`; None: the start-up costs); `start_2` [2] int32 the misses and
  AR steps the request starts with (`LoopState.start_row`; None: none); `evidence_7` [7] the
  priced controller's evidence so far (`LoopState.evidence_7`; None: a loop whose controller
  keeps none), returned as `LoopOut.evidence`."""
  batched = make_batched_spec_loop(graphdef, draft_graphdef, opts)

  def spec_loop(state, draft_state, seq_1S, cache, draft_cache, first_tok, n, max_new,
                sampling, seed_key, stop_ids, forced_1S=None, break_even_N=None, start_2=None,
                evidence_7=None):
    s = _one_row(seq_1S, cache, draft_cache, first_tok, n, max_new, sampling, seed_key,
                 stop_ids, forced_1S, opts.block_size, break_even_N, start_2, evidence_7)
    return _single(batched(state, draft_state, s, stop_ids), stacked=not cache.is_per_layer)

  return spec_loop
