"""The verify-length controllers as the speculative loop calls them: one small object each
behind one interface (the rule, costs and checks they use are in `controller`).

A controller has
  buckets  the numbers of drafts k a cycle may verify (one bucket: no choice to make);
  cap      the most AR steps in one run of them after a miss (0: cycles are never misses and
           the loop takes no AR steps);
  shared_backoff  whether a miss backs the batch off as one (`LoopState.backed_off`): a
           controller whose miss is the batch's decision;
  expected(draft_logits_BkV, draft_Bk) -> [B] what `choose` and `observed` read of the
           drafter's probabilities (None: nothing), computed once per cycle;
  choose(draft_logits_BkV, draft_Bk, s, expected_B) -> (index into `buckets` [], draft_next []
           bool) after the drafter's pass (`s`: the loop state, for its decoding rows and
           runtime values);
  observed(s, k, a_B, expected_B) -> the state after a cycle verifying k drafts (a_B accepted
           per row, -1 for a row that committed nothing) has been committed: what the
           controller learns from it (`priced`: `decline.observed`, `evidence.observed`);
  miss_B(k, a_B, draft_next, break_even_N=None) -> [B] bool: which rows' cycle (verifying k
           drafts, a_B of them accepted, -1 for a row that committed nothing) was a miss (only
           when cap > 0); `break_even_N`: the loop state's runtime prices
           (`LoopState.break_even_N`), which only `priced` reads;
  backs_off(s) -> [] bool: whether the cycle's misses take their AR steps now (`priced` with
           its gate: only while misses persist or cycles lose, `evidence.backs_off`);
  declines  whether `choose`'s bucket 0 declines the drafts (`priced`'s decline): the loop
           verifies nothing in that cycle and the rows' next AR step is its forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bp_jax.decoding import controller as control
from bp_jax.decoding import decline as decline_rule
from bp_jax.decoding import evidence
from bp_jax.errors import BadInputError


@dataclasses.dataclass(frozen=True)
class Plain:
  """`none`: every cycle verifies all b-1 drafts (the paper's loop)."""
  block_size: int
  cap = 0
  shared_backoff = False

  @property
  def buckets(self) -> tuple[int, ...]:
    return (self.block_size - 1,)

  # Whether `choose`'s bucket 0 declines the drafts (`priced`'s decline): the loop then verifies
  # nothing in that cycle, and the rows' next AR step is its forward (`loops`).
  declines = False

  # Whether the controller keeps state across its cycles (`observed`): the loop state then
  # carries `LoopState.evidence_7` (`evidence`).
  stateful = False

  def expected(self, draft_logits_BkV, draft_Bk) -> jax.Array | None:
    return None

  def choose(self, draft_logits_BkV, draft_Bk, s, expected_B=None
             ) -> tuple[jax.Array, jax.Array]:
    return jnp.int32(0), jnp.bool_(True)

  def observed(self, s, k: int, a_B: jax.Array, expected_B=None):
    return s

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    return jnp.zeros_like(a_B, jnp.bool_)  # never a miss

  def backs_off(self, s) -> jax.Array:
    """[] bool: whether this cycle's misses (`miss_B`) take AR steps now; a miss that does not
    still counts as one (`LoopState.backed_off`)."""
    return jnp.bool_(True)


@dataclasses.dataclass(frozen=True)
class Backoff(Plain):
  """`backoff`: as `none`, and a cycle accepting at most `accept` drafts is a miss (the rows
  then take 2, 4, ... AR steps, at most `cap`)."""
  cap: int = 0
  accept: int = 1

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    return a_B <= self.accept


@dataclasses.dataclass(frozen=True)
class Priced(Plain):
  """`priced`: as `backoff`, and a cycle is a miss when it committed fewer tokens than it cost
  AR steps (draft pass + verify of the k+1 tokens), so its miss rule follows the machine's
  prices. One decision for the whole batch: the miss is the decoding rows' mean against the
  price (`controller.batch_below_break_even`), and every row backs off together, to the
  deepest row's level (`shared_backoff`). The price is
  a runtime value, `break_even_N[k + 1]` of the loop state, which the engine keeps current
  from its timed loop calls (`online_costs`) with no recompilation; a state without one (None)
  reads the start-up costs `costs`/`draft_cost` (`controller.break_even`).

  `decline` (`LoopOptions.controller_decline`): after the drafter pass, the cycle verifies none
  of its drafts (k = 0, a miss) when the drafter's probabilities, scaled by the acceptance
  measured on the recent cycles, do not expect them to pay for their verify (`decline`); the
  state then carries that evidence (`LoopState.evidence_7`). `calibration`: the
  drafter's calibrated rates (`controller.calibrated`) in place of its raw probabilities.

  `persist` (`LoopOptions.controller_persist`): a miss backs the rows off only while the cycles
  right after misses commit clearly less than cycles do on average (`evidence.persists`), or
  cycles commit less than a full cycle's price on average (`evidence.cycles_lose`); otherwise
  the next cycle runs at once (the miss still counts, so that cycle is the gate's next
  evidence)."""
  cap: int = control.PRICED_SKIP_CAP
  costs: tuple[float, ...] = (1.0,)   # relative verify costs (the engine's, measured or given)
  draft_cost: float = 0.0
  decline: bool = False
  calibration: tuple[float, ...] | None = None
  persist: bool = False  # the back-off gate (`LoopOptions.controller_persist`, `evidence`)
  shared_backoff = True  # the batch's miss: every row backs off to the deepest row's level

  @property
  def buckets(self) -> tuple[int, ...]:
    return (0, self.block_size - 1) if self.decline else (self.block_size - 1,)

  @property
  def declines(self) -> bool:
    return self.decline

  @property
  def stateful(self) -> bool:
    return self.decline or self.persist

  def price_N(self, break_even_N: jax.Array | None) -> jax.Array:
    """[b + 1] the break-even per verify length: the state's runtime one, else the start-up
    costs'."""
    if break_even_N is not None:
      return break_even_N
    return jnp.asarray([1.0] + [control.break_even(n - 1, self.costs, self.draft_cost)
                                for n in range(1, self.block_size + 1)], jnp.float32)

  def expected(self, draft_logits_BkV, draft_Bk) -> jax.Array | None:
    if not self.decline:
      return None
    p_Bk = control.calibrated(control.drafted_probs(draft_logits_BkV, draft_Bk),
                              self.calibration)
    return decline_rule.expected_accepted(p_Bk)

  def choose(self, draft_logits_BkV, draft_Bk, s, expected_B=None
             ) -> tuple[jax.Array, jax.Array]:
    if not self.decline:
      return jnp.int32(0), jnp.bool_(True)
    price = decline_rule.verify_price(self.block_size, self.price_N(s.break_even_N))
    active_B = s.active_B()
    level = s.backoff_level(active_B)
    declined = decline_rule.declines(expected_B, active_B, price,
                                     s.evidence_7[evidence.DECLINE], level)
    return jnp.where(declined, 0, 1).astype(jnp.int32), jnp.bool_(True)

  def observed(self, s, k: int, a_B: jax.Array, expected_B=None):
    """The state after a cycle that verified k drafts: the decline's and the back-off gate's
    evidence (`evidence`). A row's cycle follows a miss when the row's own last full cycle
    committed fewer tokens than its price (`LoopState.missed_B`, renewed here), whether or not
    the batch backed off: at batch 4 on an H200's prices (a b = 16 cycle 1.56 AR steps) a
    batch's miss needs its rows' mean under 1.56 tokens, so they came only in batch tails, a
    few per run, and the gate, counting the cycles after those, kept its prior (a post-miss
    cycle commits 1 token) and backed off through the run (docs/results/accelerator.md)."""
    e = s.evidence_7
    if self.decline:
      e = e.at[evidence.DECLINE].set(decline_rule.observed(e[evidence.DECLINE], k,
                                                           self.block_size, expected_B, a_B))
    if self.persist:
      e = evidence.observed(e, k, self.block_size, a_B, s.missed_B)
      price = self.price_N(s.break_even_N)[k + 1]
      s = s.replace(missed_B=evidence.row_missed(s.missed_B, k, self.block_size, a_B, price))
    return s.replace(evidence_7=e) if self.stateful else s

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    return control.batch_below_break_even(a_B, self.price_N(break_even_N)[k + 1])

  def backs_off(self, s) -> jax.Array:
    if not self.persist:
      return jnp.bool_(True)
    return evidence.backs_off(s.evidence_7, self.price_N(s.break_even_N)[self.block_size])


@dataclasses.dataclass(frozen=True)
class Fixed(Plain):
  """"fixed:k" (tests): every cycle verifies k drafts, through the bucket machinery."""
  k: int = 0

  @property
  def buckets(self) -> tuple[int, ...]:
    return control.verify_buckets(self.block_size)

  def choose(self, draft_logits_BkV, draft_Bk, s, expected_B=None
             ) -> tuple[jax.Array, jax.Array]:
    return jnp.int32(self.buckets.index(self.k)), jnp.bool_(True)


@dataclasses.dataclass(frozen=True)
class Confidence(Plain):
  """`confidence`: the bucket maximizing expected committed tokens per cost (`controller.
  choose`, with the drafter's calibrated p); a cycle whose best rate is below the AR rate is a
  miss (and with `poor_miss`, one that verified more than `accept` drafts and accepted at most
  that many). Its costs are the start-up ones, compile-time constants (the online estimate of
  `online_costs` reaches `priced` only)."""
  cap: int = control.DEFAULT_SKIP_CAP
  accept: int = 1
  poor_miss: bool = False
  costs: tuple[float, ...] = (1.0,)   # relative verify costs (the engine's, measured or given)
  draft_cost: float = 0.0
  calibration: tuple[float, ...] | None = None

  @property
  def buckets(self) -> tuple[int, ...]:
    return control.verify_buckets(self.block_size)

  def choose(self, draft_logits_BkV, draft_Bk, s, expected_B=None
             ) -> tuple[jax.Array, jax.Array]:
    cost_K = control.bucket_costs(self.block_size, self.costs, self.draft_cost)
    p_Bk = control.calibrated(control.drafted_probs(draft_logits_BkV, draft_Bk),
                              self.calibration)
    return control.choose(p_Bk, s.active_B(), self.buckets, cost_K,
                          control.verify_cost(1, self.costs))

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    miss = ~draft_next | jnp.zeros_like(a_B, jnp.bool_)
    if self.poor_miss and k > self.accept:
      miss = miss | (a_B <= self.accept)
    return miss


def controller_of(opts) -> Plain:
  """The controller of a `LoopOptions` (its loop form in effect, `LoopOptions.in_effect`)."""
  b, name = opts.block_size, opts.controller
  fixed = control.fixed_k(name, b)
  if fixed is not None:
    return Fixed(b, k=fixed)
  if name in control.PRICED and opts.controller_costs is None:
    raise BadInputError(f"controller={name!r} has no costs: give controller_costs= and "
                        "controller_draft_cost=, or build the loop through an Engine, which "
                        "measures them (bp_jax.decoding.costs)")
  if name == "priced":
    return Priced(b, cap=opts.ar_fallback, costs=opts.controller_costs,
                  draft_cost=opts.controller_draft_cost,
                  decline=opts.controller_decline is not False,  # None: outside an engine
                  calibration=opts.controller_calibration, persist=opts.controller_persist)
  if name == "confidence":
    return Confidence(b, cap=opts.ar_fallback, accept=opts.ar_fallback_accept,
                      poor_miss=opts.controller_poor_miss, costs=opts.controller_costs,
                      draft_cost=opts.controller_draft_cost,
                      calibration=opts.controller_calibration)
  if name == "backoff" and opts.ar_fallback > 0:
    return Backoff(b, cap=opts.ar_fallback, accept=opts.ar_fallback_accept)
  return Plain(b)
