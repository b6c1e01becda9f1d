"""The state a decode loop carries: every row of a batch at its own position (B rows, S = the
cache length), as one pytree (`LoopState`), updated with `.replace(...)`.

Conventions: `seq_BS` holds each row's tokens at their absolute positions; `pos_B` is the
position of the newest token `tok_B`, which the target has not seen yet, so the target cache
pointer equals `pos_B`; `n_gen_B` counts generated tokens (including `tok_B`). A slot whose
`max_new_B` is 0 is empty.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from bp_jax.decoding.controller import backoff_steps
from bp_jax.decoding.sampling import SamplingParams, as_sampling, row_params, set_row
from bp_jax.models.kv_cache import KVCache

# Stop token ids a request may add to the engine's own (per row, -1 padded): a fixed width, so
# one compiled loop serves every request.
MAX_ROW_STOP_IDS = 8


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


@flax.struct.dataclass
class ForwardRecords:
  """Per row, what each of its target forwards did; entry j is the row's forward j (the first
  `forwards_B` entries are valid)."""
  accept_BS: jax.Array    # [B, S] int32 tokens the forward committed (accepted drafts + 1)
  is_cycle_BS: jax.Array  # [B, S] bool: a speculative cycle (False: a fallback AR step)
  # [B, S] int32: k + 1 for a forward over k + 1 tokens after a drafter pass (a cycle verifying
  # k drafts), 0 for a forward without a drafter pass (AR loop, AR steps).
  verified_BS: jax.Array
  forwards_B: jax.Array   # [B] int32 target forwards that committed tokens

  @classmethod
  def empty(cls, B: int, S: int) -> "ForwardRecords":
    return cls(accept_BS=jnp.zeros((B, S), jnp.int32), is_cycle_BS=jnp.zeros((B, S), jnp.bool_),
               verified_BS=jnp.zeros((B, S), jnp.int32), forwards_B=jnp.zeros((B,), jnp.int32))

  def cleared(self, row) -> "ForwardRecords":
    """These records with row `row` holding no forward."""
    return jax.tree.map(lambda x: x.at[row].set(jnp.zeros_like(x[row])), self)

  def recorded(self, active_B: jax.Array, a_B: jax.Array, is_cycle: bool,
               verified: int) -> "ForwardRecords":
    """These records after a forward that committed a_B + 1 tokens per decoding row (a_B = -1:
    none, the row is not counted)."""
    rows = jnp.arange(a_B.shape[0])
    at_B = jnp.where(active_B, self.forwards_B, self.accept_BS.shape[1])  # past S: dropped
    put = lambda buf, v: buf.at[rows, at_B].set(v, mode="drop")
    return ForwardRecords(accept_BS=put(self.accept_BS, a_B + 1),
                          is_cycle_BS=put(self.is_cycle_BS, is_cycle),
                          verified_BS=put(self.verified_BS, verified),
                          forwards_B=self.forwards_B + (a_B >= 0).astype(jnp.int32))


@flax.struct.dataclass
class LoopState:
  """The carry of the decode loops (`loops`), one row per request slot."""
  seq_BS: jax.Array          # [B, S] int32 tokens at absolute positions
  cache: KVCache             # target cache (pointer = pos_B while a loop runs)
  pos_B: jax.Array           # [B] int32 position of tok_B
  tok_B: jax.Array           # [B] int32 the newest token, not yet seen by the target
  n_gen_B: jax.Array         # [B] int32 generated tokens, tok_B included (may pass max_new_B)
  max_new_B: jax.Array       # [B] int32 the row's max_new_tokens (0: an empty slot)
  done_B: jax.Array          # [B] bool: stopped (a stop token, or NaN/inf logits)
  bad_B: jax.Array           # [B] bool: a forward produced NaN/inf logits (the row stopped)
  records: ForwardRecords    # per forward: committed tokens, cycle or AR step, drafts verified
  misses_B: jax.Array        # [B] int32 consecutive poor / declined cycles (the back-off)
  wait_B: jax.Array          # [B] int32 AR steps the row still asks for before drafting again
  # [B] bool: the row's last cycle declined its drafts (`priced`'s decline): its next AR step is
  # that cycle's forward, recorded as a cycle that verified no draft (`loops`).
  declined_B: jax.Array
  # [B] bool: the row's last cycle that verified all its drafts committed fewer tokens than the
  # cycle's price (`evidence.row_missed`): the priced back-off gate counts the row's next full
  # cycle as one after a miss.
  missed_B: jax.Array
  seed_keys_B: jax.Array     # [B] typed PRNG keys: each request's own seed
  sp_B: SamplingParams       # [B] each row's sampling settings (temperature, top-k/p, min-p)
  stop_BK: jax.Array         # [B, K] int32 each row's own stop ids besides the engine's (-1)
  # [N] int32, N = the largest block size + 1: the batch's target forwards since the state was
  # made, by verify length n as `records.verified_BS` reads it (0: AR steps, n: cycles verifying
  # n - 1 drafts); the host diffs it around a timed loop call (`online_costs`). One width for
  # every block size of an engine, so that one slot insertion serves all their states.
  forward_counts_N: jax.Array
  # [] int32: a batched loop call returns as soon as fewer rows than this decode (0: it runs
  # its cycles); the scheduler sets it to the rows decoding when requests wait for a slot, so
  # a slot freed mid-call is refilled after the cycle that freed it, not `sync_cycles` later.
  min_active: jax.Array
  draft_cache: KVCache | None = None  # the drafter's context cache (speculative loops only)
  forced_BS: jax.Array | None = None  # [B, S] int32 the tests' forced drafts (-1: the drafter's)
  # [N] float32 the priced controller's break-even per verify length n: a cycle verifying n
  # tokens costs break_even_N[n] AR steps (a runtime value the host may replace between loop
  # calls, `online_costs`; None: the start-up costs, compile-time constants).
  break_even_N: jax.Array | None = None
  # [7] float32 what the priced controller has seen of the drafts (`evidence`): its decline's
  # evidence (decayed row-cycles, expected and accepted drafts of the recent cycles that
  # verified all their drafts) and its back-off gate's (row-cycles and tokens after misses and
  # overall). A runtime value the engine carries across calls and requests (None: a loop whose
  # controller keeps none).
  evidence_7: jax.Array | None = None
  # [B, P, X] the drafter inputs (`DFlashDrafter.context_inputs`) of the AR steps a row took
  # since its drafter context was last written, entry i at position `draft_cache.lengths + i`:
  # a speculative loop adds them to the context before its next drafter pass, P at most at a
  # time in chunks, instead of one drafter context write per AR step (`loops`). Only inside a
  # speculative loop call (None outside: nothing pending when a call returns).
  pending_BPX: jax.Array | None = None

  @classmethod
  def empty(cls, seq_BS: jax.Array, cache: KVCache, draft_cache: KVCache | None = None,
            forced_BS: jax.Array | None = None, max_verify: int = 1,
            break_even_N: jax.Array | None = None,
            evidence_7: jax.Array | None = None) -> "LoopState":
    """Every slot empty (max_new = 0), around the given buffers; forward counts for verify
    lengths up to `max_verify` (the largest block size)."""
    B, S = seq_BS.shape
    zeros = lambda: jnp.zeros((B,), jnp.int32)  # one buffer per field: the state is donated
    return cls(seq_BS=seq_BS, cache=cache, pos_B=zeros(), tok_B=zeros(), n_gen_B=zeros() + 1,
               max_new_B=zeros(), done_B=jnp.zeros((B,), jnp.bool_),
               bad_B=jnp.zeros((B,), jnp.bool_), records=ForwardRecords.empty(B, S),
               misses_B=zeros(), wait_B=zeros(), declined_B=jnp.zeros((B,), jnp.bool_),
               missed_B=jnp.zeros((B,), jnp.bool_),
               seed_keys_B=jax.random.split(jax.random.key(0), B), sp_B=row_params(B),
               stop_BK=jnp.full((B, MAX_ROW_STOP_IDS), -1, jnp.int32),
               forward_counts_N=jnp.zeros((max_verify + 1,), jnp.int32),
               min_active=jnp.zeros((), jnp.int32), draft_cache=draft_cache,
               forced_BS=forced_BS,
               break_even_N=(None if break_even_N is None
                             else jnp.asarray(break_even_N, jnp.float32)),
               evidence_7=(None if evidence_7 is None
                           else jnp.asarray(evidence_7, jnp.float32)))

  def start_row(self, row, first_tok, n, max_new, seed_key, stop_ids, sampling=None,
                row_stop_K: jax.Array | None = None,
                forced_S: jax.Array | None = None,
                start_2: jax.Array | None = None) -> "LoopState":
    """Slot `row` starting a request whose prompt (n tokens) and first generated token are in
    place: the caches' rows are the caller's to fill (`KVCache.put_rows`). `sampling`: the
    request's settings (SamplingParams scalars or a temperature; None: greedy); `row_stop_K`:
    its own stop ids besides `stop_ids` ([MAX_ROW_STOP_IDS], -1 padded; None: none);
    `start_2`: [2] int32 the consecutive misses and the AR steps the row starts with (a
    speculative loop takes those steps before its first cycle; None: 0, 0: it drafts first)."""
    start_2 = jnp.zeros((2,), jnp.int32) if start_2 is None else jnp.asarray(start_2, jnp.int32)
    sp = as_sampling(0.0 if sampling is None else sampling)
    row_stop = (jnp.full((MAX_ROW_STOP_IDS,), -1, jnp.int32) if row_stop_K is None
                else jnp.asarray(row_stop_K, jnp.int32))
    new = self.replace(
        seq_BS=self.seq_BS.at[row, n].set(first_tok, mode="drop"),
        pos_B=self.pos_B.at[row].set(n), tok_B=self.tok_B.at[row].set(first_tok),
        n_gen_B=self.n_gen_B.at[row].set(1), max_new_B=self.max_new_B.at[row].set(max_new),
        done_B=self.done_B.at[row].set(is_stop(first_tok, stop_ids)
                                       | is_stop(first_tok, row_stop)),
        bad_B=self.bad_B.at[row].set(False), records=self.records.cleared(row),
        misses_B=self.misses_B.at[row].set(start_2[0]),
        wait_B=self.wait_B.at[row].set(start_2[1]),
        declined_B=self.declined_B.at[row].set(False), missed_B=self.missed_B.at[row].set(False),
        seed_keys_B=self.seed_keys_B.at[row].set(seed_key), sp_B=set_row(self.sp_B, row, sp),
        stop_BK=self.stop_BK.at[row].set(row_stop))
    if forced_S is not None:
      new = new.replace(forced_BS=self.forced_BS.at[row].set(forced_S))
    return new

  def map_rows(self, fn) -> "LoopState":
    """`fn` applied to every per-row buffer (all but the caches): e.g. placing rows on a mesh."""
    caches = (self.cache, self.draft_cache)
    out = jax.tree.map(fn, self.replace(cache=None, draft_cache=None))
    return out.replace(cache=caches[0], draft_cache=caches[1])

  def take_rows(self, rows_R: jax.Array, keep_R: jax.Array) -> "LoopState":
    """A state of R rows: row i is a copy of this state's row `rows_R[i]` (tokens, caches,
    records, sampling settings, seed key, back-off) where `keep_R[i]`, an empty slot
    (max_new 0) where not. The batch-wide fields (forward counts, `min_active`, break-even,
    the priced controller's evidence) stay as they are. How the scheduler shrinks a bucket's
    state to the requests it still decodes, or grows it back (`Scheduler`)."""
    shared = dict(cache=None, draft_cache=None, forward_counts_N=None, min_active=None,
                  break_even_N=None, evidence_7=None, pending_BPX=None)
    out = jax.tree.map(lambda x: x[rows_R], self.replace(**shared))
    return out.replace(
        max_new_B=jnp.where(keep_R, out.max_new_B, 0), cache=self.cache.take_rows(rows_R),
        draft_cache=None if self.draft_cache is None else self.draft_cache.take_rows(rows_R),
        forward_counts_N=self.forward_counts_N, min_active=self.min_active,
        break_even_N=self.break_even_N, evidence_7=self.evidence_7)

  def with_row_from(self, row, src: "LoopState", src_row) -> "LoopState":
    """This state with slot `row` holding a copy of `src`'s row `src_row` (tokens, position,
    target cache, records, sampling settings, seed key, stop ids), its back-off cleared: a
    request moving between buckets mid-decode (`Scheduler`: where a batch's drafting keeps
    losing, its requests move to the plain AR bucket). This state keeps its batch-wide fields,
    its drafter cache and its forced drafts (rows of `src`'s are not copied)."""
    one = src.replace(draft_cache=None, forced_BS=None).take_rows(
        jnp.reshape(jnp.asarray(src_row, jnp.int32), (1,)), jnp.ones((1,), jnp.bool_))
    own = dict(cache=None, draft_cache=None, forced_BS=None, forward_counts_N=None,
               min_active=None, break_even_N=None, evidence_7=None, pending_BPX=None)
    out = jax.tree.map(lambda dst, x: dst.at[row].set(x[0]), self.replace(**own),
                       one.replace(**own))
    return out.replace(
        cache=self.cache.put_rows(one.cache, row), draft_cache=self.draft_cache,
        forced_BS=self.forced_BS, forward_counts_N=self.forward_counts_N,
        min_active=self.min_active, break_even_N=self.break_even_N,
        evidence_7=self.evidence_7, pending_BPX=self.pending_BPX,
        misses_B=out.misses_B.at[row].set(0), wait_B=out.wait_B.at[row].set(0),
        declined_B=out.declined_B.at[row].set(False), missed_B=out.missed_B.at[row].set(False))

  # -- read by the loops --------------------------------------------------------------------
  def active_B(self) -> jax.Array:
    """[B] bool: rows still decoding (not stopped, below their max_new_tokens)."""
    return (~self.done_B) & (self.n_gen_B < self.max_new_B)

  def backoff_level(self, active_B: jax.Array) -> jax.Array:
    """[] int32 the batch's back-off level: the deepest `misses_B` among the rows `active_B`
    marks (0 where none)."""
    return jnp.max(jnp.where(active_B, self.misses_B, 0))

  def decodes(self) -> jax.Array:
    """[] bool: some row decodes, and no fewer than `min_active` rows do."""
    n = jnp.sum(self.active_B(), dtype=jnp.int32)
    return (n > 0) & (n >= self.min_active)

  def pointer_B(self, active_B: jax.Array) -> jax.Array:
    """[B] the cache pointer a forward uses per row: its position, or the cache length for a
    row that is not decoding, so that every write of that row falls past the cache and is
    dropped (a finished row or an empty slot writes nothing while the others go on)."""
    return jnp.where(active_B, self.pos_B, self.seq_BS.shape[1])

  def fits(self, span: int, window: int | None) -> jax.Array:
    """[] bool: every decoding row's next forward of `span` tokens lies inside the attention
    window (always, without one)."""
    if window is None:
      return jnp.bool_(True)
    return jnp.all(~self.active_B() | (self.pos_B + span <= window))

  # -- written by the loops -----------------------------------------------------------------
  def committed(self, y_Bb: jax.Array, a_B: jax.Array, active_B: jax.Array, bad_B: jax.Array,
                cache: KVCache, stop_ids: jax.Array) -> "LoopState":
    """Accept and roll back: each decoding row commits y[r, 0..a_r] at positions pos+1.. (a_r =
    -1: nothing) and `cache` (the forward's, written at pos..) rolls back by pointer to the new
    position; a row whose committed tokens hold a stop id (the engine's or its own), or with
    `bad_B`, stops."""
    B, S = self.seq_BS.shape
    offs = jnp.arange(y_Bb.shape[1], dtype=jnp.int32)
    rows = jnp.arange(B)
    new_pos = self.pos_B + a_B + 1
    write_at = jnp.where(active_B[:, None], self.pos_B[:, None] + 1 + offs[None], S)
    stops = is_stop(y_Bb, stop_ids) | is_stop(y_Bb, self.stop_BK[:, None, :])
    stop_hit = jnp.any(stops & (offs[None] <= a_B[:, None]), axis=-1)
    return self.replace(
        seq_BS=self.seq_BS.at[rows[:, None], write_at].set(y_Bb, mode="drop"),
        cache=cache.with_lengths(new_pos), pos_B=new_pos,
        tok_B=jnp.where(a_B >= 0, y_Bb[rows, jnp.maximum(a_B, 0)], self.tok_B),
        n_gen_B=self.n_gen_B + a_B + 1, done_B=self.done_B | (active_B & (stop_hit | bad_B)),
        bad_B=self.bad_B | bad_B)

  def backed_off(self, miss_B: jax.Array, active_B: jax.Array, cap: int,
                 shared: bool = False, waits: jax.Array | bool = True) -> "LoopState":
    """Each decoding row's consecutive misses after this cycle and the AR steps it asks for:
    2, 4, 8, ... at most `cap` (`controller.backoff_steps`); a cycle that is no miss resets
    both. `shared` (a controller whose miss is the batch's, `priced`): a missing row takes the
    decoding rows' deepest back-off plus one, so that the batch backs off as one. Per row, a
    row that had just started drafting (every 4th request explores) asked for 2, 4, 8, ...
    steps while the others waited up to the cap, and the batch ran a cycle for all its rows
    each time that row asked: batch 8, T = 1, 528 row-cycles against 156 shared. `waits` ([]
    bool): whether the misses take their AR steps now (the priced back-off's gate,
    `evidence.persists`); a miss that does not still counts, so the next cycle is one after a
    miss."""
    level = self.backoff_level(active_B) if shared else self.misses_B
    misses_B = jnp.where(miss_B, level + 1, 0)
    wait_B = jnp.where(miss_B & waits, backoff_steps(misses_B, cap), 0)
    return self.replace(misses_B=jnp.where(active_B, misses_B, self.misses_B),
                        wait_B=jnp.where(active_B, wait_B, self.wait_B))
