"""The priced controller's decline (`LoopOptions.controller_decline`): after the drafter pass, a
cycle verifies none of its drafts when they are not expected to pay for their verify.

The drafter pass is paid once it ran; what is left to choose is the target forward. Verifying
the b-1 drafts costs `verify_price` = V(b) / V(1) AR steps (a target forward over b tokens
against one over a single token, the drafter pass not counted) and commits 1 + A tokens, A the
accepted drafts. Verifying none of them (k = 0: a forward over the bonus token alone, the AR
step's own draw) costs one AR step and commits one token. So the cycle verifies its drafts when
1 + E[A] >= verify_price, and declines them otherwise; a declined cycle is a miss of the
priced back-off (it commits 1 token against its full price), so the rows then take AR steps.

E[A] comes from the drafter's own probability p_i of each drafted token (softmax; the argmax's
under `exact`, or the calibrated rate with `controller_calibration`): sum_j prod_{i<=j} p_i,
scaled by how many drafts were really accepted per expected one over the recent verified
cycles (the state `evidence_7`, kept in the loop state and across calls by the engine). A
drafter whose probabilities understate its acceptance (the demo's: p 0.45 accepts 61%) or
overstate it is thus read at its measured rate; before `EVIDENCE_ROWS` row-cycles have been
seen no cycle declines, so a drafter is never judged on probabilities nothing has checked.

A cycle declines only while the batch's back-off is at most `MAX_DECLINE_LEVEL` misses deep:
the probe after a longer run of AR steps verifies its drafts whatever they promise. Only
verified cycles measure the acceptance, and only they tell the engine's online costs what a
full cycle costs now (`online_costs`). With probes declined too, a test that made cycles
dearer (4.5 AR steps) and then cheap again (1.2) on the toy drafter, whose probabilities are
the same for every draft, left the estimate at 3.0 after 8 cheap requests (requests starting
deep in the back-off, where every cycle was a probe); bounded, at 3.6, and without the decline
at 1.2 (`/tmp/s36/oc.py`): a price that rose comes down more slowly while cycles decline. Each
decline is a miss, so at most two cycles in a row decline, and after them the rows back off 2
and then 4 AR steps.

A batch decides once for all its rows, by its decoding rows' sum against their number times
the price, as the priced miss does (`controller.batch_below_break_even`).

Replay on the demo (`benchmarks/decline_replay.py`: 82 HumanEval eval-half prompts and 82
labelling-half ones, teacher-forced acceptances and drafter probabilities per position, the
priced back-off simulated at given costs; docs/results/controller.md): with the decline,
0.4-1.6% more tokens per unit cost at three cost tables of this CPU's kind (a cycle of b = 8
costing 3.8-4.1 AR steps), 0.3-1.6% with the demo's calibration; at an accelerator's (1.5 AR
steps) 0.1% fewer to none with raw p (9-24 of ~1730 cycles declined), none declined with the
calibration. The per-cycle oracle is ~1.2x the back-off: most of what the back-off leaves is
not visible in the drafter's probabilities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Row-cycles of evidence (decayed) before a cycle may decline its drafts.
EVIDENCE_ROWS = 16.0
# The deepest back-off level (consecutive misses) at which a cycle may still decline. A first
# replay of the same kind (/tmp/s36/sim_decline.py, raw p, both halves) read +0.7-1.8% at 1 at
# this CPU's prices and -0.1% at an accelerator's; +0.5-1.1% at 0 (no probe declines);
# +1.4-2.8% unbounded, whose declined probes starve the online costs.
MAX_DECLINE_LEVEL = 1
# The weight the evidence keeps per verified cycle after it: about the last 100 cycles count.
EVIDENCE_FORGET = 0.99


def empty_state() -> np.ndarray:
  """[3] float32 the decline's evidence (`LoopState.evidence_7`): decayed row-cycles, expected
  accepted drafts and accepted drafts of the cycles that verified all their drafts; none."""
  return np.zeros((3,), np.float32)


def expected_accepted(p_Bk: jax.Array) -> jax.Array:
  """[B] E[A] = sum_j prod_{i<=j} p_i: drafts a row accepts in expectation if all are verified."""
  return jnp.sum(jnp.cumprod(p_Bk.astype(jnp.float32), axis=-1), axis=-1)


def verify_price(block_size: int, break_even_N: jax.Array) -> jax.Array:
  """[] float32 the verify of a full cycle (b tokens) in AR steps, the drafter pass not
  counted, from the loop state's runtime break-even (`LoopState.break_even_N`: entry n = draft
  pass + forward over n tokens, in AR steps; entry 1 = draft pass + one AR step)."""
  return break_even_N[block_size] - break_even_N[1] + 1.0


def declines(expected_B: jax.Array, active_B: jax.Array, price: jax.Array | float,
             state_3: jax.Array, level: jax.Array | int) -> jax.Array:
  """[] bool: whether the batch's cycle verifies none of its drafts (module doc); `level`: the
  batch's back-off level (its decoding rows' deepest `LoopState.misses_B`)."""
  rows_seen, predicted, accepted = state_3[0], state_3[1], state_3[2]
  scale = accepted / jnp.maximum(predicted, 1e-6)
  rows = jnp.sum(active_B).astype(jnp.float32)
  tokens = jnp.sum(jnp.where(active_B, 1.0 + scale * expected_B, 0.0))
  return ((rows_seen >= EVIDENCE_ROWS) & (jnp.asarray(level) <= MAX_DECLINE_LEVEL) & (rows > 0)
          & (tokens < jnp.asarray(price) * rows))


def observed(state_3: jax.Array, k: int, block_size: int, expected_B: jax.Array,
             a_B: jax.Array) -> jax.Array:
  """[3] the evidence after a cycle that verified k drafts: when it verified all of them
  (k = b - 1), each row that committed (a_B >= 0) adds one row-cycle, its expected and its
  accepted drafts, and the older evidence keeps EVIDENCE_FORGET of its weight; a declined
  cycle (k = 0) tells nothing of the acceptance."""
  if k != block_size - 1:
    return state_3
  seen_B = a_B >= 0
  add = jnp.stack([jnp.sum(seen_B).astype(jnp.float32),
                   jnp.sum(jnp.where(seen_B, expected_B, 0.0)),
                   jnp.sum(jnp.where(seen_B, a_B, 0)).astype(jnp.float32)])
  return jnp.where(jnp.any(seen_B), EVIDENCE_FORGET * state_3 + add, state_3)
