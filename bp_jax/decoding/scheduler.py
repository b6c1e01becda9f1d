"""Continuous batching per block-size bucket: many requests through the batched loops.

Each block size in use (a bucket) has a batched loop state of `batch_size` slots
(`state.LoopState`), decoded by its compiled batched loop. The host:

1. prefills requests in arrival order, each into one-sequence staging caches (the prefill runs
   the block-size policy when the request's size is learned, so its bucket is known only then);
   a request whose bucket is known waits until that bucket has a free slot, and at most
   `batch_size` prefilled requests wait for a slot at any time (their staging caches are the
   memory this holds beyond the slots);
2. moves prefilled requests into free slots of their bucket (`loops.make_insert`: a slot-sized
   copy into the donated state), oldest first;
3. runs the bucket with the most requests in flight (ties: the smallest block size; a server
   runs its plain bucket first where the start rule routes new requests to draft,
   `_plain_drains`) for
   `sync_cycles` target forwards (cycles, and AR steps of the priced back-off; 0: until none of
   its rows decodes: static batching) in one call, or
   while requests wait for a slot only until one of its rows finishes (`LoopState.min_active`),
   attending over the smallest window of cache slots (`programs.window_buckets`) with room for
   its furthest row (the call returns early when a row would pass it);
4. reads back which rows finished (stop token or max_new_tokens), turns each into its
   `Generation` and frees its slot; then goes back to 1.

With the priced controller's plain starts (`LoopOptions.start_plain`), a request whose start
would be deep (recent requests' cycles committed fewer tokens than a cycle costs in steps of the
plain loop at this batch size, `Engine.request_start`) takes a slot of the plain AR bucket
(block size 1) instead of its own: its `Generation` keeps its block size and says
`plain_start`. Where drafting loses, a batch's requests then decode at the plain loop's speed,
not in the speculative loop's AR steps (which stage the drafter's context: ~1.2x the plain
loop's step on the demo's CPU); runs of explorers keep both sides measured
(`start_backoff.StartBackoff`). A speculative bucket's rows move to the plain bucket
mid-decode where their cycles keep missing or commit too few tokens for the start rule
(`_move_losing`); an explorer run's first call is short (`VERDICT_FORWARDS`), so where drafting
loses it pays a few cycles.

A bucket that no request waits for (a batch's tail) moves its requests into a state of fewer
slots before its call (`BatchOptions.shrink`: the fewest of `Engine.slot_sizes`, batch_size
halving to 1, that holds them; `LoopState.take_rows`, one copy of their caches), so its loop
computes the rows it has rather than all batch_size; it grows back to batch_size when requests
come for it. A step of a batched loop costs the same with idle slots: without this, the last 2
requests of a batch of 8 paid for 8 rows until they ended.

So a long request never holds a batch hostage: the others' slots are refilled around it after the
cycle that freed them (when requests wait; at most `sync_cycles` forwards otherwise). Every row
decodes at its own position with its own seed key and its own sampling settings and stop ids
(`LoopState.sp_B`, `stop_BK`: traced values, one compiled loop for every setting), so its
tokens are those it gets decoded alone.

A server drives the same scheduler one step at a time (`submit`, `step`, `cancel`): requests
arrive between steps (their times on the engine's clock estimate the arrival rate, which a
batch's tail weighs before it moves plain: a request arriving after the move would draft in
another bucket, the two running by turns), `step` reports each finished request, each failed
one (NaN/inf logits: that request alone fails) and, with `track_progress`, the tokens of every
request in the bucket that just ran; `cancel` frees a request's slot at once.

Time attribution (a request's `decode_s`): the wall time of each loop call (the engine's
`clock`) is split equally among the rows that were decoding when the call started, and that of
a resize or a move (`_Bucket.resize`, `_move_losing`, on the same clock) among the rows it
moved; `prefill_s`
is the request's own prefill plus its insertion into a slot. The same wall time, with the
forwards the call ran (`LoopState.forward_counts_N`), feeds the priced controller's online
costs (`Engine.loop_ran`), whose current break-even goes into the carry before each call.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding.generation import Generation, cycle_flags, generation_of, trim_at_stop
from bp_jax.decoding.sampling import form_of
from bp_jax.decoding.start_backoff import StartBackoff
from bp_jax.decoding.state import LoopState
from bp_jax.errors import BadInputError


# The forwards of an explorer run's first call (`Scheduler._verdict_budget`): cycles enough for
# its rows' own τ (at least `StartBackoff.min_cycles` of them over 2 rows and more) before
# they draft much further where drafting loses.
VERDICT_FORWARDS = 4

# The plain steps of a probe's call (`Scheduler._probe_plain`): what prices the plain loop's
# step where no request decodes plain, at a few steps' cost.
PROBE_STEPS = 4

# The latest submits whose times estimate the arrival rate (`Scheduler._arrival_rate`).
ARRIVAL_WINDOW = 16


@dataclasses.dataclass
class BatchRequest:
  """One request of `Engine.generate_batch`; `block_size` is a bucket or `engine.LEARNED`.
  `sampling`: its own (temperature, top_k, top_p, min_p) (None: the scheduler's shared
  settings); `stop_token_ids`: stop ids besides the engine's (at most
  `state.MAX_ROW_STOP_IDS`)."""
  index: int
  prompt_ids: Sequence[int]
  max_new_tokens: int
  seed: int
  block_size: int | str
  forced_continuation: Sequence[int] | None = None
  sampling: tuple | None = None
  stop_token_ids: Sequence[int] = ()


@dataclasses.dataclass
class StepReport:
  """What one `Scheduler.step` did: requests finished (index -> Generation), failed (index ->
  the error), and with `track_progress` the tokens so far (index -> new token ids, trimmed at
  the first stop token and max_new_tokens) of every request in the bucket that ran."""
  finished: dict[int, Generation] = dataclasses.field(default_factory=dict)
  failed: dict[int, Exception] = dataclasses.field(default_factory=dict)
  progress: dict[int, list[int]] = dataclasses.field(default_factory=dict)
  ran: int | None = None          # the block size whose loop ran (None: none)
  rows: int = 0                   # rows decoding in that call
  seconds: float = 0.0            # the loop call's wall time


@dataclasses.dataclass(frozen=True)
class _Route:
  """Where a request decodes: the bucket (its block size, or 1: a plain start,
  `Engine.starts_plain`), the (misses, AR steps) it starts with there and whether the start
  rule made it an explorer (its route is then never reconsidered, `Scheduler._reroute`)."""
  bucket: int
  start: tuple[int, int] = (0, 0)
  explorer: bool = False


@dataclasses.dataclass
class _Staged:
  """A prefilled request (its staging caches hold the prompt) waiting for a slot."""
  req: BatchRequest
  pre: Any                 # loops.PrefillOut
  block_size: int          # its block size (fixed or learned): what its Generation reports
  prefill_s: float
  probs: list[float] | None
  decode_s: float = 0.0
  route: _Route | None = None  # set once its block size is known (`Scheduler._route`)
  policy_block_size: int | None = None  # a learned size's pick (`Engine.decode_size`)
  moved_plain: bool = False  # moved to the plain bucket mid-decode (`Scheduler._move_losing`)
  calls: int = 0           # loop calls it decoded in


class _Bucket:
  """The slots of one block size: its batched loop state and which request each row holds."""

  def __init__(self, carry: LoopState, batch: int):
    self.carry = carry
    self.rows: list[_Staged | None] = [None] * batch
    # The carry's forward counts when last read (`LoopState.forward_counts_N`): a call's own
    # forwards are the difference.
    self.counted_N = np.zeros(carry.forward_counts_N.shape, np.int64)
    self.min_active = 0                          # the `min_active` last written into it
    # Per runtime field of the carry (`place`): the host value it holds, as last written or
    # read back.
    self.placed: dict[str, np.ndarray] = {}

  def place(self, field: str, value: np.ndarray | None) -> None:
    """The carry with the host's current `value` of a runtime field (`break_even_N`: the
    priced controller's break-even; `evidence_7`: the engine's priced evidence, which other
    buckets' calls and requests alone add to), placed as the carry's own when it changed: the
    next call compiles nothing new. Nothing where either has none."""
    if (value is None or getattr(self.carry, field) is None
        or np.array_equal(value, self.placed.get(field))):
      return
    self.carry = self.carry.replace(**{field: jax.device_put(
        value, getattr(self.carry, field).sharding)})
    self.placed[field] = value

  def refill_on_finish(self, rows: int) -> None:
    """The carry's `min_active` (the next call returns once fewer than `rows` rows decode; 0:
    it runs its cycles), placed only when it changed."""
    if rows != self.min_active:
      self.carry = self.carry.replace(min_active=jax.device_put(
          np.int32(rows), self.carry.min_active.sharding))
      self.min_active = rows

  def free_rows(self) -> list[int]:
    return [i for i, r in enumerate(self.rows) if r is None]

  def decoding(self, done: np.ndarray, n_gen: np.ndarray, max_new: np.ndarray) -> list[int]:
    """The rows holding a request that still decodes, by the carry's `done_B`, `n_gen_B` and
    `max_new_B` as read back."""
    return [i for i, r in enumerate(self.rows)
            if r is not None and not done[i] and n_gen[i] < max_new[i]]

  def resize(self, engine, size: int) -> None:
    """Moves this bucket's requests into a state of `size` slots (`Engine.resize_program`),
    first slots first; its seconds are split among them as a loop call's are."""
    held = [i for i, r in enumerate(self.rows) if r is not None]
    fn, args = engine.resize_program(self.carry, held, size)
    t0 = engine.clock()
    self.carry = fn(*args)
    jax.block_until_ready(self.carry.pos_B)
    share = (engine.clock() - t0) / max(len(held), 1)
    self.rows = [self.rows[i] for i in held] + [None] * (size - len(held))
    for staged in self.rows[:len(held)]:
      staged.decode_s += share

  def live(self) -> int:
    return sum(r is not None for r in self.rows)


