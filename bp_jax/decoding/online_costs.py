"""The priced controller's costs kept current from the loop calls the engine already times.

The start-up costs (`costs.forward_costs`: isolated forwards, timed once) underprice a real cycle
and drift with the machine's load. Every loop call returns to the host with its wall time and
with the number of target forwards it ran of each kind (`LoopState.forward_counts_N`: entry 0
counts AR steps, entry n > 0 cycles whose forward verified n tokens, i.e. n - 1 drafts after a
drafter pass). A call is one observation

    seconds = sum_n counts_N[n] * secs_N[n]

of the per-forward seconds `secs_N` (a call's fixed cost, building its state and converting
caches, is spread over its forwards: small beside a real model's forwards; a free overhead term
made the fit unstable, as the calls of a run run similar numbers of forwards). `OnlineCosts`
keeps, per batch size (`rows`: the loop state's slots), an
exponentially forgetting least-squares fit of them (`forget`: the weight each older call keeps
per newer one; 0.8), whence the controller's break-even: a cycle verifying n tokens costs `secs_N[n] / secs_N[0]` AR steps.

An AR step's price is learned only from calls that ran AR steps. Where cycles keep paying, no
cycle is a miss, no AR step runs, and the fit keeps whatever ratio it last had: if that is the
floor (a cycle "costs" one AR step), nothing can raise it again. A batch takes AR steps only
while every row asks for them, so its calls often run none: the engine bounds a batch's
break-even below by the start-up prior (`batch_prior_floor` 1; every batched fit measured on the
demo settled above it, at 3.6-5 against 2.8-3.1, except one that sank to the floor, at batch 4).
One request backs off after every miss, so its calls keep running AR steps; its fit is
bounded only at half the prior (`one_prior_floor` 0.5: at T = 0 on the demo it settled at 2.5
AR steps per cycle against a start-up 4.8 and ran as fast as back-off; bounded at 4.8 it ran 4%
slower than back-off, in another run), and its AR step at the plain AR loop's step while that
loop was timed lately (`one_plain_floor`, `PLAIN_FLOOR_CALLS`, `break_even`): its calls mix
their forwards in like proportions, and within their noise the fit moved time from AR steps to
cycles. That lower bound is for a VM whose speed moves by a third between calls: a call slower
than the ones before prices the AR step above what the older calls took in all, their cycles
near zero, and the break-even fell to 1 (every cycle then pays: batch 1, T = 1, the next
requests drafted every cycle; /tmp/s30/fit.py).

A change of the costs shows as calls the estimate mispredicts, all the same way: after
`restart_calls` (2) such calls in a row, each off by more than `restart_error` (20%), the calls
before them keep only `RESTART_WEIGHT` of their weight, so a change is followed within two or
three calls. One mispredicted call is not a change: on a VM whose speed moves by a quarter from
request to request, restarting on every such call (with forget 0.6) left the estimate to the last
call or two, and one run's break-even ranged 3.1-32 AR steps (5-95%) against ~4.2 measured in
one process (`/tmp/s31/fitab.py`; now 2.9-9.3).

A batch's call off alone is held out of its fit (`hold_outliers`; "held" below): a batch's
calls run few AR steps (0-3 among 10-30 cycles on an H200 at Qwen3-4B shapes, batch 4), so its
fit barely tells an AR step's price from a cycle's, and one call 0.15 s slow among calls of
~0.1 s, fitted at once, sent the break-even of a cycle priced 1.56 AR steps to the cap, where
every cycle is a miss and the rows back off (tests/test_online_costs.py; in a run simulated at
that device's batch-4 prices with such a stall every 6th call, 146 batch AR steps against 10
held, docs/results/accelerator.md; the device run's own extra AR steps came mostly from an AR
step fitted too cheap, bounded in `break_even`). The held call waits for the next call that
ran every kind of forward it ran: off the same way, the two are a change and the fit restarts
on them; otherwise (within the bar, or off the other way) the held call is dropped. At most
every other call is held, and none before the fit has `min_calls` calls since it began or last
restarted. One request's calls are held only where they would price the AR step at or below
zero. They back off after every miss and run many AR steps, so its fit tells the two prices
apart, and they were fitted at once; but one call three
times slower than its like (16 cycles and 2 AR steps in 310 ms among calls of ~70 ms, in a slow
spell of the 2-core Xeon VM, model 207) priced the AR step below zero, and the learned default's
price of a b = 8 cycle stood at 8.5-14 AR steps (3-5 before; replayed) for the rest of its batch-1
run: its requests went plain, and no cycle ran that could correct it (0.90x b = 8's decode
speed over that run; docs/cpu_amx/fit_spike_2026-12-07). A fit that prices the AR step at or
below zero keeps its previous shape on the calls' scale instead (`_Fit.update`); floored, it
had sent every cycle to the cap.

One call gives one equation for several unknowns, and calls of a run often mix their forwards in
about the same proportion (or run one kind only), so the fit is regularized toward the previous
estimate scaled to the data (a random-walk prior): a direction the calls do not tell apart keeps
its previous ratio (at first the start-up costs' ratio) while the overall scale follows the
measured time; a direction they do tell apart follows the data. The break-even of each verify
length is clipped to [`min_break_even`, `max_break_even_per_token` * n]. A cycle that the fit
puts below its floor (`min_break_even`, or the batch's floor `batch_prior_floor` x its prior) is
held at it within the fit (`_Fit._within_bounds`: the least-squares fit under that bound), so
its seconds stay what the calls timed; one above the cap is moved down to it. A call that ran no
forward or reports a non-positive or non-finite time is not an observation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from bp_jax.errors import BadInputError

def _check_positive(value: float, name: str, upper: float | None = None) -> float:
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise BadInputError(f"{name}={value!r}: expected a number") from None
  if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
    bound = f" and <= {upper}" if upper is not None else ""
    raise BadInputError(f"{name}={value!r}: expected a number > 0{bound}")
  return value


def _call_seconds(seconds: float) -> float | None:
  """A loop call's wall time as an observation: None where it is not positive and finite."""
  seconds = float(seconds)
  return seconds if math.isfinite(seconds) and seconds > 0 else None


