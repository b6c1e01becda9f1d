"""The per-cycle verify-length controller of the speculative loops (`--config.controller`).

After the drafter proposes a cycle's b-1 tokens (one pass), the controller decides how many of
them, k, the target verifies, from a small static set of verify buckets (`verify_buckets`: for
b = 8, k in {0, 1, 3, 7}; k = 0 is a plain AR step over the bonus token). Each k is its own
verify shape [B, k+1], compiled once inside the loop. Verifying fewer drafts is lossless: the
target's sample at the first unverified position is the bonus token (and at T > 0 with
`rejection`, drafts k+1.. are simply not proposed).

Controllers:
  none        every cycle verifies all b-1 drafts (the paper's loop; `ar_fallback` unused);
  backoff     as none, plus the AR fallback steps after poor cycles (`--config.ar_fallback`);
  confidence  the cost rule below, from the drafter's own probabilities (no extra pass);
  priced      as backoff, with the miss rule priced: a cycle is a miss when the tokens it
              committed per unit cost fall below an AR step's (`below_break_even`; in a
              batch, the rows' mean, `batch_below_break_even`).

The priced back-off. A cycle verifying k drafts costs draft_cost + verify_cost(k+1) (the
drafter pass and one target forward over k+1 tokens), i.e. `break_even(k)` =
(draft_cost + verify_cost(k+1)) / verify_cost(1) AR steps; it commits a+1 tokens (a drafts
accepted plus the bonus token). It is a miss when a+1 < break_even(k): AR steps would have
committed more for the same time. The rows then take 2, 4, ... AR steps (at most
`--config.ar_fallback`, 64 when 0), as after backoff's poor cycles; `ar_fallback_accept` is
unused. Where a cycle costs 4.3 AR steps (a 2-core CPU, b=8) a cycle committing 4 tokens is a
miss; where it costs 1.5 (an accelerator) only a cycle committing 1 token (no draft accepted)
is. The costs are the engine's (measured or given, below), as for confidence; the threshold
itself is a runtime value of the loop state (`LoopState.break_even_N`), which the engine keeps
current from its timed loop calls (`online_costs`). A batch decides once for all its rows
(`batch_below_break_even`): its cycle is a miss when its decoding rows committed fewer tokens
on average than the cycle's cost in AR steps at that batch size, and then every row takes the
AR steps together (a per-row rule hardly ever backs a batch off: the batch steps only when all
its rows ask to, and the cycle's time is paid for all of them alike).

The confidence rule. Per draft position i, p_i is the drafter's probability of its drafted
token (softmax of its logits; the argmax's probability under `exact`). Verifying k drafts
commits, in expectation, E_k = 1 + sum_{j=1..k} prod_{i<=j} p_i tokens and costs
cost_k = draft_cost + verify_cost(k+1) (the drafter pass, paid already this cycle, plus one
target forward over k+1 tokens). The cycle verifies the bucket k maximizing E_k / cost_k
(ties: the smaller k). When that best rate is below the AR rate 1 / verify_cost(1) the cycle is
a miss, and the next forwards skip the drafter: plain AR steps (which still feed the drafter's
context), 2, 4, 8, ... for consecutive misses, at most `--config.ar_fallback` (0: 16), as
`backoff` does after poor cycles; a cycle worth drafting resets the count. With
`--config.controller_poor_miss`, a cycle that verified more than `ar_fallback_accept` drafts
and accepted at most that many is a miss too. A batch
verifies one k for all its rows: the k maximizing sum over decoding rows of E_k, divided by
cost_k (one cost table: relative costs, measured at the batch size of interest), and skips the
drafter when that rate is below (decoding rows) / verify_cost(1).

Calibration (`--config.controller_calibration`, '' = raw p): a JSON file whose "rates" list
gives the empirical conditional acceptance rate of drafts in equal-width bins of p over [0, 1]
(`benchmarks/controller_calibration.py` fits it); inside the loop p_i is replaced by the rates
interpolated linearly between bin centres (a constant table, no extra pass).

Costs (`--config.controller_costs`): relative costs of one target forward over 1, 2, 4, 8, ...
tokens (powers of two; linear in between, the last segment extended beyond);
`--config.controller_draft_cost`: one drafter pass, same unit. Given as a pair, or neither
(`measure`, the default): the engine then measures them on its own shapes where it runs
(`costs.forward_costs`, cached per machine and models).
"""