class Scheduler:
  """Runs `BatchRequest`s through an engine's batched loops (see the module doc): all at once
  (`run`) or as they arrive (`submit`, `step`, `cancel`)."""

  def __init__(self, engine, requests: Sequence[BatchRequest] = (),
               sampling: tuple = (0.0, 0, 1.0, 0.0), forced: bool = False,
               track_progress: bool = False):
    """`sampling`: (temperature, top_k, top_p, min_p) of requests without their own."""
    self.engine, self.sampling = engine, tuple(sampling)
    self.forced, self.track_progress = forced, track_progress
    self.queue = collections.deque()
    # The engine's clock at the latest submits (`_arrival_rate`), and whether every request
    # was given up front (`run`): then none is expected to arrive.
    self.submitted: collections.deque[float] = collections.deque(maxlen=ARRIVAL_WINDOW + 1)
    self.closed = False
    for req in requests:
      self.submit(req)
    self.ready: dict[int, collections.deque[_Staged]] = collections.defaultdict(
        collections.deque)
    self.buckets: dict[int, _Bucket] = {}
    self.results: dict[int, Generation] = {}
    self.pool: list[tuple] = []  # free staging cache pairs
    self._report = StepReport()
    # Queued requests of a fixed block size whose route was decided (`_route`; id -> route):
    # the prefill's room check and the insertion use the same one.
    self._routes: dict[int, _Route] = {}

  # -- the steps ----------------------------------------------------------------------------
  def _bucket(self, block_size: int) -> _Bucket:
    if block_size not in self.buckets:
      self.buckets[block_size] = _Bucket(self.engine.slot_carry(block_size, self.forced),
                                         self.engine.batch_size)
    return self.buckets[block_size]

  def _waiting(self) -> int:
    return sum(len(q) for q in self.ready.values())

  def _route(self, req: BatchRequest, block_size: int) -> _Route:
    """Where `req` (of `block_size`) decodes, decided once: where its priced start is deep
    and plain starts are on (`Engine.request_start`, `starts_plain`), the plain AR bucket; its
    own bucket otherwise."""
    if id(req) not in self._routes:
      start = self.engine.request_start(block_size, self.engine.batch_size)
      plain = self.engine.starts_plain(block_size, start, self.forced)
      explorer = self.engine.last_start_explored
      if plain and (self._joins_drafting(block_size)  # (a plain explorer's run too)
                    or explorer and self._explorer_waits_lull(req, block_size)):
        plain, start, explorer = False, (0, 0), False
      elif explorer and not plain and self._explorer_joins_plain(block_size):
        plain, start, explorer = True, (0, 0), False
      self._routes[id(req)] = (_Route(1, (0, 0), explorer) if plain
                               else _Route(block_size, start, explorer))
    return self._routes[id(req)]

  def _server_rule(self) -> StartBackoff | None:
    """The start rule's switches where this scheduler serves (requests may still come: not
    `run`, whose requests all came first) and the engine prices starts; None otherwise. Each
    rule that weighs requests still to come (joins, lulls, splits, drains, streaks) reads its
    own switch here."""
    return None if self.closed else self.engine.starts

  def _joins_drafting(self, block_size: int) -> bool:
    """Whether a server's request of `block_size` routed plain (by the start rule, or a
    plain explorer run's) drafts in its speculative bucket instead (`StartBackoff.join_live`):
    requests may still come (not `run`), that bucket holds requests (where it is full, the
    request waits for its next free slot, as a drafting one does), the plain bucket holds none
    and none waits for it, and a request of that bucket drafts there by the rule (not only an
    explorer run's, whose drafting the rule says loses: an H200's simulated clock, batch 16,
    T = 1, load 16, joining those ran 0.887x AR against 0.924x). Joining only where it had
    room, a full bucket's plain explorers opened the plain bucket beside it (batch 8, T = 1,
    load 8: 49 of 71 calls left two buckets holding requests). A plain start would open a second
    bucket, and the scheduler runs buckets by turns: on a device, where a forward costs about
    the same over more rows, each bucket then decodes half the time, while a cycle commits at
    least one token (an H200's simulated clock, batch 8, T = 1, Poisson arrivals at a load of
    8 requests in flight: 72 of 75 loop calls left two buckets holding requests, the 10 plain
    starts, explorers, waited 1.28 s against AR's 0.48 s; `benchmarks/arrivals.py`). A plain
    explorer run times the plain loop; its price is kept from the calls it ran before."""
    starts = self._server_rule()
    if starts is None or not starts.join_live:
      return False
    bucket = self.buckets.get(block_size)
    return (self._idle(1) and bucket is not None
            and any(r is not None and not r.route.explorer for r in bucket.rows))

  def _explorer_waits_lull(self, req: BatchRequest, block_size: int) -> bool:
    """Whether a server's plain explorer of `block_size` (one of a run decoding plain where the
    start rule says draft) drafts instead of opening the plain bucket
    (`StartBackoff.explore_lulls`): requests may still come (not `run`), the plain bucket holds
    none and none waits for it, the start rule has a plain step's price (timed, or the start-up
    forward's, `Engine.start_priced`: else an explorer is what prices it), and at least
    `StartBackoff.tail_quiet` requests are expected to arrive before it would end there
    (`_arrivals_within`, as a tail's move weighs them): those that draft would open the
    speculative bucket beside it, the two running by turns. A server explores the plain side in
    its lulls, as it does the drafting side under load (`_explorer_joins_plain`). With only the
    forward's price, a run that opened the plain bucket under load cost batch 4, T = 1, load 2
    (an H200's simulated clock, a second trace) 1.370x AR against 1.428x."""
    starts = self._server_rule()
    if starts is None or self.forced or not starts.join_live:
      return False
    if not self._idle(1) or not self.engine.start_priced(block_size):
      return False
    return self._busy_within(int(req.max_new_tokens))

  def _explorer_joins_plain(self, block_size: int) -> bool:
    """Whether a server's drafting explorer of `block_size` (one of a run drafting where the
    start rule says plain) decodes in the plain bucket instead (`StartBackoff.join_live`):
    requests may still come (not `run`), the plain bucket holds requests, and the explorer's
    bucket holds none and none waits for it. Its run would open a second bucket beside a busy
    plain one, each then decoding half the time on a device, the plain rows at a loss to learn
    whether drafting wins (an H200's simulated clock, batch 16, T = 1, load 16: a run of 13
    explorers beside a full plain bucket, 0.924x AR). A server under load then explores in its
    lulls only."""
    starts = self._server_rule()
    if starts is None or self.forced or not starts.join_live or not self.engine.may_start_plain:
      return False
    return self._live(1) > 0 and self._idle(block_size)

  def _move_splits(self, moving: Sequence[int], decoding: Sequence[int]) -> bool:
    """Whether a server's move of rows `moving` of a speculative bucket whose rows `decoding`
    decode would open a second bucket beside it (`StartBackoff.join_live`): requests may still
    come (not `run`), the plain bucket holds none and none waits for it, and some decoding row
    stays. On a device a forward costs about the same over more rows, so a row that stays rides
    in calls that run anyway, while the plain bucket's calls would delay every drafting row (an
    H200's simulated clock, batch 8, T = 0, load 2: moving rows whose own cycles said plain ran
    1.84x AR against 1.93x without any move). Such rows stay; a move into a busy plain bucket,
    or of every decoding row, opens none."""
    starts = self._server_rule()
    return (starts is not None and starts.join_live and self._idle(1)
            and set(moving) != set(decoding))

  def _live(self, block_size: int) -> int:
    """Requests in the slots of bucket `block_size` (0 where it has none; none is made)."""
    bucket = self.buckets.get(block_size)
    return 0 if bucket is None else bucket.live()

  def _idle(self, block_size: int) -> bool:
    """Whether bucket `block_size` holds no request and none waits for its slots (`ready.get`:
    a key of `ready` makes its bucket's slots at the next step)."""
    return self._live(block_size) == 0 and not self.ready.get(block_size)

  def _may_take(self, req: BatchRequest, block_size: int) -> bool:
    """Whether queued `req` may take a slot of this bucket: its route's (once decided), else
    its own block size's or, where plain starts may route it, the plain bucket's; any for a
    learned size."""
    route = self._routes.get(id(req))
    if route is not None:
      return route.bucket == block_size
    return (isinstance(req.block_size, str) or req.block_size == block_size
            or (block_size == 1 and self.engine.may_start_plain and not self.forced))

  def _wanted(self, block_size: int) -> bool:
    """Whether a request waits for a slot of this bucket (prefilled for it, or queued and
    `_may_take` it)."""
    return bool(self.ready[block_size]) or any(self._may_take(r, block_size)
                                               for r in self.queue)

  def _may_prefill(self, req: BatchRequest) -> bool:
    if isinstance(req.block_size, str):  # learned: the bucket is known after the prefill
      return self._waiting() < self.engine.batch_size
    b = self._route(req, req.block_size).bucket
    bucket = self._bucket(b)  # its room at full size (a shrunk one grows back)
    return self.engine.batch_size - bucket.live() > len(self.ready[b])

  def _grow_wanted(self) -> None:
    """Grows each shrunk bucket that has fewer free slots than requests ready for it back to
    `batch_size` slots (its requests keep their tokens, caches and state)."""
    for b, waiting in self.ready.items():
      bucket = self._bucket(b)
      if waiting and len(bucket.free_rows()) < len(waiting) and (
          len(bucket.rows) < self.engine.batch_size):
        bucket.resize(self.engine, self.engine.batch_size)

  def _shrink_tail(self, bucket: _Bucket, wanted: bool) -> None:
    """A bucket that no request waits for (`wanted`: `_wanted` of its block size) runs in the
    fewest slots that hold its requests (`Engine.slot_sizes`): in a batch's tail its loop
    computes only the rows it has."""
    if not self.engine.shrink or wanted:
      return
    size = min(n for n in self.engine.slot_sizes() if n >= bucket.live())
    if size < len(bucket.rows):
      bucket.resize(self.engine, size)

  def _prefill_some(self) -> None:
    while self.queue and self._may_prefill(self.queue[0]):
      req = self.queue.popleft()
      buffers = self.pool.pop() if self.pool else self.engine.staging_buffers()
      # A fixed size's route is known before its prefill (`_may_prefill`): the plain bucket's
      # requests are prefilled without the drafter (`Engine.plain_prefill`). So is a learned
      # size's where its speculative picks may start plain (`Engine.routes_learned_early`,
      # as a request of `Engine.route_size`: a batch's joint size, or alone the size a server's
      # batch of 1 routes by, as `Engine.generate` does): one routed plain is prefilled as a
      # request of that size decoding plain, its policy not run (its pick could not change
      # its route).
      learned = isinstance(req.block_size, str)
      early = learned and not self.forced and self.engine.routes_learned_early
      size = self.engine.route_size if early else req.block_size
      run_size = None if learned and not early else self._route(req, size).bucket
      if early and run_size == 1:
        req_as = dataclasses.replace(req, block_size=size)
        staged = _Staged(req, *self.engine.stage(req_as, buffers, run_size=1))
      else:
        staged = _Staged(req, *self.engine.stage(req, buffers, run_size=None if learned
                                                 else run_size))
        if learned:
          staged.policy_block_size = staged.block_size
          # In a batch a speculative pick decodes at the engine's joint size (`decode_size`);
          # its route then applies the start rule to that size (drafting, or the plain
          # bucket), a pick of 1 the plain bucket.
          staged.block_size = self.engine.decode_size(staged.block_size)
          if staged.block_size == 1:
            self._routes.pop(id(req), None)
          elif early and staged.block_size != size:
            # (alone: it drafts at its pick, from the start its route took)
            route = self._routes[id(req)]
            self._routes[id(req)] = dataclasses.replace(route, bucket=staged.block_size)
      staged.route = self._route(req, staged.block_size)
      self._routes.pop(id(req), None)
      try:
        self.engine.check_prefill(staged.pre, len(req.prompt_ids))
      except BadInputError as e:  # this request alone fails; its buffers hold NaN: dropped
        self._report.failed[req.index] = e
        continue
      self.ready[staged.route.bucket].append(staged)

  def _insert_ready(self) -> None:
    for b, waiting in self.ready.items():
      bucket = self._bucket(b)
      for row in bucket.free_rows():
        if not waiting:
          break
        staged = waiting.popleft()
        if b > 1:  # a learned size's drafter context, where its prefill left it for now
          staged.pre, context_s = self.engine.build_draft_context(staged.pre,
                                                                  len(staged.req.prompt_ids))
          staged.prefill_s += context_s
        fn, args = self.engine.insert_program(bucket.carry, row, staged.req, staged.pre,
                                              start=staged.route.start)
        t0 = time.perf_counter()
        bucket.carry = fn(*args)
        jax.block_until_ready(bucket.carry.pos_B)
        staged.prefill_s += time.perf_counter() - t0
        bucket.rows[row] = staged
        self.pool.append((staged.pre.cache, staged.pre.draft_cache))
        # (a plain route's kept hiddens too: [n, 1, P, D] per request, held to its end else)
        staged.pre = staged.pre._replace(cache=None, draft_cache=None, context_hiddens=None)

  def _run_one(self) -> None:
    live = [(b, k) for b, k in self.buckets.items() if k.live()]
    plain_first = self._plain_drains([b for b, _ in live])
    b, bucket = max(live, key=lambda bk: (plain_first and bk[0] == 1, bk[1].live(), -bk[0]))
    wanted = self._wanted(b)  # one pass over the queue for both uses below
    self._shrink_tail(bucket, wanted)
    rows = len(bucket.rows)
    c = bucket.carry
    n_gen, done, max_new, pos, wait = jax.device_get((c.n_gen_B, c.done_B, c.max_new_B,
                                                      c.pos_B, c.wait_B))
    decoding = bucket.decoding(done, n_gen, max_new)
    if decoding:
      bucket.place("break_even_N", self.engine.break_even_N(b, rows))
      bucket.place("evidence_7", self.engine.evidence_state)
      # Requests wait for a slot (this bucket's, or a learned one's whose bucket is not known
      # yet): the call returns when a row finishes, so its slot is refilled at once.
      bucket.refill_on_finish(len(decoding) if wanted else 0)
      fn, args = self.engine.slots_program(
          b, bucket.carry, self.forced, max_pos=int(max(pos[i] for i in decoding)),
          ar_steps=int(min(wait[i] for i in decoding)),
          form=form_of(bucket.rows[i].req.sampling for i in decoding),
          forwards=self._verdict_budget(b, [bucket.rows[i] for i in decoding]))
      t0 = self.engine.clock()
      bucket.carry = fn(*args)
      jax.block_until_ready(bucket.carry.pos_B)
      counted_N, seen = jax.device_get((bucket.carry.forward_counts_N,
                                        bucket.carry.evidence_7))
      counted_N = np.asarray(counted_N)
      if seen is not None:  # what this call saw, for every loop after it
        self.engine.evidence_state = bucket.placed["evidence_7"] = np.asarray(seen)
      secs = self.engine.loop_ran(t0, counted_N - bucket.counted_N, rows, b,
                                  decoding=len(decoding))
      bucket.counted_N = counted_N
      share = secs / len(decoding)
      for i in decoding:
        bucket.rows[i].decode_s += share
        bucket.rows[i].calls += 1
      self._report.ran, self._report.rows, self._report.seconds = b, len(decoding), secs
    if self.track_progress:
      self._progress(bucket)
    self._collect(bucket)
    self._move_losing(b, bucket)
    self._probe_plain(b, bucket)

  def _plain_drains(self, live: Sequence[int]) -> bool:
    """Whether a server's plain bucket runs first (`StartBackoff.drain_first`), its buckets
    holding requests being `live` (block sizes): where a speculative one holds requests too
    and the start rule routes new requests to draft (at the largest live speculative size).
    The plain bucket then only drains (rows a tail or a move left there): its calls must run
    sometime and delay the drafting rows as long whenever they run, while each drafting call
    before them adds to its own rows' wait. The fullest bucket first left a server's rows that
    a tail had moved plain waiting for the drafting bucket that arrivals refilled (an H200's
    simulated clock, batch 8, T = 0, load 4: 10 moved requests took 0.78 s against AR's
    0.49 s, one 1.31 s). Not the other way: a speculative bucket beside a plain one the rule
    routes to holds explorers (fed one in `batch_explore_every`) or rows that drafted before
    the rule turned, and its calls cost more; run first, a bucket of 13 explorers beside a
    full plain one ran batch 16, T = 1, load 16 at 0.509x AR with the joins off
    (`join_live`). None in `run` (no arrival), nor without a priced start (no rule side)."""
    starts = self._server_rule()
    if len(live) < 2 or 1 not in live or starts is None or not starts.drain_first:
      return False
    choice = self.engine.start_choice(max(live))
    return choice is not None and not choice.plain

  def _verdict_budget(self, b: int, rows: Sequence[_Staged]) -> int | None:
    """The forwards of a speculative bucket's next call where a row of it is an explorer
    (drafting where the start rule says plain) that has not decoded yet: `VERDICT_FORWARDS`,
    or more where its rows are too few to run the start rule's `min_cycles` cycles in them,
    after which their own cycles say whether they stay (`_move_losing`); None (the engine's
    `sync_cycles`) otherwise. With a call's whole budget an explorer run drafted 16 cycles
    (~80 of its 128 tokens at τ 5) before the first verdict."""
    if not self._moves(b) or not any(s.route.explorer and not s.calls for s in rows):
      return None
    return max(VERDICT_FORWARDS, -(-int(self.engine.starts.min_cycles) // max(len(rows), 1)))

  def _moves(self, b: int) -> bool:
    """Whether bucket `b`'s rows may move to the plain bucket (`_move_losing`): a speculative
    bucket, moves on (`Engine.move_plain_after`), plain starts on, no forced drafts."""
    return (b > 1 and bool(self.engine.move_plain_after) and not self.forced
            and self.engine.may_start_plain)

  def _move_losing(self, b: int, bucket: _Bucket) -> None:
    """Moves a speculative bucket's decoding requests into free slots of the plain AR bucket
    once their batch's cycles missed `Engine.move_plain_after` times in a row
    (`LoopState.misses_B`: the priced back-off's shared level; a server's not at all,
    `_streak_moves`, or with `StartBackoff.server_streaks` only where the row's own cycles so far
    also say plain, `misses_judged`), and an explorer run's rows
    (drafting where the start rule said plain) once their own cycles so far say plain by that
    rule too (`Engine.cycles_lose`; a miss weighs a cycle against the speculative loop's own,
    dearer AR steps, so where drafting loses only to the plain loop nothing misses); and a
    batch's tail (no request waits for any slot, the plain bucket has room for all its rows),
    all its decoding rows together, once its slowest row would end sooner in the plain loop
    (`Engine.tail_price`, `StartBackoff.tail_loses`) and fewer than `StartBackoff.tail_quiet`
    requests are expected to arrive before then (`_arrivals_within`: none in `run`, where
    every request came first). Other drafting rows are not judged each by its
    own cycles: under an H200's simulated clock, moving every drafting row whose cycles fell
    under the start rule's price ran batch 4 at 1.56x AR against 1.81x (requests still coming
    for the bucket: two part-filled buckets running by turns), and moving a tail's rows so,
    each by its own τ at the start's 1.2 margin, 1.69x, batch 8 1.24x against 1.30x (rows that
    still drafted faster moved). Oldest slots first, as
    many as the plain bucket has room for at full size besides the requests waiting for it (it
    grows back if shrunk). Each move copies one request's row (`Engine.move_program`); its
    seconds are split among the moved requests as a loop call's are. The requests keep their
    tokens, cache position, records and keys, so they decode the tokens they would have; their
    cycles so far inform the start rule at once (`Engine.request_moved`): the requests routed
    next see that drafting lost here. A server moves none of these where the move would leave
    some decoding rows drafting and open the plain bucket beside them (`_move_splits`)."""
    if not self._moves(b):
      return
    after = self.engine.move_plain_after
    c, r = bucket.carry, bucket.carry.records
    misses, n_gen, done, max_new = jax.device_get((c.misses_B, c.n_gen_B, c.done_B,
                                                   c.max_new_B))
    decoding = bucket.decoding(done, n_gen, max_new)
    streaks = self._streak_moves()
    losing = [i for i in decoding if streaks and misses[i] >= after]
    judged = [i for i in decoding if bucket.rows[i].route.explorer]
    plain_live = self._live(1)
    # A batch's tail: no request waits for any slot, and the plain bucket has room for all.
    tail_price = (self.engine.tail_price(b, len(bucket.rows))
                  if decoding and not self.queue and not self._waiting()
                  and plain_live + len(decoding) <= self.engine.batch_size else None)
    tail = decoding if tail_price is not None else []
    if not losing and not judged and not tail:  # (records are read back only where they count)
      return
    accept, is_cycle, verified, forwards = jax.device_get((r.accept_BS, r.is_cycle_BS,
                                                           r.verified_BS, r.forwards_B))
    cycles = {}  # row -> its cycles' committed tokens so far: all it runs if it moves
    for i in dict.fromkeys(losing + judged + tail):
      f = int(forwards[i])
      flags = cycle_flags(is_cycle[i, :f], verified[i, :f], b)
      cycles[i] = [int(a) for a, on in zip(accept[i, :f], flags) if on]
    server = self._server_rule()
    if losing and server is not None and server.misses_judged:
      losing = [i for i in losing if self.engine.cycles_lose(b, cycles[i])]
    if (judged and not set(judged) <= set(losing)
        and self.engine.cycles_lose(b, [a for i in judged for a in cycles[i]])):
      losing = sorted(set(losing) | set(judged))
    left = {i: int(max_new[i] - n_gen[i]) for i in tail}
    if (tail and set(losing) != set(tail) and self.engine.starts.tail_loses(
        [(cycles[i], left[i]) for i in tail], tail_price,
        self._arrivals_within(max(left.values()), len(bucket.rows)))):
      losing = tail
    if losing and self._move_splits(losing, decoding):
      return
    plain = self._bucket(1) if losing else None
    room = 0 if plain is None else (self.engine.batch_size - plain.live()
                                    - len(self.ready[1]))
    losing = losing[:max(room, 0)]
    if not losing:
      return
    for i in losing:
      self.engine.request_moved(cycles[i])
    moved = [bucket.rows[i] for i in losing]
    slots = self._plain_slots(len(losing))
    seconds = self._copy_rows(plain, slots, bucket, losing)
    for i, j, staged in zip(losing, slots, moved):
      plain.rows[j], bucket.rows[i] = staged, None
      staged.moved_plain = True
    bucket.carry = _with_empty_rows(bucket.carry, losing)  # the slots it left
    for staged in moved:
      staged.decode_s += seconds / len(moved)
    self._reroute(b)

  def _probe_plain(self, b: int, bucket: _Bucket) -> None:
    """Times the plain loop without a request decoding plain (`StartBackoff.plain_probes`,
    `Engine.plain_probe_due`; or, where that loop is untimed at the batch size but compiled,
    `Engine.plain_probe_untimed`, `plain_loop_ready`): after a call of speculative bucket `b`
    at the batch size, while the plain bucket holds no request and none waits for it (else its
    own calls time it), copies that bucket's decoding rows into the plain bucket's free slots
    (`Engine.move_program`, which leaves them where they are), runs one call of `PROBE_STEPS` plain
    steps on them, booked as a plain call (`Engine.loop_ran`: it prices the plain step at the
    batch size), and empties those slots again: the copies' tokens are dropped, the rows
    decode on as they were. Its seconds (the copies' and the call's) are split among the rows
    copied, which waited for it, as a move's are. A server probes in its lulls only
    (`_busy_within`)."""
    if self.forced or len(bucket.rows) != self.engine.batch_size or not self._idle(1):
      return
    due = self.engine.plain_probe_due(b)
    if not (due or self.engine.plain_probe_untimed(b)):
      return
    c = bucket.carry
    n_gen, done, max_new, pos = jax.device_get((c.n_gen_B, c.done_B, c.max_new_B, c.pos_B))
    decoding = bucket.decoding(done, n_gen, max_new)
    if not decoding:
      return
    max_pos = int(max(pos[i] for i in decoding))
    form = form_of(bucket.rows[i].req.sampling for i in decoding)
    # Untimed and not due: only where the plain loop needs no compile (a precompiled engine).
    if not due and not self.engine.plain_loop_ready(max_pos, form):
      return
    # A server's probe waits for a lull, as its plain explorers do: it delays every row in
    # flight by its steps and, under a steady load, its price serves little (the rule drafts
    # there, a tail moves only in a lull); a delayed call shifts every later arrival's batch.
    # An H200's simulated clock, batch 8 and 4, T = 1, two traces, against plain explorer runs
    # that waited for lulls (which then drafted and timed nothing): probing whenever due ran
    # 0.964x [0.947, 0.983] of those at batch 8, load 8 (second trace) and 0.986x [0.978, 0.994]
    # at batch 4, load 4; probing only while the rows' tokens left (not a whole decode) span a
    # lull, 0.990x and 0.982x.
    if self._busy_within(int(max(max_new[i] for i in decoding))):
      return
    plain, slots = self._bucket(1), self._plain_slots(len(decoding))
    seconds = self._copy_rows(plain, slots, bucket, decoding)
    plain.refill_on_finish(0)
    fn, args = self.engine.slots_program(1, plain.carry, self.forced, max_pos=max_pos,
                                         form=form, forwards=PROBE_STEPS)
    t0 = self.engine.clock()
    plain.carry = fn(*args)
    jax.block_until_ready(plain.carry.pos_B)
    counted_N = np.asarray(jax.device_get(plain.carry.forward_counts_N))
    seconds += self.engine.loop_ran(t0, counted_N - plain.counted_N, len(plain.rows), 1)
    plain.counted_N = counted_N
    plain.carry = _with_empty_rows(plain.carry, slots)
    for i in decoding:
      bucket.rows[i].decode_s += seconds / len(decoding)
    self.engine.plain_probes += 1

  def _busy_within(self, tokens: int) -> bool:
    """Whether a server that explores its plain side in lulls (`StartBackoff.explore_lulls`)
    is in none: requests may still come (not `run`) and at least `StartBackoff.tail_quiet` are
    expected to arrive within a request's decode of `tokens` in the plain loop at the batch
    size (`_arrivals_within`, by the start-up forward until that loop is timed). A plain
    explorer (`_explorer_waits_lull`) and a probe (`_probe_plain`) wait while it is."""
    starts = self._server_rule()
    if starts is None or not starts.explore_lulls:
      return False
    return (self._arrivals_within(tokens, self.engine.batch_size, prior=True)
            >= starts.tail_quiet)

  def _plain_slots(self, n: int) -> list[int]:
    """The first `n` free slots of the plain bucket, grown to `batch_size` slots first where
    it was shrunk: rows are copied into a full-size state only."""
    plain = self._bucket(1)
    if len(plain.rows) < self.engine.batch_size:
      plain.resize(self.engine, self.engine.batch_size)
    return plain.free_rows()[:n]

  def _copy_rows(self, dst: _Bucket, slots: Sequence[int], src: _Bucket,
                 rows: Sequence[int]) -> float:
    """Copies `src`'s requests of `rows` into `dst`'s `slots` as they stand mid-decode
    (`Engine.move_program`: each compiles once; `src` keeps them); the copies' seconds on the
    engine's clock."""
    seconds = 0.0
    for i, j in zip(rows, slots):
      fn, args = self.engine.move_program(dst.carry, j, src.carry, i)
      t0 = self.engine.clock()
      dst.carry = fn(*args)
      jax.block_until_ready(dst.carry.pos_B)
      seconds += self.engine.clock() - t0
    return seconds

  def _streak_moves(self) -> bool:
    """Whether rows move plain on a streak of missed cycles (`_move_losing`): in `run`
    (static batches), and on a server only with `StartBackoff.server_streaks`. A server's
    drafting rows ride in calls that run for their neighbours anyway, where a forward costs
    about the same over more rows (a device), while a moved row's plain calls delay every
    drafting row and the requests that keep coming draft beside it, the two buckets by turns:
    an H200's simulated clock, batch 8, T = 0, load 2, four traces, streak moves (judged by the
    row's own cycles) ran 0.926x / 0.973x / 0.945x / 0.961x of the same without any move. A
    server's tail (no request expected) and an explorer run's rows still move."""
    starts = self._server_rule()
    return starts is None or starts.server_streaks

  def _arrival_rate(self) -> float:
    """Requests expected to arrive per second of the engine's clock: none where every request
    was given up front (`closed`) or one came so far; else the latest submits' rate, the quiet
    time since the last of them counted (n - 1 arrivals from the oldest kept to now; inf
    where all came at this instant)."""
    if self.closed or len(self.submitted) < 2:
      return 0.0
    span = self.engine.clock() - self.submitted[0]
    return (len(self.submitted) - 1) / span if span > 0 else float("inf")

  def _arrivals_within(self, steps: int, slots: int, prior: bool = False) -> float:
    """Requests expected to arrive within `steps` steps of the plain loop at `slots` rows
    (`_arrival_rate` x their time, `Engine.plain_seconds`, with its `prior`; inf where requests
    come and the plain loop is not priced there)."""
    rate = self._arrival_rate()
    if rate == 0:
      return 0.0
    seconds = self.engine.plain_seconds(steps, slots, prior)
    return float("inf") if seconds is None else rate * seconds

  def _reroute(self, b: int) -> None:
    """After bucket `b`'s requests moved (its drafting lost, and the start rule has seen their
    cycles): the requests routed to draft in it that are no explorers and still wait for a
    slot (prefilled, or queued with a route) take the plain bucket instead where the start rule
    now says plain (`Engine.plain_now`). A batch's first requests are routed before any τ is
    known, and with learned sizes up to `batch_size` of them are prefilled ahead: without this
    they drafted at a loss after the requests before them had shown it."""
    if not self.engine.plain_now(b):
      return
    for staged in [s for s in self.ready[b] if not s.route.explorer]:
      self.ready[b].remove(staged)
      staged.route = _Route(1, (0, 0))
      self.ready[1].append(staged)
    for key, route in self._routes.items():
      if route.bucket == b and not route.explorer:
        self._routes[key] = _Route(1, (0, 0))

  def _stop_ids(self, req: BatchRequest) -> list[int]:
    return list(self.engine.stop_ids) + [int(t) for t in req.stop_token_ids]

  def _progress(self, bucket: _Bucket) -> None:
    c = bucket.carry
    seq, n_gen = jax.device_get((c.seq_BS, c.n_gen_B))
    for i, staged in enumerate(bucket.rows):
      if staged is None:
        continue
      n, req = len(staged.req.prompt_ids), staged.req
      self._report.progress[req.index] = trim_at_stop(seq[i, n:n + n_gen[i]],
                                                      self._stop_ids(req), req.max_new_tokens)

  def _collect(self, bucket: _Bucket) -> None:
    c = bucket.carry
    n_gen, done, max_new = jax.device_get((c.n_gen_B, c.done_B, c.max_new_B))
    finished = [i for i, staged in enumerate(bucket.rows)
                if staged is not None and (done[i] or n_gen[i] >= max_new[i])]
    if not finished:
      return
    r = c.records
    # The whole slots' records in one read-back (a row indexed on the device was an eager
    # gather per array and row).
    seq_BS, accept_BS, is_cycle_BS, verified_BS, forwards_B, bad_B = jax.device_get(
        (c.seq_BS, r.accept_BS, r.is_cycle_BS, r.verified_BS, r.forwards_B, c.bad_B))
    for i in finished:
      staged, bucket.rows[i] = bucket.rows[i], None
      index = staged.req.index
      try:
        self.results[index] = self._generation(
            staged, seq_BS[i], accept_BS[i], is_cycle_BS[i], verified_BS[i], int(forwards_B[i]),
            int(n_gen[i]), bool(bad_B[i]))
        self.engine.request_done(self.results[index])
        self._report.finished[index] = self.results[index]
      except BadInputError as e:  # NaN/inf logits: this request alone fails
        self._report.failed[index] = e

  def _generation(self, staged: _Staged, seq, accept, is_cycle, verified, forwards: int,
                  n_gen: int, bad: bool) -> Generation:
    n, req = len(staged.req.prompt_ids), staged.req
    if bad:
      self.engine.raise_nonfinite(n + n_gen, "a decode step")
    return generation_of(seq, accept, is_cycle, verified, forwards, n, n_gen,
                         self._stop_ids(req), req.max_new_tokens, staged.block_size,
                         staged.prefill_s, staged.decode_s, staged.probs,
                         plain_start=staged.route.bucket != staged.block_size,
                         policy_block_size=staged.policy_block_size,
                         moved_plain=staged.moved_plain)

  # -- driving it ---------------------------------------------------------------------------
  def submit(self, req: BatchRequest) -> None:
    """Queues a request (checked by the caller: `Engine.batch_request`)."""
    if req.sampling is None:
      req.sampling = self.sampling
    self.queue.append(req)
    self.submitted.append(self.engine.clock())

  def busy(self) -> bool:
    """Whether any request is queued, waiting for a slot or in flight."""
    return bool(self.queue) or self._waiting() > 0 or any(
        k.live() for k in self.buckets.values())

  def cancel(self, index: int) -> bool:
    """Drops request `index` wherever it is (queued, prefilled, or in a slot, which is free for
    the next request at once); False when it is not here (finished or unknown)."""
    for req in list(self.queue):
      if req.index == index:
        self.queue.remove(req)
        self._routes.pop(id(req), None)
        return True
    for waiting in self.ready.values():
      for staged in list(waiting):
        if staged.req.index == index:
          waiting.remove(staged)
          self.pool.append((staged.pre.cache, staged.pre.draft_cache))
          return True
    for bucket in self.buckets.values():
      for i, staged in enumerate(bucket.rows):
        if staged is not None and staged.req.index == index:
          bucket.rows[i] = None  # an empty slot: the row decodes no more
          bucket.carry = _with_empty_rows(bucket.carry, [i])
          return True
    return False

  def occupancy(self) -> dict[int, int]:
    """Block size -> requests in its slots."""
    return {b: k.live() for b, k in self.buckets.items()}

  def waiting(self) -> int:
    """Requests queued or prefilled and waiting for a slot."""
    return len(self.queue) + self._waiting()

  def step(self) -> StepReport:
    """Prefills what may be, fills free slots, runs the fullest bucket's loop once, collects
    its finished rows."""
    self._report = StepReport()
    self._prefill_some()
    self._grow_wanted()
    self._insert_ready()
    if any(k.live() for k in self.buckets.values()):
      self._run_one()
    elif self.queue and not self._waiting() and not self._report.failed:
      raise RuntimeError("scheduler: requests queued but none could be prefilled")
    return self._report

  def run(self) -> list[Generation]:
    """Decodes the requests given (no more come: `closed`) to their ends, in index order."""
    self.closed = True
    total = len(self.queue)
    while len(self.results) < total:
      report = self.step()
      if report.failed:
        raise next(iter(report.failed.values()))
      if not self.busy() and len(self.results) < total:
        raise RuntimeError("scheduler: requests left but none queued, waiting or in flight")
    return [self.results[i] for i in sorted(self.results)]


def _with_empty_rows(carry: LoopState, rows: Sequence[int]) -> LoopState:
  """`carry` with slots `rows` empty (max_new 0: they decode no more), written from the host
  in the carry's placement. An eager `max_new_B.at[rows].set(0)` compiled a scatter for each
  count of rows the first time it came (0.2-0.9 s on the demo's CPU, outside every program a
  server's warm-up compiles: a batch of 8 whose one row moved to the plain bucket took ~3x
  its group's time)."""
  max_new_B = np.array(jax.device_get(carry.max_new_B))
  max_new_B[np.asarray(list(rows), np.int64)] = 0
  return carry.replace(max_new_B=jax.device_put(max_new_B, carry.max_new_B.sharding))


def empty_buffers_like(cache, draft_cache) -> tuple:
  """Fresh zero staging buffers of the same shapes (another prefilled request waiting)."""
  zeros = lambda t: None if t is None else jax.tree.map(jnp.zeros_like, t)
  return zeros(cache), zeros(draft_cache)
