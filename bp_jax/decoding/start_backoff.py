"""Where a request starts the priced controller's back-off: from the acceptance recent requests saw.

Each request starts drafting (misses 0, no AR steps asked for) and, where drafting loses, backs
off 2, 4, 8, ... AR steps between probing cycles: 6-10 probing cycles per 128-token request at
T = 1 on the demo (τ ≈ 2.2 against a cycle costing 5-8 AR steps), each losing several AR steps'
worth. A new request is likely to draft about as well as the requests just before it, so when
their cycles committed clearly fewer tokens than a cycle costs, the next request starts deep in
the back-off: the cap's AR steps first (the most one run of them may hold: the loop keeps room
for that many steps' drafter context, `loops.CONTEXT_CHUNK`), then a probing cycle, after which
each miss backs off the whole cap. The `explore_every`-th deep start (4) is an explorer: it
drafts first, backing off 2, 4, 8, ... AR steps as any request does, so that the acceptance and
the online prices (which learn a cycle's price from calls that run cycles) stay current, and a
price that falls is seen within `explore_every` requests. While the choice stays deep as at the
last explorer and clearly so (τ more than `batch_clear`, 25%, below its flip point, as a
batch's explorer runs: `_Choice.clear_since`), the `explore_max`-th (16) explores instead: at
batch 1, T = 1 on the demo (τ ≈ 2.2 against a cycle's price of 5-16 AR steps) each explorer
drafted a request at ~0.5x AR and explorers were most of the default's loss. A price that moves
toward the flip point brings explorers back at once, but alone only calls that run cycles
renew a cycle's price in AR steps (a plain start's call does not feed the fit; it times the
plain step that bounds the AR step from below, `OnlineCosts.one_plain_floor`), so a cycle
that becomes cheaper while the choice is clearly deep is seen within 16 requests there, not 4.

The recent τ is weighed with its own uncertainty (`spread_z`): a request alone starts deep
only where the recent τ plus one standard error over the recent requests (`tau_upper`; the
requests as clusters of cycles) stays below `margin` x the price. At T = 0 prompts differ widely
and a prompt's τ says nothing of the next one's (HumanEval's evaluation half, b = 8 on the
2-core Xeon, model 207: log speed-up over AR per prompt, sd 0.26-0.29, lag-1 autocorrelation
0.03-0.07 in three runs), so a stretch of three or four hard prompts in the window of 8 sent
easy ones plain: the learned engine's plain starts at b = 8 fell on prompts that b = 8 sped up
about as much as any (1.37x against 1.41x AR at the median; 1.13x against 1.17x, 1.21x against
1.26x in two earlier runs) and cost it 3.8-5.4% of its decode time against b = 8 in its own
engine (docs/cpu_amx/start_spread_2026-12-07: none plain with the bound, 0.971x b = 8's decode
speed against 0.903x in the run before it). At T = 1 the requests' τ sit close together
far below the price (τ ~2.2 against 4.5-8 AR steps) and the bound barely moves the choice.

A request decoded alone that would start deep runs the plain AR loop instead
(`LoopOptions.start_plain`, `Engine.starts_plain`): no probing cycle at all, where each costs
several AR steps (batch 1, T = 1 on the demo: 0.990x AR against 0.865x with the deep start's
probes, one process).

In a batch (`batch_plain`, the scheduler's `start_plain`) such a request takes a slot of the
plain AR bucket (block size 1) instead of the speculative one: the speculative loop's AR steps
also stage the drafter's context, so a batch backed off deep in it still ran at ~0.8x the
plain loop (a batch of 8 on the demo's CPU: 4.3 against 3.6 ms per step, and a probing cycle
every cap steps). There the choice weighs the recent cycles against a cycle's price in steps
of the plain loop at that batch size (`OnlineCosts.start_break_even`): a request drafts when
they committed at least `batch_margin` (1.2) x that price, as drafting also pays for what the
price leaves out (its misses' dearer AR steps, a second bucket's calls and tail). Without a
margin the rule sat at its flip point at T = 0 on the demo's CPU (τ 4.5 against a price of 5.0
plain steps) and sent half the requests of a batch of 8 to each side: 0.845x AR [0.808,
0.886]. Until the plain loop has been timed at that batch size, its price is unknown and the
speculative loop's own stands in, in that loop's dearer AR steps (a batch of 8: a cycle 3.5 of
them against 4.7 plain steps): a request then starts plain unless drafting is decisive, so the
plain loop is timed before the rule weighs it. Both sides stay measured by explorer runs: a
run of `rows` consecutive requests takes the other side, so that explorers share their
bucket's calls rather than each costing a call of its own. A drafting explorer run moves to
the plain bucket mid-decode once its rows' own cycles say plain by this rule
(`batch_cycles_lose`, after its first, short call: `Scheduler._move_losing`), so where
drafting loses it pays about 4 cycles, not its whole decode.
Every `batch_explore_every`-th run (8) is a check: it explores unless the choice is clearly
plain, i.e. plain as when the last explorer run began and by more than `batch_clear`
(25%) below the flip point (τ below 0.8 x `batch_margin` x the price); then it explores only
once `batch_explore_max` runs (32) have passed since that run. A server whose batches decode
plain because drafting clearly loses thus pays for one drafting run in 32 rather than in 8 (at
batch 8 on the demo's CPU each explorer run cost its requests ~15%), while a choice near its
flip point, one that flipped, or a price that moves toward the flip point is explored within
8 runs. The price is a cycle's seconds over the plain step's, both as they stood at the last
speculative call (`OnlineCosts.start_break_even`), so a load that changes the machine moves it
when an explorer run times the cycle under that load, at most 32 runs later; so is a cycle's
price that falls while the plain loop's does not. Drafting is never clear (`_Choice.clear_since`).
Tried first and dropped: exploring unless τ and the price each held within 25% of theirs at the
last explorer run. On this VM a batch's price moved by more than that between checks (4.9 to
10.6 plain steps within 24 runs at batch 8) and τ over 8 requests from 3.0 to 5.2, so every
check explored; how far the choice is from its flip point is what decides whether an explorer
can change it.

Host-side only: the start is two runtime scalars of the loop state (`LoopState.start_row`, for
one request and for a request taking a batch's slot alike), so nothing recompiles; the tokens
are the target's own whatever the start (lossless).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

# A batch's drafting side is decisive (no plain explorer runs) where the recent cycles committed
# at least this many times a cycle's price in plain-loop steps.
DECISIVE = 2.0

# A tail row's τ (`shrunk_taus`) counts this many cycles of the tail's pooled τ besides its own
# where the rows' spread cannot be measured (fewer than 2 rows with 2 cycles).
TAIL_PRIOR_CYCLES = 4

# A batch's tail moves plain only while fewer requests than this are expected to arrive before
# the plain loop would end it (`StartBackoff.tail_quiet`): for Poisson arrivals, while none is
# more likely than one or more.
TAIL_QUIET = math.log(2)


@dataclasses.dataclass
class StartBackoff:
  """The recent requests' cycles and the start of the next one (see the module doc).

  window: requests whose cycles count; an engine's spans at least its batch size: a batch's
  rows finish in the order of their τ (those that commit least per cycle decode longest), so
  after a batch of 16 started together the last 8 to finish are its slowest half (H200,
  Qwen3-4B shapes, simulated drafts at τ 6.4: the next batch of 16 started deep, 64 AR steps
  at ~0.98x, where the whole batch's τ cleared the start price); min_cycles: cycles needed
  before any deep start;
  explore_every: while requests start deep, the explore_every-th such request decoded alone
  drafts first regardless (an explorer); explore_max: the explore_max-th instead while the
  choice stays deep as at the last explorer, by more than batch_clear (relative) below its
  flip point (`_Choice.clear_since`, as a batch's explorer runs);
  batch_explores: requests taking a batch's slot explore too (False: a batch's periodic
  probes, one cycle for all its rows every cap steps, keep τ current, and an exploring row made
  the whole batch run a cycle on entering it); margin: a deep start needs the recent committed
  tokens per cycle below `margin` x the cycle's break-even; spread_z: a request alone (or a
  batch's without `batch_plain`) weighs the recent τ plus this many of its standard errors
  over the recent requests (`tau_upper`; 0: the τ itself, as a batch's rule does);
  batch_plain: a batch's deep start decodes in the plain AR bucket (see the module doc; the
  batch explores in runs then, `batch_explores` unused); batch_explore_every: one run of
  `rows` requests in this many takes the side the recent requests did not choose, while the
  choice is near its flip point, changed side or drafts; batch_explore_max: one in this many
  while it stays plain as at the last explorer run, by more than batch_clear (relative) below
  the flip point;
  batch_margin: a batch's request drafts when the recent committed tokens per cycle reach
  `batch_margin` x the cycle's price in plain-loop steps; batch_plain_first: until the plain
  loop has been timed at the batch size, a batch's request starts plain unless drafting is
  decisive (False: the rule weighs the speculative loop's own price as if in plain steps);
  batch_prior_tau: the committed tokens per cycle a batch's rule weighs until `min_cycles`
  cycles were seen (None: it drafts first; the engine sets a learned policy's expectation at
  the size its batches decode, `Engine.batch_prior_tau`); batch_move: a speculative bucket's
  rows move to the plain bucket once their own cycles so far say plain under the batch's rule
  (`batch_cycles_lose`: an explorer run's; False: only after missed cycles,
  `BatchOptions.move_plain_after`); tail_move: a batch's tail (no request waiting) moves to
  the plain bucket, all its rows, once its slowest row would end sooner there
  (`tail_loses`, at `tail_margin` x a cycle's price in plain steps); tail_quiet: it moves only
  while fewer requests than this are expected to arrive before the plain loop would end it
  (the recent arrival rate, `Scheduler._arrivals_within`; inf: arrivals not weighed);
  join_live: a server's start alone opens no second bucket beside a running one: a request
  routed plain (a plain explorer's too) drafts in its speculative bucket where a request
  drafts there by the rule and the plain bucket holds none (`Scheduler._joins_drafting`), and
  a drafting explorer decodes plain where the plain bucket holds requests and its own none
  (`Scheduler._explorer_joins_plain`); two buckets run by turns; drain_first: where a
  server's plain bucket holds requests beside a speculative one and the rule routes new
  requests to draft, the plain bucket runs first: it only drains (`Scheduler._plain_drains`;
  False: the fullest first, as in `Scheduler.run`);
  misses_judged: with `server_streaks`, a server's row whose cycles missed
  `BatchOptions.move_plain_after` times in a row moves plain only where its own cycles so far
  also say plain (`batch_cycles_lose`; a
  streak of misses is a hard stretch of the text more often than a request that loses: an
  H200's simulated clock, batch 8, T = 0, load 2, moving on the streak alone ran 1.64x AR
  against 1.93x without any move; False: on the streak, as in `Scheduler.run`);
  explore_lulls: a server's plain explorer (a run decoding plain where the rule says draft)
  opens an idle plain bucket only while fewer than `tail_quiet` requests are expected to
  arrive before it would end there (`Scheduler._explorer_waits_lull`); else it drafts: the
  requests that came meanwhile would draft beside it, the two buckets running by turns (an
  H200's simulated clock, batch 4, T = 1, load 2: 1.339x AR with the explorers opening the
  plain bucket, 1.408x in lulls only; False: whatever the arrivals, as in `Scheduler.run`);
  forward_prior: until the plain loop has been timed at the batch size, a batch's rule prices
  the cycle the speculative loop's calls timed in the start-up one-token forward measured there
  (`OnlineCosts.forward_priced`, `plain_prior_s`: not a bound; on the demo's CPU that forward
  cost 1.13-1.28x the plain loop's step, so there the price errs toward drafting by that much
  until a probe or a plain call times the loop), with its own `batch_margin` (False, no
  forward measured, or no
  loop call yet: in the speculative loop's own AR steps, plain unless drafting is `DECISIVE`,
  `batch_plain_first`; the start-up costs alone price a cycle below the loop's). A batch of 8,
  T = 1, static batches on an H200's simulated clock: the decisive rule sent the second group
  plain to time that loop (1.207x AR against the paper's loop's 1.257x);
  server_streaks: a server's rows move plain on a streak of missed cycles (judged as
  `misses_judged` says); False: only a tail's and an explorer run's rows move
  (`Scheduler._streak_moves`; `Scheduler.run` moves on streaks either way). An H200's simulated
  clock, batch 8, T = 0, load 2, three traces: off 1.03-1.08x the judged streak moves, level
  with every request drafting;
  plain_probes: a batch's plain side is timed without any request decoding plain: where a
  plain explorer run would begin (the rule says draft), no request explores and `probe_due`
  is set instead, and the scheduler, after a full-size speculative call while the plain bucket
  is idle, runs one short call of the plain loop on copies of that call's decoding rows, whose
  time prices the plain step and whose tokens are dropped (`Scheduler._probe_plain`). A
  plain explorer run only timed the plain loop (plain rows run no cycle) at the price of its
  requests' decodes: an H200's simulated clock, static batches of 8, T = 1, one run of 8
  requests in 82 decoding plain cost the default 1.7% of the paper's loop. False: plain
  explorer runs as before;
  probe_untimed: with `plain_probes`, a batch whose plain loop at the batch size is compiled
  (precompiled, as a server's and the benchmarks' are) but untimed probes it after its first
  full-size speculative call, not only where a plain explorer run would begin: the start-up
  one-token forward (`forward_prior`) then prices the plain step for one call instead of a
  run of requests. That forward is no bound (on the demo's CPU it cost 1.13-1.28x the loop's
  plain step); a probe costs `scheduler.PROBE_STEPS` plain steps once. False: the forward prices the
  plain step until a probe falls due or a plain call times it."""
  window: int = 8
  min_cycles: int = 8
  explore_every: int = 4
  explore_max: int = 16
  batch_explores: bool = False
  margin: float = 0.8
  spread_z: float = 1.0
  batch_plain: bool = False
  batch_explore_every: int = 8
  batch_explore_max: int = 32
  batch_clear: float = 0.25
  batch_margin: float = 1.2
  batch_plain_first: bool = True
  batch_prior_tau: float | None = None
  batch_move: bool = True
  tail_move: bool = True
  tail_margin: float = 1.0
  tail_quiet: float = TAIL_QUIET
  join_live: bool = True
  drain_first: bool = True
  misses_judged: bool = True
  explore_lulls: bool = True
  forward_prior: bool = True
  server_streaks: bool = False
  plain_probes: bool = True
  probe_untimed: bool = True
  _recent: collections.deque = dataclasses.field(init=False)
  _deep: int = dataclasses.field(default=0, init=False)   # deep starts since the last explorer
  # The single rule's choice when its last explorer started (None: drafting since).
  _explored: _Choice | None = dataclasses.field(default=None, init=False)
  # Whether the last batch start (`_batch_start`) was an explorer's: its side is the one the
  # rule did not choose, and a later reconsideration (`batch_plain_now`) must leave it be.
  last_explored: bool = dataclasses.field(default=False, init=False)
  # Whether a batch's plain side is due to be timed by a probe (`plain_probes`): set where a
  # plain explorer run would have begun, cleared by the call that times the plain loop.
  probe_due: bool = dataclasses.field(default=False, init=False)
  _batch: _BatchExplorers = dataclasses.field(init=False)

  def __post_init__(self):
    self._recent = collections.deque(maxlen=self.window)
    self._batch = _BatchExplorers()

  def observe(self, acceptance_lengths: Sequence[int]) -> None:
    """One finished request's committed tokens per cycle (`Generation.acceptance_lengths`)."""
    if len(acceptance_lengths):
      self._recent.append((int(sum(acceptance_lengths)), len(acceptance_lengths)))

  def tau(self) -> float | None:
    """Committed tokens per cycle over the recent requests' cycles (None: too few cycles)."""
    cycles = sum(c for _, c in self._recent)
    return None if cycles < self.min_cycles else sum(t for t, _ in self._recent) / cycles

  def tau_upper(self) -> float | None:
    """The recent τ (`tau`) plus `spread_z` standard errors of it over the recent requests
    (None: too few cycles): a ratio estimator's, each request a cluster of cycles, so a window
    whose requests committed alike per cycle reads its τ, and one that mixes hard requests with
    easy ones reads above it (`observe` keeps requests with cycles only). Fewer than two
    requests: the τ itself."""
    tau, seen = self.tau(), self._recent
    if tau is None or len(seen) < 2 or self.spread_z <= 0:
      return tau
    n, mean_cycles = len(seen), sum(c for _, c in seen) / len(seen)
    var = sum((t - tau * c) ** 2 for t, c in seen) / (n * (n - 1) * mean_cycles ** 2)
    return tau + float(self.spread_z) * math.sqrt(var)

  def batch_tau(self) -> float | None:
    """The τ a batch's rule weighs: the recent cycles' (`tau`), or before enough were seen
    `batch_prior_tau`. A batch's first run drafting where drafting loses costs every row of
    it (`python decode.py --config.batch_size=4` on the demo's CPU, 8 prompts, every request
    drafting first: 0.88x AR); alone, a first request's misses back it off after its own first
    cycles, so one request still drafts first before any τ."""
    tau = self.tau()
    return self.batch_prior_tau if tau is None else tau

  def start(self, break_even: float, cap: int, rows: int = 1,
            plain_priced: bool = True) -> tuple[int, int]:
    """(misses, AR steps) the next request (in a loop of `rows` slots) starts with: (0, 0) to
    draft first; a deep start (the misses after which one more backs off `cap` steps, and `cap`
    steps: never more, the loop's room for pending drafter context) when the recent cycles
    committed below `margin` x `break_even` tokens, by more than their spread over the requests
    says at one row (`tau_upper`), and this request does not explore.

    Explorers cost: at batch 1, T = 1 on the demo each drafts a request where the others
    decode plain (0.939x AR against 0.991x with explorers thinned to one in 32 while they
    lost). Two cheaper explorers were tried and dropped (docs/results/controller.md): ones
    thinned while explorers lost, near the flip point too, left a price that fell back
    unseen for 8 requests and more (tests/test_online_costs.py's price drop, 4.5 to 1.2 AR
    steps, which this rule still follows: it thins only a choice clear of its flip point); and
    explorers that probe once and then back off the cap feed the online prices calls of one
    cycle among ~35 AR steps, which cannot tell a cheaper cycle from a cheaper AR step (in
    that test the break-even rose, 4.2 to 4.6, where the cycle's price had fallen to 1.2)."""
    if rows > 1 and self.batch_plain:
      return self._batch_start(self.batch_tau(), break_even, cap, rows, plain_priced)
    tau = self.tau_upper()
    if not self._deep_alone(tau, break_even):
      self._deep, self._explored = 0, None
      return 0, 0
    self._deep += 1
    now = _Choice(True, tau / (self.margin * float(break_even)))
    every = (max(int(self.explore_max), self.explore_every)
             if now.clear_since(self._explored, self.batch_clear) else self.explore_every)
    if (rows == 1 or self.batch_explores) and self._deep >= every:
      self._deep, self._explored = 0, now
      return 0, 0
    cap = max(int(cap), 1)
    return cap.bit_length() - 1, cap

  def batch_plain_now(self, break_even: float, plain_priced: bool = True) -> bool:
    """Whether a batch's request that is no explorer would start plain now (`_batch_start`'s
    rule, without counting a start): the recent cycles committed fewer tokens than
    `batch_margin` x `break_even`."""
    return self._plain(self.batch_tau(), break_even, plain_priced)

  def batch_cycles_lose(self, acceptance_lengths: Sequence[int], break_even: float,
                        plain_priced: bool = True) -> bool:
    """Whether a speculative bucket's explorer rows, by their own cycles so far (committed
    tokens per cycle, at least `min_cycles` of them), would start plain under the batch's rule
    (`_plain` with their τ): they then move to the plain bucket (`Scheduler._move_losing`).
    Their misses alone do not tell: a miss weighs a cycle against the speculative loop's own AR
    steps, which stage the drafter's context and cost more than the plain loop's (batch 8,
    T = 0 on the demo's CPU, at the runs' ends: a cycle's price 2.8-3.0 of those against
    3.9-10 plain steps, at τ ~4.5-5), so an explorer run there missed nothing and drafted to
    its end. False without `batch_move`."""
    if not self.batch_move or len(acceptance_lengths) < max(int(self.min_cycles), 1):
      return False
    tau = sum(acceptance_lengths) / len(acceptance_lengths)
    return self._plain(tau, break_even, plain_priced)

  def tail_loses(self, rows: Sequence[tuple[Sequence[int], int]], break_even: float,
                 arrivals: float = 0.0) -> bool:
    """Whether a batch's tail (a speculative bucket's decoding rows with no request waiting for
    any slot), each row its cycles' committed tokens so far and the tokens it has left, ends
    later drafting than in the plain loop: the tail's time is its slowest row's, so the rule
    weighs the longest row in plain steps (its tokens left) against the longest row drafting
    (tokens left / its τ x `break_even`, a cycle's price in plain steps), at `tail_margin`.
    Each row's τ is its own cycles' shrunk toward the tail's pooled τ (`shrunk_taus`): the
    longest of 8-16 noisy estimates is the most pessimistic one. False without `tail_move`,
    before `min_cycles` cycles in all, or where `arrivals` (the requests expected to arrive
    before the plain loop would end the tail) reach `tail_quiet`: a request that came then
    would draft in the speculative bucket while the moved rows decode plain, the two buckets
    running by turns (an H200's simulated clock, batch 8, Poisson arrivals at a load of 8
    requests in flight: AR's mean latency / the default's 2.129x, 1.614x with arrivals not
    weighed; `benchmarks/arrivals.py`, docs/cpu_xeon167/arrivals_2026-12-06).

    A tail's rows move all together (`Scheduler._move_losing`): no second bucket runs by turns
    with the first. In a static batch the rows that commit most per cycle finish first, and
    those left decoding in the speculative loop backed off to AR steps with a probing cycle
    every few (an H200's simulated clock at batch 16: 0.98x AR, its groups ending in their
    slowest rows' cycles at τ ~1.4-1.8 against a cycle's price of ~1.85 plain steps)."""
    if (not self.tail_move or not rows or arrivals >= self.tail_quiet
        or sum(len(a) for a, _ in rows) < max(int(self.min_cycles), 1)):
      return False
    taus = shrunk_taus([accepted for accepted, _ in rows])
    plain = max(left for _, left in rows)
    drafting = max(left / tau for (_, left), tau in zip(rows, taus)) * float(break_even)
    return plain * self.tail_margin < drafting

  def alone_plain_now(self, break_even: float) -> bool:
    """Whether a request decoded alone that is no explorer would start deep now (`start`'s
    rule at one row, without counting a start): the recent cycles committed fewer tokens, by
    more than their spread over the requests says (`tau_upper`), than `margin` x
    `break_even`."""
    return self._deep_alone(self.tau_upper(), break_even)

  def _deep_alone(self, tau: float | None, break_even: float) -> bool:
    """The rule at one row (and in a batch without `batch_plain`): deep when the recent
    cycles' τ, with its spread (`tau_upper`), is below `margin` x `break_even` (drafting
    before any τ)."""
    return tau is not None and tau < self.margin * break_even

  def _plain(self, tau: float | None, break_even: float, plain_priced: bool = True) -> bool:
    """A batch's rule: plain when the recent cycles committed fewer tokens (τ) than
    `batch_margin` x `break_even` (drafting before any τ). Until the plain loop has been timed
    at this batch size (`plain_priced` False), `break_even` is the speculative loop's own, in
    its AR steps, which stage the drafter's context and cost more than the plain loop's (a
    batch of 8 on the demo's CPU: a cycle 3.5 of them against 4.7 plain steps): then plain
    unless drafting is `DECISIVE`, so that the plain loop is timed before the rule weighs it
    (batch 8, T = 0, static batches of 8: the first six runs drafted at ~0.7x AR)."""
    if tau is None:
      return False
    unpriced = not plain_priced and self.batch_plain_first
    return tau < (DECISIVE if unpriced else self.batch_margin) * break_even

  def _batch_start(self, tau: float | None, break_even: float, cap: int, rows: int,
                   plain_priced: bool = True) -> tuple[int, int]:
    """A batch's start under `batch_plain`: deep (the scheduler then decodes the request in
    the plain AR bucket) when the recent cycles committed fewer tokens than `batch_margin` x
    `break_even`, drafting first otherwise (also before enough cycles were seen and with no
    `batch_prior_tau`); explorer runs
    of `rows` requests (`_BatchExplorers`) take the other side (drafting where the rule says
    plain; plain where it says draft, unless drafting is `DECISIVE`)."""
    deep = self._plain(tau, break_even, plain_priced)
    # Where drafting commits twice its price or more, a plain run cannot win and would cost
    # its requests up to half their speed (an accelerator): no plain explorers there.
    wanted = deep or tau is None or tau < DECISIVE * break_even
    ratio = None if tau is None else tau / (self.batch_margin * float(break_even))
    explore = self._batch.explores(_Choice(deep, ratio), rows, wanted, self)
    if explore and not deep and self.plain_probes:  # the plain side is timed by a probe
      self.probe_due = self.probe_due or self._batch.began
      explore = False
    self.last_explored = explore
    if deep == explore:
      return 0, 0
    cap = max(int(cap), 1)
    return cap.bit_length() - 1, cap


@dataclasses.dataclass(frozen=True)
class StartChoice:
  """Where the next request of a bucket would start now, and what that rests on
  (`Engine.start_choice`; a server's /metrics shows it).

  tau: committed tokens per cycle over the recent requests' cycles (None: too few yet; a
    batch's, `StartBackoff.batch_tau`: its prior until then, where it has one);
  price: a cycle's price the rule weighs tau against (a batch: in steps of the plain loop at
    the batch size once both loops' calls have timed them, `OnlineCosts.start_break_even`;
    alone: in AR steps of the speculative loop's fit, `OnlineCosts.break_even`);
  plain: whether a request that is no explorer would start plain now (the plain AR loop or
    bucket, or deep in the back-off where plain starts are off)."""
  tau: float | None
  price: float
  plain: bool


@dataclasses.dataclass(frozen=True)
class _Choice:
  """A batch's start rule at one request: the side it chose (deep: plain) and by how much (the
  recent τ over `batch_margin` x the price: below 1 plain, None before any τ)."""
  deep: bool
  ratio: float | None

  def clear_since(self, then: _Choice | None, tolerance: float) -> bool:
    """Plain, as at `then`, by more than `tolerance` (relative) below the flip point. Drafting
    is never clear: there the figure that goes stale is the plain loop's price, which only
    plain explorers renew, and one slow spell of plain calls could keep a batch drafting where
    it loses (batch 8, T = 0 on the demo's CPU, with drafting clear too: 0.915x [0.848, 0.981]
    the same rule exploring every 8th run, 50 against 74 of 82 kept decodes plain); a stale
    price on the plain side errs toward plain decoding, which never loses."""
    return (then is not None and then.deep and self.deep and self.ratio is not None
            and self.ratio < 1.0 / (1.0 + tolerance))


@dataclasses.dataclass
class _BatchExplorers:
  """When a batch's explorer runs come (`StartBackoff._batch_start`): a check every
  `batch_explore_every` runs of `rows` requests (the first before the last of them); the run
  explores unless the rule's choice is clear (`_Choice.clear_since`: plain as when the last
  explorer run began, by more than `batch_clear` below the flip point), and then too once
  `batch_explore_max` runs have passed since that explorer run."""
  _since: int = 0          # requests started outside explorer runs since the last one began
  _left: int = 0           # explorers still to start in the current run
  _last: _Choice | None = None  # the choice when the last explorer run began
  began: bool = False  # whether the last request asked about began an explorer run

  def explores(self, now: _Choice, rows: int, wanted: bool, rule: StartBackoff) -> bool:
    """Whether the next request explores (`wanted`: the rule allows an explorer now)."""
    every = max(int(rule.batch_explore_every), 1)
    self.began = False
    if every == 1:
      return False
    if self._left:
      self._left -= 1
      return wanted
    self._since += 1
    if self._since % (every * rows) != (every - 1) * rows + 1 or not wanted:
      return False
    longest = max(int(rule.batch_explore_max), every)
    if now.clear_since(self._last, rule.batch_clear) and self._since <= (longest - 1) * rows:
      return False
    self._since, self._left, self._last, self.began = 0, rows - 1, now, True
    return True


def shrunk_taus(rows: Sequence[Sequence[int]]) -> list[float]:
  """Each row's committed tokens per cycle (its cycles' `rows[i]`), shrunk toward the rows'
  pooled τ as far as the rows' own spread says (empirical Bayes, method of moments): a row
  counts k cycles of the pooled τ besides its own, k = the cycles' variance within a row over
  the variance of the rows' true τ (their means' variance less what their cycles' noise adds
  to it). Rows whose means differ no more than their cycles' noise explains all read the
  pooled τ; rows that differ clearly keep nearly their own. A fixed k did not fit both: at
  T = 1 (per-cycle variance ~2 at τ ~2.2) one row of 16 cycles at τ 1.5 among rows at 2.2
  moved a batch of 8 that drafted at 0.77x AR's time, while at T = 0 a static batch of 16 whose
  rows spread from τ 1.6 to 5.1 needed its slow rows' own τ. `TAIL_PRIOR_CYCLES` where the
  spread cannot be measured (fewer than 2 rows with 2 cycles or more); a row without a cycle
  reads the pooled τ."""
  total = sum(len(r) for r in rows)
  if not total:
    return [1.0] * len(rows)
  pooled = sum(sum(r) for r in rows) / total
  measured = [r for r in rows if len(r) >= 2]
  k = float(TAIL_PRIOR_CYCLES)
  if len(measured) >= 2:
    means = [sum(r) / len(r) for r in measured]
    within = (sum(sum((a - m) ** 2 for a in r) for r, m in zip(measured, means))
              / sum(len(r) - 1 for r in measured))
    centre = sum(means) / len(means)
    spread = sum((m - centre) ** 2 for m in means) / (len(means) - 1)
    between = spread - within * sum(1 / len(r) for r in measured) / len(measured)
    k = within / between if between > 0 else float("inf")
  if k == float("inf"):
    return [pooled] * len(rows)
  return [(sum(r) + k * pooled) / (len(r) + k) if r else pooled for r in rows]
