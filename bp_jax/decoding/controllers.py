"""The verify-length controllers as the speculative loop calls them: one small object each
behind one interface (the rule, costs and checks they use are in `controller`).

A controller has
  buckets  the numbers of drafts k a cycle may verify (one bucket: no choice to make);
  cap      the most AR steps in one run of them after a miss (0: cycles are never misses and
           the loop takes no AR steps);
  shared_backoff  whether a miss backs the batch off as one (`LoopState.backed_off`): a
           controller whose miss is the batch's decision;
  choose(draft_logits_BkV, draft_Bk, active_B) -> (index into `buckets` [], draft_next [] bool)
           after the drafter's pass;
  miss_B(k, a_B, draft_next, break_even_N=None) -> [B] bool: which rows' cycle (verifying k
           drafts, a_B of them accepted, -1 for a row that committed nothing) was a miss (only
           when cap > 0); `break_even_N`: the loop state's runtime prices
           (`LoopState.break_even_N`), which only `priced` reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from bp_jax.decoding import controller as control
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

  def choose(self, draft_logits_BkV, draft_Bk, active_B) -> tuple[jax.Array, jax.Array]:
    return jnp.int32(0), jnp.bool_(True)

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    return jnp.zeros_like(a_B, jnp.bool_)  # never a miss


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
  reads the start-up costs `costs`/`draft_cost` (`controller.break_even`)."""
  cap: int = control.PRICED_SKIP_CAP
  costs: tuple[float, ...] = (1.0,)   # relative verify costs (the engine's, measured or given)
  draft_cost: float = 0.0
  shared_backoff = True  # the batch's miss: every row backs off to the deepest row's level

  def miss_B(self, k: int, a_B: jax.Array, draft_next: jax.Array,
             break_even_N: jax.Array | None = None) -> jax.Array:
    if break_even_N is None:
      price = control.break_even(k, self.costs, self.draft_cost)
    else:
      price = break_even_N[k + 1]
    return control.batch_below_break_even(a_B, price)


@dataclasses.dataclass(frozen=True)
class Fixed(Plain):
  """"fixed:k" (tests): every cycle verifies k drafts, through the bucket machinery."""
  k: int = 0

  @property
  def buckets(self) -> tuple[int, ...]:
    return control.verify_buckets(self.block_size)

  def choose(self, draft_logits_BkV, draft_Bk, active_B) -> tuple[jax.Array, jax.Array]:
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

  def choose(self, draft_logits_BkV, draft_Bk, active_B) -> tuple[jax.Array, jax.Array]:
    cost_K = control.bucket_costs(self.block_size, self.costs, self.draft_cost)
    p_Bk = control.calibrated(control.drafted_probs(draft_logits_BkV, draft_Bk),
                              self.calibration)
    return control.choose(p_Bk, active_B, self.buckets, cost_K,
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
                  draft_cost=opts.controller_draft_cost)
  if name == "confidence":
    return Confidence(b, cap=opts.ar_fallback, accept=opts.ar_fallback_accept,
                      poor_miss=opts.controller_poor_miss, costs=opts.controller_costs,
                      draft_cost=opts.controller_draft_cost,
                      calibration=opts.controller_calibration)
  if name == "backoff" and opts.ar_fallback > 0:
    return Backoff(b, cap=opts.ar_fallback, accept=opts.ar_fallback_accept)
  return Plain(b)