def _check_count(value: int, name: str) -> int:
  """A whole number >= 1 (not a bool), else a BadInputError naming `name`."""
  if isinstance(value, bool) or int(value) != value or value < 1:
    raise BadInputError(f"{name}={value!r}: expected a whole number >= 1")
  return int(value)


def _check_floor(value: float, name: str) -> float:
  value = float(value)
  if not math.isfinite(value) or value < 0:
    raise BadInputError(f"{name}={value!r}: expected a number >= 0")
  return value


@dataclasses.dataclass(frozen=True)
class CostEstimate:
  """One batch size's current estimate: seconds per AR step and per cycle of each verify length
  n seen (None before `OnlineCosts.min_calls` observations: the prior prices), each cycle's
  break-even in AR steps (the priced controller's threshold) and the calls it has seen; the
  plain AR loop's seconds per step at this batch size (None: none timed) and what a new
  request weighs drafting against (`OnlineCosts.start_break_even`)."""
  rows: int
  calls: int
  ar_step_s: float | None
  cycle_s: dict[int, float]
  break_even: dict[int, float]
  plain_step_s: float | None = None
  start_break_even: dict[int, float] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return {"rows": self.rows, "calls": self.calls, "ar_step_s": self.ar_step_s,
            "cycle_s": {str(n): s for n, s in self.cycle_s.items()},
            "break_even": {str(n): round(b, 4) for n, b in self.break_even.items()},
            "plain_step_s": self.plain_step_s,
            "start_break_even": {str(n): round(b, 4) for n, b in self.start_break_even.items()}}