from __future__ import annotations

import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.errors import BadInputError

CONTROLLERS = ("none", "backoff", "confidence", "priced")
# The controllers that price cycles with the costs (measured by the engine unless given).
PRICED = ("confidence", "priced")
# confidence with ar_fallback = 0: the longest run of AR steps its declined cycles back off to.
DEFAULT_SKIP_CAP = 16
# priced with ar_fallback = 0: the same for its misses. Longer: each probing cycle where
# drafting keeps losing costs its price less what it commits (on the demo at T = 1, about 3 AR
# steps per cycle), and a cap of 64 ran 1.069x a cap of 16 there, 1.005x at T = 0 (batch 1,
# docs/results/controller.md "Every batch size").
PRICED_SKIP_CAP = 64
FIXED_PREFIX = "fixed:"  # tests only: "fixed:k" verifies k drafts every cycle (a bucket)



def verify_buckets(block_size: int) -> tuple[int, ...]:
  """The drafts a cycle of block size b may verify: {0} ∪ {2^j - 1 < b} ∪ {b - 1}."""
  ks, j = {0, block_size - 1}, 1
  while 2 ** j - 1 < block_size:
    ks.add(2 ** j - 1)
    j += 1
  return tuple(sorted(ks))


def check_controller(name: str, flag: str = "--config.controller") -> str:
  if name not in CONTROLLERS:
    raise BadInputError(f"{flag}={name!r} is not one of {list(CONTROLLERS)}")
  return name


def loop_form(controller: str | None, ar_fallback: int, priced_cap: int = 0
              ) -> tuple[str, int]:
  """(the controller in effect, the most AR steps in one run of them): None reads `backoff`;
  `backoff` without fallback steps is the plain loop (`none`), which takes none; `confidence`
  backs its skipped drafter passes off up to `ar_fallback` steps (0: `DEFAULT_SKIP_CAP`), and
  `priced` its misses up to `priced_cap` (0: `ar_fallback`, and `PRICED_SKIP_CAP` when that is
  0 too)."""
  controller = controller or "backoff"
  if controller == "backoff" and int(ar_fallback) == 0:
    controller = "none"
  if controller == "priced":
    return controller, int(priced_cap) or int(ar_fallback) or PRICED_SKIP_CAP
  if controller in PRICED:
    return controller, int(ar_fallback) or DEFAULT_SKIP_CAP
  return controller, (int(ar_fallback) if controller == "backoff" else 0)


def labelled_as(controller: str | None) -> str | None:
  """The controller whose loop label sets measure for a decode with `controller`: `priced`
  runs back-off's loop (the same cycles, AR steps and back-off schedule) with misses priced
  by costs measured where it runs, and label sets price cycles by their own cost table and
  replay back-off's miss rule, so `priced` is labelled as `backoff` (labels made for backoff
  serve it unchanged); the others as themselves (`confidence`, whose verify lengths no label
  set replays, is refused by the labels stage)."""
  return "backoff" if controller == "priced" else controller


def backoff_steps(misses_B: jax.Array, cap: int) -> jax.Array:
  """[B] int32 AR steps to take after `misses_B` consecutive misses (>= 1): 2, 4, 8, ... at
  most `cap` (the schedule of `backoff`'s poor cycles and of `confidence`'s declined ones)."""
  return jnp.minimum(2 ** jnp.minimum(misses_B, 30), cap).astype(jnp.int32)


def fixed_k(name: str, block_size: int) -> int | None:
  """The k of the tests' "fixed:k" controller (None for the others); a bucket of `block_size`."""
  if not name.startswith(FIXED_PREFIX):
    return None
  k = int(name[len(FIXED_PREFIX):])
  if k not in verify_buckets(block_size):
    raise ValueError(f"controller {name!r}: {k} is not a verify bucket of block size "
                     f"{block_size} {verify_buckets(block_size)}")
  return k


