"""What the priced controller has seen of the drafts (`LoopState.evidence_7`), and its back-off
gate (`LoopOptions.controller_persist`): the rows take AR steps after a miss only while misses
persist.

The evidence is one [7] float32 vector, a runtime value that the engine carries from loop call
to loop call and from request to request (`Engine.evidence_state`): entries DECLINE hold the
decline's (`decline.empty_state`), entries PERSIST the gate's, below.

A miss (a cycle that committed fewer tokens than it cost, `controller.batch_below_break_even`)
backs the rows off 2, 4, 8, ... AR steps, a bet that the cycles right after it would miss too.
On text whose hard stretches span several cycles the bet pays: on the demo's teacher-forced
HumanEval acceptances at b = 16, a cycle right after a miss (a cycle committing under 2.25
tokens) commits 2.0 tokens where cycles commit 3.6-3.9 on average. Where one cycle's acceptance
says nothing of the next it is a pure loss: the same acceptances drawn independently made the
back-off 0.80-0.93x of verifying every cycle at five cost tables (`benchmarks/decline_replay.py
--iid`, docs/results/controller.md). On an H100 at batch 4-16, with simulated drafts whose
acceptances are independent by construction, the default ran 0.90-0.91x of the paper's loop
(docs/results/accelerator.md): most of its misses fell in its batches' tails, where a few rows
decode and each AR step costs a whole batch's forward.

So the gate measures the bet: decayed, the row-cycles verified right after a miss of that row
(its own last full cycle committed less than its price, `row_missed`; in a batch, whether or not
the batch backed off) and the tokens they committed, and all verified row-cycles and theirs.
After a miss the rows back off only while a cycle after a miss commits less than PERSIST_RATIO
of what cycles commit overall (its estimate starting from PRIOR_ROWS row-cycles of one token
each, so that an engine backs off until its cycles say otherwise), or while cycles commit less
than their price on average (`cycles_lose`): then the next cycle is expected to lose whether
misses persist or not. Without that second condition the gate lifted the back-off where every
cycle loses and acceptances are independent (T = 1 on the demo's CPU: τ 2.15 at b = 8 against a
cycle priced ~4.6 AR steps), and each request that drafted (the first ones, every 4th explorer)
drafted every cycle at about half AR's speed: the default at batch 1, T = 1 read 0.53x and 0.82x
AR in two runs (docs/results/controller.md), where it had read 0.975-0.99x before the gate. A
gated miss still counts as a miss (the row's `LoopState.missed_B`): the row's next full cycle is
one after it, and the gate's next evidence.

While the rows back off, the cycle after a miss runs after the AR steps and commits more than it
would have right after the miss, so the estimate leans towards lifting the back-off; where misses
persist, the cycles that follow once it is lifted bring it back. In the replay (b = 16, both
halves, five cost tables) the gate left the back-off as it was on the real acceptances (all 10
rows: the same AR steps, the same tokens per unit cost) and took the independent ones from
0.80-0.93x to 0.95-1.01x of verifying every cycle. Two rules tried first in the same replay (cap
16, `/tmp/s39/gate.py`) lost on the real acceptances: PERSIST_RATIO 0.8 up to 3.6% of the
back-off on two rows, and comparing the cycles after misses with the cycle's price instead of
the mean up to 3.5% at an accelerator's prices (those cycles ran after the AR steps).

Where a cycle is cheap (an accelerator's: a b = 16 cycle priced 1.6-2.5 AR steps against the
6 tokens it commits), misses may persist against the mean and the cycles after them still pay
for themselves several times over: the AR steps of the back-off then lose whatever the
acceptances' runs. So a miss backs off nothing where a row-cycle right after a miss is
estimated to commit at least PAYS_MULTIPLE times the full cycle's price (`pays_after_miss`;
the estimate is `persists`' own, prior included, so an engine that has seen nothing still
backs off). The margin of 3 covers the bias above (post-miss cycles measured after the AR
steps commit more than they would right after the miss): in the replay of the demo's
teacher-forced acceptances (`benchmarks/decline_replay.py --iid`, both halves, b = 16 and 8,
accelerator and CPU prices, `--pays_multiples`; docs/results/controller.md) a margin of 1.5
lost up to 4.2% on the real acceptances, 2 up to 0.55%, 3 at most 0.11%, while on independent
acceptances at an accelerator's prices 3 gained 1.7% on average and up to 11.8% over the gate
without the test. On a CPU, where a b = 8 cycle costs 2.7 AR steps or more, 3 prices exceed
the 8 tokens a cycle can commit and the test never lifts the back-off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding import decline

SIZE = 7
DECLINE = slice(0, 3)  # `decline.empty_state`'s entries
PERSIST = slice(3, 7)  # post-miss row-cycles, their tokens; all row-cycles, their tokens
# The estimate of a post-miss cycle's tokens starts as this many row-cycles of one token each.
PRIOR_ROWS = 2.0
PRIOR_TOKENS = 1.0
# A post-miss cycle must commit less than this share of the overall mean for misses to persist.
PERSIST_RATIO = 0.9
# A post-miss cycle that commits at least this many times a full cycle's price lifts the
# back-off, misses persisting or not (`pays_after_miss`; module doc).
PAYS_MULTIPLE = 3.0
# The weight the evidence keeps per cycle of its kind after it (about the last 100 count).
FORGET = decline.EVIDENCE_FORGET


def empty_state() -> np.ndarray:
  """[SIZE] float32: nothing seen."""
  return np.zeros((SIZE,), np.float32)


def after_miss_tokens(state_7: jax.Array) -> jax.Array:
  """[] float32: the estimate of what a row-cycle right after a miss commits (its prior of
  PRIOR_ROWS row-cycles of PRIOR_TOKENS each, then the decayed post-miss cycles seen)."""
  after_rows, after_tokens = state_7[PERSIST][0], state_7[PERSIST][1]
  return (PRIOR_ROWS * PRIOR_TOKENS + after_tokens) / (PRIOR_ROWS + after_rows)


def persists(state_7: jax.Array) -> jax.Array:
  """[] bool: whether cycles right after a miss commit less than PERSIST_RATIO of the mean
  (module doc): the rows back off after a miss. True before any cycle was seen."""
  rows, tokens = state_7[PERSIST][2], state_7[PERSIST][3]
  return (rows <= 0) | (after_miss_tokens(state_7) < PERSIST_RATIO * tokens
                        / jnp.maximum(rows, 1e-6))


def pays_after_miss(state_7: jax.Array, price: jax.Array | float,
                    multiple: float = PAYS_MULTIPLE) -> jax.Array:
  """[] bool: whether a row-cycle right after a miss commits at least `multiple` times `price`
  (a full cycle's break-even in AR steps; module doc): then a miss backs off nothing, misses
  persisting or not. Never before the post-miss cycles outweigh the prior (1 token < price)."""
  return after_miss_tokens(state_7) >= multiple * jnp.asarray(price, jnp.float32)


def cycles_lose(state_7: jax.Array, price: jax.Array | float) -> jax.Array:
  """[] bool: whether a row-cycle commits fewer tokens on average than `price` (a full cycle's
  break-even in AR steps). Then every miss backs off, misses persisting or not: where one
  cycle's acceptance says nothing of the next, the next is expected to commit the mean, and
  that loses to AR steps. False before any cycle was seen."""
  rows, tokens = state_7[PERSIST][2], state_7[PERSIST][3]
  return (rows > 0) & (tokens < jnp.asarray(price, jnp.float32) * rows)


def backs_off(state_7: jax.Array, price: jax.Array | float,
              pays_multiple: float = PAYS_MULTIPLE) -> jax.Array:
  """[] bool: whether a miss backs the rows off: misses persist (`persists`) and the cycles
  after them do not clearly pay (`pays_after_miss` at `pays_multiple`; math.inf: never, the
  rule before it), or cycles lose on average at `price` (`cycles_lose`)."""
  return ((persists(state_7) & ~pays_after_miss(state_7, price, pays_multiple))
          | cycles_lose(state_7, price))


def observed(state_7: jax.Array, k: int, block_size: int, a_B: jax.Array,
             after_miss_B: jax.Array) -> jax.Array:
  """[SIZE] the gate's evidence after a cycle that verified k drafts; `after_miss_B` ([B] bool,
  or one [] bool for every row): the rows whose own last full cycle was a miss (`row_missed`).
  A cycle that verified all its drafts adds its committing rows (a_B >= 0) and their tokens,
  a_B + 1, to all cycles' and, those of them after a miss, to the post-miss cycles' (each kind
  forgetting FORGET of its older weight, where the cycle adds rows to it); a declined cycle
  (k = 0) tells nothing."""
  if k != block_size - 1:
    return state_7
  seen_B = a_B >= 0
  after_B = seen_B & after_miss_B
  count = lambda rows_B: jnp.stack([jnp.sum(rows_B), jnp.sum(jnp.where(rows_B, a_B + 1, 0))]
                                   ).astype(jnp.float32)
  old = state_7[PERSIST]
  after_rows_tokens, rows_tokens = count(after_B), count(seen_B)
  after = jnp.where(after_rows_tokens[0] > 0, FORGET * old[:2] + after_rows_tokens, old[:2])
  every = jnp.where(rows_tokens[0] > 0, FORGET * old[2:] + rows_tokens, old[2:])
  return state_7.at[PERSIST].set(jnp.concatenate([after, every]))


def row_missed(missed_B: jax.Array, k: int, block_size: int, a_B: jax.Array,
               price: jax.Array | float) -> jax.Array:
  """[B] bool each row's own miss after a cycle that verified k drafts: for a cycle that
  verified all of them, whether a committing row (a_B >= 0) committed fewer tokens, a_B + 1,
  than `price` (the cycle's break-even in AR steps); other rows, and every row after a cycle
  that verified fewer drafts (a decline), keep `missed_B`. What `observed` reads as "after a
  miss" at the row's next full cycle."""
  if k != block_size - 1:
    return missed_B
  return jnp.where(a_B >= 0, (a_B + 1).astype(jnp.float32) < price, missed_B)