class _Fit:
  """The forgetting least-squares fit of one batch size (see the module doc)."""

  def __init__(self, prior: Callable[[int], float], min_calls: int, hold: bool,
               hold_any: bool = True, early_shape: bool = False):
    self.prior = lambda n: 1.0 if n == 0 else float(prior(n))  # an AR step is the unit
    self.min_calls = min_calls  # calls before the fit prices (`OnlineCosts.min_calls`)
    # Whether the fit's first `EARLY_CALLS` calls keep the current shape where they would price
    # the AR step under `EARLY_STEP_SHARE` of it (one request's; see `EARLY_CALLS`).
    self.early_shape = early_shape
    self.hold = hold  # whether a call off alone is held (module doc)
    # Whether any call off alone is held (a batch's); else only one that, fitted, would price
    # the AR step at or below zero (one request's: a stall, `_prices_no_step`).
    self.hold_any = hold_any
    self.lengths: list[int] = [0]                 # verify lengths with a parameter, in order
    self.A = np.zeros((1, 1))                     # sum of forget^age x x^T
    self.b = np.zeros(1)                          # sum of forget^age x y
    self.theta: np.ndarray | None = None          # seconds per forward of each length
    self.calls = 0
    # The last calls (at most `restart_calls`): the sums before each, its counts and seconds,
    # and whether the estimate mispredicted it (+1 slower, -1 faster, 0 within the error).
    self.recent: list[tuple[np.ndarray, np.ndarray, Mapping[int, int], float, int]] = []
    # A call off alone, held out of the fit (`update`; module doc), as a `recent` entry; None: none.
    self.held: tuple | None = None
    self.since_restart = 0  # calls fitted since the fit began or last restarted
    self.calls_with: dict[int, int] = {}  # verify length -> fitted calls that ran it
    # The long-memory sums of the fitted calls' relative equations (x / seconds against 1,
    # forgetting `SHAPE_FORGET` per call, never restarted): the lengths' prices relative to one
    # another (`size_ratios`), which a policy weighs sizes by.
    self.shape_A = np.zeros((1, 1))
    self.shape_b = np.zeros(1)
    self.noise = 0.0  # mean relative misprediction of the calls that were not off (`update`)

  @property
  def pricing(self) -> bool:
    """Whether the fit prices cycles: it has an estimate from at least `min_calls` calls."""
    return self.theta is not None and self.calls >= self.min_calls

  def _grow(self, n: int) -> None:
    """Adds verify length n as a parameter: its prior ratio to an AR step, on the current scale."""
    self.lengths.append(n)
    self.A = np.pad(self.A, ((0, 1), (0, 1)))
    self.b = np.pad(self.b, (0, 1))
    self.shape_A = np.pad(self.shape_A, ((0, 1), (0, 1)))
    self.shape_b = np.pad(self.shape_b, (0, 1))
    if self.theta is not None:
      self.theta = np.append(self.theta, self.theta[0] * self.prior(n))

  def ratios(self) -> np.ndarray:
    """[L] the current estimate's shape (any scale): the fit when there is one, else the
    prior's AR steps."""
    if self.theta is not None:
      return self.theta
    return np.asarray([self.prior(n) for n in self.lengths])

  def update(self, seconds: float, counts: Mapping[int, int], forget: float, ridge: float,
             clip: Callable[[int, float], float], restart_error: float,
             restart_calls: int) -> None:
    for n in sorted(counts):
      if n not in self.lengths:
        self._grow(n)
    x = self._x(counts)
    error = 0.0 if self.theta is None else (seconds - float(x @ self.theta)) / seconds
    off = abs(error) > max(restart_error, NOISE_MULTIPLE * self.noise)
    if self.theta is not None and not off:  # the machine's own call-to-call noise
      self.noise += NOISE_WEIGHT * (abs(error) - self.noise)
    call = (self.A, self.b, counts, seconds, int(np.sign(error)) if off else 0)
    self.calls += 1
    held, self.held = self.held, None
    if held is not None and not _tests(counts, held[2]):
      self.held = held  # this call says nothing of the held one's forwards: it stays held
    elif held is not None and call[4] == held[4]:
      self.recent = [held]  # the next call like it is off the same way: a change (below)
    elif (held is None and off and self.hold and restart_calls > 1
          and self.since_restart >= self.min_calls
          and (self.hold_any or self._prices_no_step(x, seconds, forget, ridge))):
      self.held = call  # off alone, so far: not fitted until a call like it says (module doc)
      return
    self.recent = (self.recent + [call])[-restart_calls:]
    for n, c in counts.items():
      if c > 0:
        self.calls_with[n] = self.calls_with.get(n, 0) + 1
    self.A = forget * self.A + np.outer(x, x)
    self.b = forget * self.b + x * seconds
    relative = x / seconds
    self.shape_A = SHAPE_FORGET * self.shape_A + np.outer(relative, relative)
    self.shape_b = SHAPE_FORGET * self.shape_b + relative
    self.since_restart += 1
    if len(self.recent) == restart_calls and abs(sum(c[4] for c in self.recent)) == restart_calls:
      self._restart(forget)
    theta, prior, M, rhs = self._solved(self.A, self.b, x, seconds, ridge)
    if (self.early_shape and self.calls <= EARLY_CALLS
        and not theta[0] > EARLY_STEP_SHARE * prior[0]):
      theta = prior  # a young fit's few, alike calls: the shape on their scale (`EARLY_CALLS`)
    if np.all(np.isfinite(theta)) and theta[0] > 0:
      theta = self._within_bounds(M, rhs, theta, clip)
    if not (np.all(np.isfinite(theta)) and theta[0] > 0):  # no AR step priced: the last shape
      theta = prior  # on the calls' scale (an AR step floored near 0 put every cycle at the cap)
    # Calls that disagree (the costs changed) may fit a cost <= 0: floored, then clipped below.
    theta = np.maximum(theta, 1e-3 * prior)
    for i, n in enumerate(self.lengths[1:], start=1):  # each cycle within bounds of an AR step
      theta[i] = theta[0] * clip(n, theta[i] / theta[0])
    self.theta = theta

  def _solved(self, A: np.ndarray, b: np.ndarray, x: np.ndarray, seconds: float, ridge: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the free fit to the sums `A`, `b`, regularized toward the current shape on their scale;
    that anchor; the system's matrix and right-hand side). `x`, `seconds`: the newest call, whose
    own seconds per forward set the scale where the sums give none."""
    r = self.ratios()
    rAr = float(r @ A @ r)
    scale = float(b @ r) / rAr if rAr > 0 else 0.0
    prior = scale * r
    if not prior[0] > 0:  # no usable scale: this call's own seconds per forward
      prior = r * seconds / float(x @ r)
    R = _ridge(A, ridge)
    M, rhs = A + R, b + R @ prior
    return np.linalg.solve(M, rhs), prior, M, rhs

  def _prices_no_step(self, x: np.ndarray, seconds: float, forget: float, ridge: float) -> bool:
    """Whether fitting this call (forwards `x`, `seconds`) would price the AR step at or below
    zero: a call that only a cycle dearer than every call before it explains, as a stall's does
    (one request, 16 cycles and 2 AR steps in 310 ms among calls of ~70 ms)."""
    theta = self._solved(forget * self.A + np.outer(x, x), forget * self.b + x * seconds, x,
                         seconds, ridge)[0]
    return not (np.all(np.isfinite(theta)) and theta[0] > 0)

  def _within_bounds(self, M: np.ndarray, rhs: np.ndarray, theta: np.ndarray,
                     clip: Callable[[int, float], float]) -> np.ndarray:
    """The fit `theta` (minimizing theta^T M theta - 2 theta^T rhs) refitted with each cycle
    whose break-even falls below `clip`'s floor held at the floor times the AR step: the
    least-squares fit under that bound, not the free fit's cycle moved up to it.

    Moving the cycle alone (as the clip after this does for the cap) ratcheted a batch's
    prices up: where the bound binds, calls of cycles alone that ran a few percent cheaper
    than the mixed calls before them lowered the free fit's cycle and so raised its AR step
    (the older mixed calls' seconds still to explain), and the cycle, moved up to the bound
    times that step, priced above every call that timed it. An H200's simulated clock, batch
    8, T = 1: 5.53 ms per cycle charged, 5.2-5.5 ms timed, 6.22 ms fitted after four such
    calls; the start rule then priced drafting at 1.78 plain steps against 1.58 and a server
    decoded every request plain (docs/cpu_xeon167/arrivals_2026-12-06). Held at the floor,
    the calls of cycles alone set the cycle and the AR step follows it down (the fitted cycle
    of 12 simulated H200 runs at batch 4, the true price at the floor: within 2.5% of it,
    against up to 27% above before; tests/test_online_costs.py).

    The cap keeps the plain clip: a free fit above it has an AR step sunk toward zero, and
    held at the cap one request's fit followed cycles turned 2.5x cheaper a call later (the
    cycle stayed where the older calls put it while the AR step fell)."""
    bounded = {}
    for i, n in enumerate(self.lengths[1:], start=1):
      ratio = theta[i] / theta[0]
      bound = clip(n, ratio)
      if bound > ratio:
        bounded[i] = bound
    if not bounded:
      return theta
    free = [i for i in range(len(theta)) if i not in bounded]  # free[0] is the AR step
    T = np.zeros((len(theta), len(free)))
    for j, i in enumerate(free):
      T[i, j] = 1.0
    for i, bound in bounded.items():
      T[i, 0] = bound
    try:
      return T @ np.linalg.solve(T.T @ M @ T, T.T @ rhs)
    except np.linalg.LinAlgError:
      return theta

  def cycle_seconds_at(self, n: int, step_s: float, ridge: float) -> float | None:
    """The seconds of a cycle verifying n tokens refitted to the same calls with the AR step's
    held at `step_s` (its column moved to the data side; regularized toward the current
    estimate as `update` is); None where `seconds(n)` is."""
    if self.seconds(n) is None:
      return None
    A_cc, current = self.A[1:, 1:], self.theta[1:]  # the cycles' parameters (0: the AR step)
    R = _ridge(A_cc, ridge)
    theta = np.linalg.solve(A_cc + R, self.b[1:] - self.A[1:, 0] * step_s + R @ current)
    if not np.all(np.isfinite(theta)):
      return None
    i = self.lengths.index(n) - 1
    return float(max(theta[i], 1e-3 * current[i]))

  def size_ratios(self, ref: int) -> dict[int, float]:
    """{verify length n: a cycle verifying n tokens over one verifying `ref`, in seconds}, from
    every call the fit took (the long-memory sums: `SHAPE_FORGET`, weighted by each call's own
    time, so a slow spell weighs no more than a quick one), one solve for every length; a
    length the calls do not tell (a ratio not positive and finite) is left out, and every one
    where `ref` was never run."""
    if ref not in self.lengths:
      return {}
    try:
      theta = np.linalg.solve(self.shape_A + _ridge(self.shape_A, SHAPE_RIDGE), self.shape_b)
    except np.linalg.LinAlgError:
      return {}
    bottom = theta[self.lengths.index(ref)]
    if not (bottom > 0 and math.isfinite(bottom)):
      return {}
    return {n: float(t / bottom) for n, t in zip(self.lengths, theta)
            if t > 0 and math.isfinite(t / bottom)}

  def _x(self, counts: Mapping[int, int]) -> np.ndarray:
    x = np.zeros(len(self.lengths))
    for n, c in counts.items():
      x[self.lengths.index(n)] = c
    return x

  def _restart(self, forget: float) -> None:
    """The costs changed under the estimate: the last `restart_calls` calls each took more than
    `restart_error` (relative) longer than predicted, or each that much less. The calls before
    them keep `RESTART_WEIGHT` of their weight; the run's own calls keep theirs. One call off is
    not a change: a VM whose speed moves by a third between calls mispredicts single calls
    either way, and restarting on each left the estimate to the last call or two (batch 1,
    T = 0 on the demo: break-even 1.7 to 11 AR steps within 40 requests, against ~4.2 in one
    process)."""
    L = len(self.lengths)
    A0, b0 = self.recent[0][0], self.recent[0][1]
    A = RESTART_WEIGHT * np.pad(A0, ((0, L - len(b0)), (0, L - len(b0))))
    b = RESTART_WEIGHT * np.pad(b0, (0, L - len(b0)))
    for _, _, counts, seconds, _ in self.recent:
      x = self._x(counts)
      A, b = forget * A + np.outer(x, x), forget * b + x * seconds
    self.A, self.b, self.since_restart, self.recent = A, b, len(self.recent), []

  def break_even(self, n: int, clip: Callable[[int, float], float]) -> float:
    seconds = self.seconds(n)
    if seconds is None:
      return clip(n, self.prior(n))
    return clip(n, seconds / float(self.theta[0]))

  def seconds(self, n: int) -> float | None:
    """The fitted seconds of one forward of verify length n (0: an AR step); None before the
    fit prices or for a length it has not seen."""
    if n not in self.lengths or not self.pricing:
      return None
    return float(self.theta[self.lengths.index(n)])


def _ridge(A: np.ndarray, ridge: float) -> np.ndarray:
  """The fit's pull toward its previous estimate for the sums `A`: `ridge` times each
  parameter's own weight, and a tiny multiple of the mean weight (a parameter no call ran)."""
  d = np.diag(A).copy()
  return np.diag(ridge * d + 1e-9 * (float(np.trace(A)) / len(d) + 1.0))


def _tests(counts: Mapping[int, int], held: Mapping[int, int]) -> bool:
  """Whether a call that ran `counts` can confirm or refute a held call that ran `held`: it ran
  every kind of forward the held one ran (a call of AR steps alone says nothing of a cycle's
  price)."""
  return all(counts.get(n, 0) > 0 for n, c in held.items() if c > 0)


# A call is off (a sign of a change) when mispredicted by more than `restart_error` and more
# than NOISE_MULTIPLE x the machine's noise: the mean relative misprediction of the calls that
# were not, forgetting NOISE_WEIGHT per call. On a quiet machine (or the tests' fake clock) the
# noise is ~0 and `restart_error` decides; on a VM whose speed moves by a quarter between calls
# the bar rises to ~50%, above its noise and below the changes that matter (a cycle 2x dearer).
NOISE_MULTIPLE = 2.5
NOISE_WEIGHT = 0.2

# A batch size's fit prices cycles only from its MIN_CALLS-th call on; before, the prior does.
# Two or three calls give as many equations as unknowns, and on a machine whose calls' times
# move by a quarter they fitted an AR step at ~0 and a cycle at the 64-step cap: the sizes a
# batch-16 run's tail shrank to, 1-3 calls each (benchmarks/controllers `--shape tiny`, this CPU;
# docs/results/controller.md).
MIN_CALLS = 3

# One request's fit over its first EARLY_CALLS calls keeps its current shape (the start-up
# costs', on the calls' scale) where a call would price the AR step under EARLY_STEP_SHARE of
# that shape's: its first calls run alike mixes of AR steps and cycles (8 and 21, 8 and 21, 8
# and 21, then 2 and 17), the first of them slower (a loop's first timed call: 96 ms against
# 68-70), and the free fit put the AR step near zero and a b = 8 cycle at the cap, 32 AR steps:
# the next request decoded plain. On the 2-core Xeon (model 207) 7 of 30 batch-1, T = 0 runs'
# prices did so, replayed, at their 3rd-5th speculative call (11.5-32 AR steps against medians
# of 2.2-4.3); kept at the shape, 2.3-7.4 there, and the later calls' prices within 0.18 AR steps
# of the free fit's while it settles (2.2 in one older run's), the same from ~20 calls on
# (docs/cpu_amx/current_2026-12-07/early_fit.txt). Only early: a fit that has seen the calls
# follows a real change of the step's share. A batch's AR step is bounded by its start-up
# forward instead (`OnlineCosts.break_even`).
EARLY_CALLS = 8
EARLY_STEP_SHARE = 0.25

# A verify length that ran in at least this many of a fit's calls weighs against others at its
# price relative to theirs over the fit's calls (`OnlineCosts.size_prices`); rarer ones at the
# start-up costs' shape.
SIZE_PRICE_CALLS = 8

# The weight an older call keeps per newer one in the lengths' relative prices (`_Fit.size_ratios`):
# a half-life of ~140 calls, where the fit's own `forget` (0.8) keeps ~3. The lengths' ratios are a
# property of their programs and move little with the machine's load, while a rare length's own
# fitted price is its last call or two: on the 2-core Xeon (model 207) the learned default's price
# of sizes 9-11 before each call that ran them was 16-28% off their ratio to b = 8 over the whole
# run (median log error, seven batch-1 runs replayed; nearly always under it: they ran where noise
# made them cheap), these ratios 2-8% (docs/cpu_amx/size_prices_2026-12-07).
SHAPE_FORGET = 0.995
# Their pull toward zero, relative to each length's own weight: only what keeps the system solvable.
SHAPE_RIDGE = 1e-6

# The weight older calls keep, beyond `forget`, after a call the estimate mispredicted by more than
# `restart_error`: the calls before a change of the costs would otherwise pin the directions that
# the calls after it do not tell apart (e.g. calls that all run about as many cycles).
RESTART_WEIGHT = 0.05

# One request's AR step is held at the plain AR loop's step (`one_plain_floor`) only while that
# step was timed within this many of its speculative calls: a plain step timed at another moment
# of the machine is no bound. Where every request drafts, no plain call renews it, and one timed
# slow held the step there for the rest of the run: a batch-1 run at T = 0 on the 2-core EPYC VM
# (model 17) timed its one plain call at 1.29 ms a step where the plain loop then ran 0.65 ms,
# and the learned default priced a b = 8 cycle at 2.15 AR steps (median of 491 calls) where its
# calls timed 4.4 of its own AR steps (5.2 plain ones): every request drafted, at 0.93x our AR
# (docs/cpu_epyc/model17_2026-12-08). Unbounded past this many calls, the same calls replayed
# price it at 4.12.
PLAIN_FLOOR_CALLS = 8


class OnlineCosts:
  """Per-forward seconds and the priced controller's break-even, kept current from timed loop
  calls (see the module doc). `prior(n)`: the start-up cost of a cycle verifying n tokens in AR
  steps (`controller.break_even(n - 1, ...)`); `forget` in (0, 1]: the weight an older call keeps
  per newer one (1: never forget); `ridge` > 0: the pull toward the previous estimate, relative
  to the data's own weight; break-evens are clipped to [min_break_even,
  max_break_even_per_token * n], and from below also to `batch_prior_floor` (a batch, rows >
  1) or `one_prior_floor` (one request) times the prior (0: no such bound); `restart_calls`
  calls in a row whose seconds the estimate mispredicts by more than `restart_error` (relative),
  all the same way, mark a change: the calls before them keep only `RESTART_WEIGHT` of their
  weight. `by_prior`: verify lengths the fit does not estimate: each such forward counts as
  prior(n) AR steps, and its break-even stays the prior's (the priced decline's cycles, n = 1,
  a drafter pass and a one-token forward: a few of them among many cycles gave the fit a free
  parameter it could not pin, and one run's break-even of a full cycle rose to 14.9 AR steps
  against 4.0 without them, every request then starting plain; /tmp/b36/B1dec). A batch
  size's break-even is the prior's until its fit has seen `min_calls` calls (`MIN_CALLS`).
  `hold_outliers`: a batch's call off alone is held out of its fit until a call like it
  confirms a change or refutes it (module doc), one request's only where fitting it would price
  the AR step at or below zero (a stall); False: every call fitted at once.
  `one_plain_floor`: one request's AR step costs at least the plain AR loop's step, while that
  loop was timed within its last `PLAIN_FLOOR_CALLS` speculative calls (`break_even`); False:
  the fit's own step."""

  def __init__(self, prior: Callable[[int], float], *, forget: float = 0.8, ridge: float = 0.03,
               min_break_even: float = 1.0, max_break_even_per_token: float = 4.0,
               restart_error: float = 0.2, restart_calls: int = 2,
               batch_prior_floor: float = 0.0, one_prior_floor: float = 0.0,
               by_prior: Sequence[int] = (), min_calls: int = MIN_CALLS,
               hold_outliers: bool = True, one_plain_floor: bool = True,
               size_shape: Callable[[int], float] | None = None):
    # Both are fixed functions of n, read for every length priced (a block-size policy's sizes
    # and the start rule's price: ~40 reads per request): each value is computed once.
    self.prior = functools.cache(prior)
    # The start-up cost of a cycle over n tokens with its own block's drafter pass, where the
    # start-up timed the drafter over several blocks (`size_prices`); None: `prior`.
    self.size_shape = self.prior if size_shape is None else functools.cache(size_shape)
    self.one_plain_floor = bool(one_plain_floor)
    self.hold_outliers = bool(hold_outliers)
    self.min_calls = _check_count(min_calls, "min_calls")
    self.by_prior = frozenset(int(n) for n in by_prior if int(n) > 0)
    self.batch_prior_floor = _check_floor(batch_prior_floor, "batch_prior_floor")
    self.one_prior_floor = _check_floor(one_prior_floor, "one_prior_floor")
    self.forget = _check_positive(forget, "forget", upper=1.0)
    self.ridge = _check_positive(ridge, "ridge")
    self.min_break_even = _check_positive(min_break_even, "min_break_even")
    self.max_break_even_per_token = _check_positive(max_break_even_per_token,
                                                    "max_break_even_per_token")
    self.restart_error = _check_positive(restart_error, "restart_error")
    self.restart_calls = _check_count(restart_calls, "restart_calls")
    self._fits: dict[int, _Fit] = {}
    # Calls taken and floors set so far: what the prices were read at (a reader that saw this
    # version has them all; `Engine.policy_prices` prices a policy's sizes once per version
    # rather than once per request).
    self.version = 0
    # Per batch size: the plain AR loop's seconds and steps, each older call forgotten as in
    # the fits (`observe_plain`).
    self._plain: dict[int, tuple[float, float]] = {}
    # Per batch size: the plain step's seconds when the speculative loop's fit last took a
    # call (None: none timed then), which `start_break_even` divides the cycle's seconds by.
    self._plain_at_fit: dict[int, float | None] = {}
    # Per batch size: speculative calls taken since the plain loop was last timed there
    # (`PLAIN_FLOOR_CALLS`).
    self._calls_since_plain: dict[int, int] = {}
    # Per batch size: the start-up one-token forward's seconds (`set_ar_step_floor`).
    self._ar_step_floor_s: dict[int, float] = {}

  def clip(self, n: int, break_even: float, rows: int = 1,
           prior: Callable[[int], float] | None = None) -> float:
    """`break_even` of a cycle verifying n tokens within [min_break_even (and the floor of
    `rows`: batch_prior_floor or one_prior_floor times prior(n); `prior`: another start-up
    price than the controller's), max_break_even_per_token * n]."""
    share = self.batch_prior_floor if rows > 1 else self.one_prior_floor
    floor = share * float((prior or self.prior)(n)) if n and share else 0.0
    lo = max(self.min_break_even, floor)
    hi = max(lo, self.max_break_even_per_token * max(n, 1))
    return float(min(max(break_even, lo), hi))

  def _clip_of(self, rows: int) -> Callable[[int, float], float]:
    return lambda n, break_even: self.clip(n, break_even, int(rows))

  def _fit(self, rows: int) -> _Fit:
    if rows not in self._fits:
      self._fits[rows] = _Fit(self.prior, self.min_calls, self.hold_outliers, rows > 1,
                              early_shape=rows == 1)
    return self._fits[rows]

  def observe(self, seconds: float, counts_N: Sequence[int] | np.ndarray, rows: int) -> bool:
    """Takes one loop call: its wall `seconds`, `counts_N[n]` target forwards of verify length n
    (0: AR steps) and the loop state's `rows`. False (nothing learned) for a call without
    forwards or without a positive finite time."""
    counts = np.asarray(counts_N)
    if counts.ndim != 1 or np.any(counts < 0):
      raise BadInputError(f"counts_N={counts_N!r}: expected non-negative forward counts per "
                          "verify length")
    if isinstance(rows, bool) or int(rows) != rows or rows < 1:
      raise BadInputError(f"rows={rows!r}: expected a batch size >= 1")
    seconds = _call_seconds(seconds)
    if not counts.sum() or seconds is None:
      return False
    used = {int(n): float(c) for n, c in enumerate(counts) if c and n not in self.by_prior}
    folded = sum(float(counts[n]) * float(self.prior(n)) for n in self.by_prior
                 if n < len(counts) and counts[n])
    if folded:  # AR steps' worth of the forwards priced by the prior
      used[0] = used.get(0, 0.0) + folded
    self._fit(int(rows)).update(seconds, used, self.forget, self.ridge, self._clip_of(rows),
                                self.restart_error, self.restart_calls)
    self._plain_at_fit[int(rows)] = self.plain_step_s(rows)
    self._calls_since_plain[int(rows)] = self._calls_since_plain.get(int(rows), 0) + 1
    self.version += 1
    return True

  def observe_plain(self, seconds: float, steps: int, rows: int) -> bool:
    """Takes one call of the plain AR loop (no drafter) of `rows` slots: its wall `seconds` over
    `steps` AR steps. Kept apart from the speculative loop's fit, whose AR steps also stage the
    drafter's context and cost more (a batch of 8 on the demo's CPU: 4.3 ms against 3.6 ms):
    it prices the plain loop a batch's request may decode in (`start_break_even`). False
    (nothing learned) for a call without steps or without a positive finite time."""
    seconds = _call_seconds(seconds)
    if steps <= 0 or seconds is None:
      return False
    secs, n = self._plain.get(int(rows), (0.0, 0.0))
    self._plain[int(rows)] = (self.forget * secs + seconds, self.forget * n + int(steps))
    self._calls_since_plain[int(rows)] = 0
    self.version += 1
    return True

  def plain_step_s(self, rows: int) -> float | None:
    """Seconds per step of the plain AR loop at batch size `rows` (None: no call seen)."""
    secs, n = self._plain.get(int(rows), (0.0, 0.0))
    return secs / n if n > 0 else None

  def start_break_even(self, n: int, rows: int, forward_prior: bool = False) -> float:
    """What a batch's new request weighs drafting against: a cycle verifying n tokens in steps
    of the plain AR loop at batch size `rows` (a request that does not draft decodes there),
    clipped as `break_even`; the speculative loop's own `break_even` (bounded by the start-up
    one-token forward: `break_even`) until the plain loop has been timed at this batch size.

    The two timings are taken at one moment: the cycle's seconds over the plain step's as it
    stood when the speculative loop's last call was fitted (the plain step's now, if none was
    timed then). A batch that decodes plain renews the plain step with every call and the
    cycle only with its explorer runs, so the cycle's seconds over today's plain step mixed
    two states of the machine: under a second process loading the CPU the plain step got
    11-33% dearer, the stale cycle read that much cheaper in plain steps, and the rule moved
    toward drafting while a cycle's own price, timed in isolation, rose or held (batch 4,
    T = 0 on the demo's CPU: the price fell from 4.3 to 3.4 plain steps, and 13-16 of 82
    requests drafted in load phases at 0.84-0.96x AR, against 2-4 idle;
    `benchmarks/load_shift.py --batch_size 4`). A change of the machine now moves the price
    when a speculative call times the cycle under it.

    `forward_prior`: until the plain loop has been timed at `rows`, the plain step is taken as
    the start-up one-token forward measured at exactly that batch size (`plain_prior_s`), once
    the speculative loop's calls have priced the cycle (`forward_priced`).
    """
    held = self._held_at_plain(n, rows)
    cycle_s = self._fit(int(rows)).seconds(n) if held is None else held[0]
    plain = self._plain_at_fit.get(int(rows)) or self.plain_s(rows, forward_prior)
    if plain is None or cycle_s is None:
      return self.break_even(n, rows)
    return self.clip(n, cycle_s / plain, int(rows))

  def plain_s(self, rows: int, prior: bool = False) -> float | None:
    """Seconds per step of the plain AR loop at batch size `rows` as timed (`plain_step_s`);
    `prior`: else the start-up one-token forward there (`plain_prior_s`). None: neither."""
    step_s = self.plain_step_s(rows)
    return self.plain_prior_s(rows) if step_s is None and prior else step_s

  def plain_prior_s(self, rows: int) -> float | None:
    """The start-up one-token forward's seconds at exactly batch size `rows` (None: none
    measured there): the plain loop's step there until a call times it (`start_break_even`'s
    `forward_prior`). Not a bound either way: the forward reads a mid-cache position over the
    whole cache (`costs.measure_forward_costs`) where the loop's steps attend over their rows'
    window, and the loop samples besides; on the demo's CPU it cost 1.13-1.28x the plain
    loop's step at batch 8 (three runs) and 1.20x at batch 4, so there a price in it errs
    toward drafting by that much."""
    return self._ar_step_floor_s.get(int(rows))

  def forward_priced(self, n: int, rows: int) -> bool:
    """Whether `start_break_even(n, rows, forward_prior=True)` prices a cycle verifying n
    tokens in the start-up forward (`plain_prior_s`) while the plain loop is untimed at `rows`:
    a forward was measured there and the speculative loop's calls have priced the cycle. The
    cycle's seconds must be the loop's own: the start-up costs time forwards alone, and a
    cycle in the loop costs more of them (the demo's CPU at batch 4: 3.66 start-up forwards,
    4.47 plain steps in the loop), so a price from them alone errs toward drafting further
    than the loop's cycle over the forward does (`plain_prior_s`: that errs toward drafting
    too where the forward costs more than the plain step, 13-28% at batch 8 on that CPU)."""
    return (self.plain_prior_s(rows) is not None
            and self._fit(int(rows)).seconds(int(n)) is not None)

  def set_ar_step_floor(self, seconds: float, rows: int) -> None:
    """The start-up one-token forward's `seconds` at batch size `rows`: what the speculative
    loop's AR step costs at least there (`break_even`'s bound, for a batch: rows > 1)."""
    self._ar_step_floor_s[int(rows)] = _check_positive(seconds, "seconds")
    self.version += 1

  def ar_step_floor_s(self, rows: int) -> float | None:
    """The least seconds of the speculative loop's AR step at batch size `rows`: the start-up
    one-token forward measured there, else the one measured at the nearest larger batch size R
    scaled by rows / R (None: none measured at `rows` or above).

    A forward over R rows costs at most R / rows forwards over `rows` rows (it could run as
    those), so one over `rows` rows costs at least rows / R of it: a bound for the sizes a
    batch's tail shrinks to, where no start-up forward is timed. Tight where a forward's cost is
    proportional to its rows (a CPU's compute-bound forwards: in a batch-16 run on the 2-core
    EPYC VM the plain loop's step took 6.1 ms at 8 rows, 12.4 at 16), loose where it is flat (an
    accelerator's bandwidth-bound ones), and binding only where a fit prices the step far below
    it: four calls of that run's tail of 8, each ~9 AR steps and 6-7 cycles, fitted the step at
    2 us and the cycle at the cap, 32 AR steps, where a cycle of 8 rows took 22.3 ms, 3.7 plain
    steps (docs/results/controller.md)."""
    if rows in self._ar_step_floor_s:
      return self._ar_step_floor_s[rows]
    larger = [r for r in self._ar_step_floor_s if r > rows]
    if not larger:
      return None
    measured = min(larger)
    return self._ar_step_floor_s[measured] * rows / measured

  def break_even(self, n: int, rows: int) -> float:
    """The cost of a cycle verifying n tokens (n - 1 drafts, a drafter pass) in AR steps at
    batch size `rows`: the current fit, or the prior before the calls tell it; for a batch
    (rows > 1), at most the fitted cycle's seconds over the start-up one-token forward's,
    where one was measured at `rows` or above (`ar_step_floor_s`: a batch's tail).

    The bound: a batch's speculative-loop AR step is a one-token forward over its
    rows plus the drafter context it stages, so it costs at least the start-up one-token
    forward at that batch size (`set_ar_step_floor`, where the engine measured one; its share
    of the one measured at a larger size for a shrunk tail, `ar_step_floor_s`): the break-even
    is at most the fitted cycle's seconds over that forward's. A batch's calls run few AR steps
    (0-3 among 10-30 cycles on an H200 at Qwen3-4B shapes), so its fit barely prices the step
    and the fitted ratio swung with the calls' noise, mostly by an AR step fitted too cheap.
    Simulated at that device's prices (`benchmarks/controllers.py --sim_clock_ms`): at batch 16
    with 3% noise per call it rose from 2.47 to 3.45 after the third call, a batch's start rule
    (which, before the plain loop is timed, wants drafting to commit twice the price,
    `start_backoff.DECISIVE`) no longer found τ 6.43 decisive, and a whole batch started deep:
    66 batch AR steps, as the device's run had (66 at batch 16, 68 and 72 at 8 and 4;
    docs/results/accelerator.md); bounded, 2. At 10% noise the first priced fit read 34.5 AR
    steps, every cycle a miss (96 batch AR steps); bounded, 4.

    Not for one request: its calls back off after every miss and run many AR steps (~2,500
    among ~1,500 cycles in a batch-1 run of the demo's 82 prompts), so its fit prices the AR
    step itself. There the bound only went wrong: the start-up forward, timed over the whole
    cache (no attention window) and perhaps read from the cost cache of a slower hour, cost
    more than the loop's AR step, and the bound cut the fitted price in every batch-1 run on
    the 2-core EPYC model-1 VM (4.35, 4.89 and 7.06 AR steps fitted, 2.97, 2.66 and 5.50
    priced), so cycles were drafted at a price they did not have (docs/results/controller.md).
    On a CPU the bound does not bind a batch (its AR steps stage the drafter's context: a batch
    of 8 on the demo, 4.3 against 3.6 ms a plain step), except a tail's fit gone astray.

    One request's AR step is bounded instead by a step timed in the same loop form and windows:
    the plain AR loop's, once a plain start has run (`one_plain_floor`, `_held_at_plain`)."""
    fit = self._fit(int(rows))
    fitted = fit.break_even(int(n), self._clip_of(rows))
    if rows == 1:
      held = self._held_at_plain(n, rows)
      return fitted if held is None else self.clip(n, held[0] / held[1], 1)
    cycle_s, floor_s = fit.seconds(int(n)), self.ar_step_floor_s(int(rows))
    if cycle_s is None or floor_s is None:
      return fitted
    return min(fitted, self.clip(n, cycle_s / floor_s, int(rows)))

  def _held_at_plain(self, n: int, rows: int) -> tuple[float, float] | None:
    """(a cycle's seconds, an AR step's) for one request whose fit prices its AR step below
    the plain AR loop's step (`plain_step_s`): the step held at the plain loop's, the cycles
    refitted to the same calls with it (`break_even`); None where that does not apply (a
    batch, `one_plain_floor` off, no plain call timed within the last `PLAIN_FLOOR_CALLS`
    speculative calls, the fit not pricing, or its step at least the plain one). The plain
    step is the one that stood when the fit last took a call
    (`start_break_even`'s reason): renewed by every plain call while no cycle is timed, it
    moved the price of cycles timed at another moment of the machine (batch 1 on the 2-core
    Xeon VM, model 207: cycles fitted during a slow spell, then plain steps timed 15% faster
    raised the learned engine's price of a full cycle, its largest size (11), from 6.0 to 7.3 AR
    steps over 40 plain requests; docs/cpu_amx/fit_spike_2026-12-07)."""
    if (rows != 1 or not self.one_plain_floor
        or self._calls_since_plain.get(1, 0) > PLAIN_FLOOR_CALLS):
      return None
    fit, plain = self._fit(1), self._plain_at_fit.get(1) or self.plain_step_s(1)
    step = fit.seconds(0)
    if plain is None or step is None or step >= plain:
      return None
    cycle = fit.cycle_seconds_at(int(n), plain, self.ridge)
    return None if cycle is None else (cycle, plain)

  def size_prices(self, lengths: Sequence[int], rows: int) -> np.ndarray:
    """[len(lengths)] AR steps of a cycle verifying each n in `lengths` at batch size `rows`,
    for weighing one length against another (a block-size policy's sizes,
    `Engine.policy_prices`): priced relative to the length run in the most calls (the
    reference), at that length's own break-even. A length that ran in at least
    `SIZE_PRICE_CALLS` of the fit's calls at its ratio to the reference over every call the fit
    took (`_Fit.size_ratios`: long memory, `SHAPE_FORGET`); any other at the start-up costs'
    shape (every start-up length measured in one pass, alike).

    Not each length's own fitted break-even: the fit forgets fast (it follows the machine), so
    a length run in one call of ten is priced by its last call or two, and a policy runs it
    when their noise makes it cheap. On the 2-core Xeon (model 207) the learned default's fitted
    price of b = 9, 10, 11 before each call that ran them was 16-28% off (median log error, seven
    batch-1 runs replayed; nearly always under) their ratio to b = 8 over the whole run, this
    rule's 2-8%, and its picks of 10 and 11 ran at 0.96x and 0.92x b = 8's speed on their
    requests (docs/cpu_amx/b1_host_2026-12-07, docs/cpu_amx/size_prices_2026-12-07). Not the start-up
    shape alone either (isolated forwards and one drafter pass at the largest block): it priced
    a b = 11 cycle 8% above a b = 8 one where the loops' own calls then measured 26%, and a
    policy sent 66 of 82 requests to b = 11 (0.97x b = 8's decode speed). A length priced too
    cheap by the shape is run, and its calls correct it; one priced too dear costs at most the
    gain it might have had."""
    fit, shape = self._fit(int(rows)), self.size_shape
    runs = ({n: c for n, c in fit.calls_with.items() if n > 0 and n not in self.by_prior}
            if fit.pricing else {})
    if not runs:
      return np.asarray([self.clip(int(n), float(shape(int(n))), int(rows), shape)
                         for n in lengths], np.float64)
    ref = max(runs, key=lambda n: (runs[n], n))
    ref_price = self.break_even(ref, rows)
    scale = ref_price / float(shape(ref))
    ratios = fit.size_ratios(ref)
    prices = []
    for n in map(int, lengths):
      ratio = ratios.get(n) if runs.get(n, 0) >= SIZE_PRICE_CALLS else None
      prices.append(ref_price if n == ref else
                    self.clip(n, ref_price * ratio, int(rows)) if ratio is not None else
                    self.clip(n, scale * float(shape(n)), int(rows), shape))
    return np.asarray(prices, np.float64)

  def break_even_N(self, max_verify: int, rows: int) -> np.ndarray:
    """[max_verify + 1] float32: entry n the break-even of a cycle verifying n tokens (entry 0,
    an AR step, 1): what `LoopState.break_even_N` holds."""
    return np.asarray([1.0] + [self.break_even(n, rows) for n in range(1, max_verify + 1)],
                      np.float32)

  def estimate(self, rows: int) -> CostEstimate:
    fit = self._fit(int(rows))
    cycle_lengths = [n for n in fit.lengths if n > 0]
    return CostEstimate(
        rows=int(rows), calls=fit.calls, ar_step_s=fit.seconds(0),
        cycle_s=({n: fit.seconds(n) for n in cycle_lengths} if fit.pricing else {}),
        break_even={n: self.break_even(n, rows) for n in cycle_lengths},
        plain_step_s=self.plain_step_s(rows),
        start_break_even={n: self.start_break_even(n, rows) for n in cycle_lengths})

  def estimates(self) -> list[CostEstimate]:
    """Every batch size's estimate that has seen a call (of either loop) or been asked for."""
    return [self.estimate(rows) for rows in sorted(set(self._fits) | set(self._plain))]