def parse_costs(text: str | Sequence[float], flag: str = "--config.controller_costs"
                ) -> tuple[float, ...]:
  """The cost table: comma-separated positive costs of verifying 1, 2, 4, ... tokens."""
  try:
    costs = tuple(float(x) for x in (text.split(",") if isinstance(text, str) else text)
                  if str(x).strip())
  except ValueError:
    raise BadInputError(f"{flag}={text!r}: expected comma-separated numbers") from None
  if not costs or any(not np.isfinite(c) or c <= 0 for c in costs):
    raise BadInputError(f"{flag}={text!r}: expected one or more positive costs (of verifying "
                        "1, 2, 4, 8, ... tokens)")
  return costs


def check_draft_cost(cost: float, flag: str = "--config.controller_draft_cost") -> float:
  try:
    cost = float(cost)
  except (TypeError, ValueError):
    raise BadInputError(f"{flag}={cost!r}: expected a number >= 0") from None
  if not np.isfinite(cost) or cost < 0:
    raise BadInputError(f"{flag}={cost!r}: expected a number >= 0")
  return cost


def verify_cost(tokens: int, costs: Sequence[float]) -> float:
  """The relative cost of one target forward over `tokens` tokens from the table of 1, 2, 4,
  ... tokens: linear in between, the last segment extended beyond (a one-entry table: flat)."""
  xs = [2.0 ** i for i in range(len(costs))]
  if tokens <= xs[-1] or len(costs) == 1:
    return float(np.interp(tokens, xs, costs))
  slope = (costs[-1] - costs[-2]) / (xs[-1] - xs[-2])
  return float(costs[-1] + slope * (tokens - xs[-1]))


def bucket_costs(block_size: int, costs: Sequence[float], draft_cost: float) -> np.ndarray:
  """[K] cost_k = draft_cost + verify_cost(k + 1) per verify bucket k of `block_size`."""
  return np.asarray([draft_cost + verify_cost(k + 1, costs) for k in verify_buckets(block_size)],
                    np.float32)


def break_even(k: int, costs: Sequence[float], draft_cost: float) -> float:
  """The tokens a cycle verifying k drafts must commit to be worth its cost: its cost (one
  drafter pass + a target forward over k+1 tokens) in AR steps (forwards over one token)."""
  return (draft_cost + verify_cost(k + 1, costs)) / verify_cost(1, costs)


def batch_below_break_even(a_B: jax.Array, break_even_: float | jax.Array) -> jax.Array:
  """[B] bool, one value for the whole batch: whether the rows that committed (a_B >= 0)
  committed fewer tokens in all, sum(a_B + 1), than `break_even_` times their number. A batch's
  cycle costs `break_even_` of the batch's AR steps, each committing one token per row, so this
  is the batch's miss: AR steps over the same rows would have committed more in the same time.
  False when no row committed; for one row it is `below_break_even`."""
  committed_B = a_B >= 0
  total = jnp.sum(jnp.where(committed_B, a_B + 1, 0)).astype(jnp.float32)
  rows = jnp.sum(committed_B).astype(jnp.float32)
  miss = (rows > 0) & (total < jnp.asarray(break_even_, jnp.float32) * rows)
  return jnp.broadcast_to(miss, a_B.shape)


def below_break_even(a_B: jax.Array, break_even_: float | jax.Array) -> jax.Array:
  """[B] bool, the rule for one row: the rows whose cycle (a_B drafts accepted; -1: nothing
  committed) committed fewer tokens, a_B + 1, than `break_even_` (its cost in AR steps,
  `break_even`: a compile-time float or a traced [] float32, the loop state's
  `break_even_N[k + 1]`)."""
  return (a_B + 1).astype(jnp.float32) < jnp.asarray(break_even_, jnp.float32)


def fit_calibration(p_N: np.ndarray, accepted_N: np.ndarray, bins: int,
                    prior: float = 2.0) -> tuple[float, ...]:
  """Per equal-width bin of p over [0, 1], the acceptance rate of the drafts in it, shrunk
  toward the bin's centre by `prior` pseudo-drafts (an empty bin reads its centre)."""
  p_N, accepted_N = np.asarray(p_N, np.float64), np.asarray(accepted_N, np.float64)
  idx = np.clip((p_N * bins).astype(int), 0, bins - 1)
  n = np.bincount(idx, minlength=bins)
  hits = np.bincount(idx, weights=accepted_N, minlength=bins)
  centres = (np.arange(bins) + 0.5) / bins
  return tuple(round(float(r), 4) for r in (hits + prior * centres) / (n + prior))


def check_calibration(rates: Sequence[float], flag: str = "--config.controller_calibration"
                      ) -> tuple[float, ...]:
  """Acceptance rates per bin: one or more numbers in [0, 1]."""
  try:
    rates = tuple(float(r) for r in rates)
  except (TypeError, ValueError):
    raise BadInputError(f"{flag}: 'rates' must be a list of numbers in [0, 1]") from None
  if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
    raise BadInputError(f"{flag}: 'rates' must be one or more numbers in [0, 1], got {rates}")
  return rates


def load_calibration(path: str, flag: str = "--config.controller_calibration"
                     ) -> tuple[float, ...] | None:
  """The acceptance rates per p bin of a calibration JSON file ('' = none: raw p)."""
  if not path:
    return None
  try:
    with open(path) as f:
      rates = json.load(f)["rates"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise BadInputError(f"{flag}={path!r}: not a calibration JSON with a 'rates' list "
                        f"(benchmarks/controller_calibration.py writes one): {e}") from None
  return check_calibration(rates, flag)


def calibrated(p_Bk: jax.Array, rates: Sequence[float] | None) -> jax.Array:
  """[B, k] P(accept) per draft: `rates` (per equal-width bin of p) interpolated linearly
  between bin centres; p itself without a table."""
  if rates is None:
    return p_Bk
  centres = (np.arange(len(rates)) + 0.5) / len(rates)
  return jnp.interp(p_Bk, jnp.asarray(centres, jnp.float32), jnp.asarray(rates, jnp.float32))


def drafted_probs(draft_logits_BkV: jax.Array, draft_Bk: jax.Array) -> jax.Array:
  """[B, k] p_i: the drafter's probability (softmax of its logits) of each drafted token."""
  logp = jax.nn.log_softmax(draft_logits_BkV.astype(jnp.float32), axis=-1)
  return jnp.exp(jnp.take_along_axis(logp, draft_Bk[..., None], axis=-1)[..., 0])


def expected_committed(p_Bk: jax.Array, buckets: Sequence[int]) -> jax.Array:
  """[B, K] E_k = 1 + sum_{j<=k} prod_{i<=j} p_i for each bucket k (tokens a cycle verifying
  k drafts commits in expectation, the bonus token included)."""
  run_Bk = jnp.cumsum(jnp.cumprod(p_Bk, axis=-1), axis=-1)
  run_Bk1 = jnp.concatenate([jnp.zeros_like(run_Bk[..., :1]), run_Bk], axis=-1)
  return 1.0 + run_Bk1[..., jnp.asarray(buckets)]


def choose(p_Bk: jax.Array, active_B: jax.Array, buckets: Sequence[int],
           cost_K: jax.Array | np.ndarray, ar_cost: float) -> tuple[jax.Array, jax.Array]:
  """(index into `buckets` [] int32, draft the next cycle [] bool): the bucket maximizing the
  decoding rows' summed E_k over cost_k (`bucket_costs`), and whether that rate reaches the
  AR rate (decoding rows / `ar_cost`)."""
  E_BK = expected_committed(p_Bk, buckets)
  total_K = jnp.sum(jnp.where(active_B[:, None], E_BK, 0.0), axis=0)
  rate_K = total_K / jnp.asarray(cost_K, jnp.float32)
  idx = jnp.argmax(rate_K).astype(jnp.int32)
  rows = jnp.sum(active_B).astype(jnp.float32)
  return idx, rate_K[idx] >= rows / ar_cost
