"""Host-side driver: pads prompts to buckets, runs the compiled prefill and decode loop of a
request, trims at stop tokens and reports timings and acceptance statistics.

The model states are split once (`nnx.split`); every jitted function merges them inside. The
target (and drafter) caches live on the engine and are donated through prefill and the loop, so a
request reuses the previous request's buffers: entries past the pointer are never read.

Block size per request: a fixed bucket, or `block_size=LEARNED`: the engine's block-size policy
(`set_policy`) runs inside the prefill jit on the prefill's own features and returns a class;
the host runs the compiled loop of that class's bucket. The prefill with a policy is compiled
once per (length bucket, policy architecture); no request compiles anything new.
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.decoding import controller as control
from bp_jax.decoding import evidence
from bp_jax.decoding import loops as decode_loops
from bp_jax.decoding.loops import LoopWeights
from bp_jax.decoding.costs import ForwardCosts, forward_costs, measure_ar_step
from bp_jax.decoding.buckets import default_length_buckets, pick_bucket
from bp_jax.decoding.call_tally import CallTally, LoopCall
from bp_jax.decoding.generation import Generation, generation_of
from bp_jax.decoding.online_costs import OnlineCosts
from bp_jax.decoding.start_backoff import StartBackoff, StartChoice
from bp_jax.decoding.options import (PAD_AR_BELOW, BatchOptions, LoopOptions, ShapeOptions,
                                     declines_by_costs)
from bp_jax.decoding.policy_binding import check_policy_fits
from bp_jax.decoding.precompiling import PrecompileStep, run_steps
from bp_jax.decoding.programs import (WARMUP_TOKENS, DraftContext, LoopPrograms, request_window,
                                     window_buckets, window_for)
from bp_jax.decoding.requests import RequestChecks, check_sampling
from bp_jax.decoding.sampling import SamplingForm, form_of, sampling_params, seed_key as seed_key_of
from bp_jax.decoding.scheduler import BatchRequest, Scheduler
from bp_jax.decoding.state import MAX_ROW_STOP_IDS, LoopState
from bp_jax.errors import BadInputError
from bp_jax.policy.features import DRAFT_CONFIDENCE, FEATURE_TYPES
from bp_jax.policy.mlp import check_prices, priced_costs
from bp_jax.models.qwen3 import Qwen3, with_head_apart
from bp_jax.parallel.rules import (batch_sharding, cache_sharding, replicated, shard_cache,
                                   shard_state)

# A priced policy's prices are placed again once one moved by more than this (relative).
PRICE_PLACE_RTOL = 0.01
# A batch's joint size (`Engine.joint_size`) leaves the middle of the policy's speculative sizes
# only for a size its prior expects this much cheaper per new token (relative) at the engine's
# prices: near the middle the demo's prior priced sizes 7-9 within 1% on this CPU, where the
# start-up prices' own noise is a few percent.
JOINT_MARGIN = 0.03
# Where a priced policy's prices come from before its engine places its own.
LABELLING_PRICES = "the labelling machine's (stored with the policy)"
LEARNED = "learned"  # `generate(block_size=LEARNED)`: the policy chooses the bucket


# A batch's tail runs in fewer slots (`BatchOptions.shrink`) only where rows cost: where the
# engine measured its costs, a one-token forward over all its rows must cost at least this many
# one-row ones (`ForwardCosts.rows_cost`). On this CPU 8 rows cost ~5 one-row forwards; on an
# H200 at Qwen3-4B shapes 16 rows cost 0.71 of one row, and each tail size is one more loop to
# compile (the default at batch 16: 12 programs against the paper's loop's 3, at test shapes).
SHRINK_ROWS_COST = 1.5


def probes_ar_step() -> bool:
  """Whether an engine that prices nothing else measures its AR step as a two-token forward
  (`Engine._padded`): on an accelerator, where a one-row product may run slower kernels than a
  two-row one (an H100 at Qwen3-4B shapes: one token 6.19 ms, two 4.16 ms). Not on a CPU, where
  a product's cost grows with its rows (this development CPU: two tokens 1.1 AR steps) and the
  probe's compiles would only delay the engine."""
  return jax.default_backend() != "cpu"


def keeps_head_apart() -> bool:
  """Whether an engine stores a tied target's output projection apart, transposed
  (`qwen3.with_head_apart`; `Engine`'s `head_apart` None): on a CPU, where XLA runs the
  product with the embedding as stored slower (the demo on the development CPU: AR decoding
  1.080x [1.046, 1.115] and 1.102x [1.058, 1.148], the paper's loop at b = 8 1.046x and
  1.026x, two runs of 3 x 20 requests interleaved in one process; the same tokens). Not on an
  accelerator, whose matrix units take either operand order as it is, and whose memory a
  second V x D matrix would take (Qwen3-4B: 0.78 GB in bf16)."""
  return jax.default_backend() == "cpu"


def decode_form(target: Qwen3, head_apart: bool | None = None) -> Qwen3:
  """`target` as an engine decodes with it: a tied head stored apart where `head_apart`
  (None: `keeps_head_apart`), else as given. Callers that measure costs for an engine
  (`Engine`'s `measured_costs`) measure this form."""
  if keeps_head_apart() if head_apart is None else head_apart:
    return with_head_apart(target)
  return target


class Engine:
  """Decodes requests one at a time: block_size 1 is plain AR decoding with the target; block
  sizes > 1 are speculative cycles with the DFlash drafter (one compiled loop per block size).

  Jobs kept apart: `checks` (what a request may ask, `requests.RequestChecks`), `programs`
  (compiled prefills and loops and their warm-up, `programs.LoopPrograms`), the policy binding
  (`policy_binding.check_policy_fits`), and the perfect-drafter path of tests and benchmarks
  (`forced_continuation`: a separately compiled loop variant, absent from production loops).
  """

  def __init__(self, target: Qwen3, *, shapes: ShapeOptions, drafter=None,
               loop: LoopOptions = LoopOptions(), batching: BatchOptions = BatchOptions(),
               stop_ids: Sequence[int] = (), policy=None, policy_sizes: Sequence[int] = (),
               mesh=None, cost_cache: str | None = None,
               measured_costs: ForwardCosts | None = None,
               clock: Callable[[], float] = time.perf_counter,
               head_apart: bool | None = None):
    """`shapes`: what to compile for (cache length, prompt length buckets, block sizes);
    `loop`: the decode loops' form (verify rule, controller, AR fallback, layer form; the
    per-loop fields are filled in per bucket); `batching`: slots per bucket and refill period;
    `stop_ids`: tokens that end a request; `policy` (a `BlockPolicy`) with `policy_sizes`: see
    `set_policy`; `mesh`: a jax.sharding.Mesh (`bp_jax.parallel.mesh.make_mesh`) or None;
    `cost_cache`: where the `confidence` and `priced` controllers' measured costs are cached
    when `loop` gives none (`costs.forward_costs`: None = `$XDG_CACHE_HOME/bp_jax/costs`,
    "" = measure every time); `measured_costs`: costs measured already on this machine for
    these models, this engine's batch size, largest block size, cache length and layer form
    (a caller building several engines measures once), used instead of `cost_cache`;
    `clock`: the time source of the loop calls' wall times (seconds; tests inject a fake one),
    which the priced controller's online costs learn from; `head_apart`: a target with tied
    embeddings decodes with its output projection stored apart, transposed
    (`qwen3.with_head_apart`: the same weights, one V x D matrix more); None: where
    `keeps_head_apart` (on a CPU). A target given in that form already (`decode_form`) is
    taken as it is."""
    if shapes.max_len > target.cfg.max_position_embeddings:
      raise BadInputError(f"max_len={shapes.max_len} exceeds the model's "
                          f"max_position_embeddings={target.cfg.max_position_embeddings}")
    max_len = shapes.max_len
    target = decode_form(target, head_apart)
    self.batch_size, self.sync_cycles = batching.batch_size, batching.sync_cycles
    self.join_learned = batching.join_learned and batching.batch_size > 1
    self.move_plain_after = (batching.move_plain_after
                             if batching.batch_size > 1 and batching.sync_cycles > 0 else 0)
    self.cfg = target.cfg
    self.max_len = max_len
    self.length_buckets = shapes.length_buckets or default_length_buckets(max_len)
    self.stop_ids = list(stop_ids)
    self._stop_arr = jnp.asarray(self.stop_ids or [-1], jnp.int32)
    # The batched loops' budget of target forwards per call, an argument of each call, and
    # shorter budgets asked for (`slots_program`'s `forwards`), each made once.
    self._sync_arr = jnp.asarray(self.sync_cycles, jnp.int32)
    self._budgets = {self.sync_cycles: self._sync_arr}
    # Prefill programs run once, untimed (`_warm_prefill`, `_warm_prefill_alone`), and the
    # seconds those first runs took
    self._warmed_prefills: set = set()
    self.prefill_warmup_seconds = 0.0
    self.t_graph, self.t_state = nnx.split(target)
    # Caches in the form the loops carry (`loops.loop_cache`: per layer, unless the layers run
    # scanned), so that no call converts them: a one-request loop call that got stacked caches
    # copied both caches into per-layer buffers and back (on the demo 0.41 ms per request of
    # the AR loop, 0.74 ms of the speculative one).
    form = lambda c: decode_loops.loop_cache(c, loop.scan_layers)
    self._new_caches = lambda batch, with_drafter=True: (
        form(target.init_cache(batch, max_len)),
        None if drafter is None or not with_drafter else form(drafter.init_cache(batch, max_len)))
    self.block_sizes = shapes.block_sizes
    self.drafter = drafter
    if drafter is not None:
      drafter.validate_against_target(target.cfg, "drafter")
      self.d_graph, self.d_state = nnx.split(drafter)
    else:
      self.d_graph = self.d_state = None
    self.cache, self.draft_cache = self._new_caches(1)  # the one-request path's own caches
    self.seq = jnp.zeros((1, max_len), jnp.int32)
    self.checks = RequestChecks(max_len, target.cfg.vocab_size, self.block_sizes,
                                drafter is not None)
    loop = self._priced(loop, target, drafter, batching.batch_size, cost_cache, measured_costs)
    loop = self._padded(loop, target, batching.batch_size, measured_costs)
    loop = self._declining(loop)
    # Static batching (sync_cycles 0) runs a batch to its end in one call: no tail to shrink.
    # Where idle slots cost about nothing (measured), no loop per tail size either.
    rows_cost = None if self.measured_costs is None else self.measured_costs.rows_cost()
    self.shrink = (batching.shrink and batching.batch_size > 1 and batching.sync_cycles > 0
                   and not (rows_cost is not None and rows_cost < SHRINK_ROWS_COST))
    self.programs = LoopPrograms(self.t_graph, self.d_graph, loop)
    self.clock = clock
    # Target forwards of every loop call so far, by verify length (0: AR steps; n: cycles
    # verifying n tokens), counted before each call's clock stops.
    self.forwards_run: collections.Counter = collections.Counter()
    # Batched loop calls so far: seconds x slots, and seconds x slots holding a decoding row
    # (`slot_use`).
    self.slot_seconds = self.decoding_slot_seconds = 0.0
    # Calls so far that timed the plain loop on copies of drafting rows
    # (`Scheduler._probe_plain`; counted in `loop_calls` too).
    self.plain_probes = 0
    # Every loop call so far by (block size, slots): calls, seconds, forwards (`CallTally`).
    self.loop_calls: dict[tuple[int, int], CallTally] = {}
    # Every loop call in order (`LoopCall`), where a caller sets a list here (a benchmark
    # following the prices over time); None: not recorded.
    self.call_log: list[LoopCall] | None = None
    self.prices, self.online = self._online_prices(self.programs.options)
    if self.prices is not None and self.measured_costs is not None:  # an AR step's least price
      self.prices.set_ar_step_floor(self.measured_costs.verify_s[0],
                                    self.measured_costs.batch_size)
    # Where a request starts the priced back-off (alone or in a batch's slot): `start_backoff`;
    # its recent requests span at least a batch (`StartBackoff.window`).
    self.starts = (StartBackoff(window=max(StartBackoff.window, batching.batch_size),
                                batch_plain=self.loop_options.start_plain)
                   if self.prices is not None and self.loop_options.start_backoff else None)
    # The priced controller's evidence (`evidence`: its decline's and its back-off gate's),
    # carried from loop call to loop call and from request to request (None: none kept).
    opts = self.programs.options
    self.evidence_state = (evidence.empty_state() if drafter is not None
                           and opts.controller == "priced"
                           and (opts.controller_decline or opts.controller_persist) else None)
    self.p_graph = self.p_state = self.policy_key = self.policy = None
    self.policy_sizes: tuple[int, ...] = ()
    self._placed_prices: np.ndarray | None = None  # a priced policy's, as last placed
    # ((`OnlineCosts.version`, policy sizes), [C] cycle prices) `policy_prices` last computed
    self._policy_prices_at: tuple | None = None
    self._last_pick = 0  # the block size the last learned request's policy picked (0: none)
    self._joint: int | None = None  # `joint_size`, once chosen
    self._route_alone: int | None = None  # `route_size` alone, once chosen
    self._batch_prior: float | None = None  # `batch_prior_tau` at it (0.0: none), once computed
    self.mesh = mesh
    if mesh is not None:  # weights by the rule table, caches by rows; jit propagates the rest
      self.t_state, self.d_state = (shard_state(s, mesh) for s in (self.t_state, self.d_state))
      self.cache, self.draft_cache = (shard_cache(c, mesh) for c in (self.cache, self.draft_cache))
      self.seq = jax.device_put(self.seq, replicated(mesh))
    # The loops' weights, their per-layer slices taken once here (`loops.LoopWeights`).
    self.t_weights = self._loop_weights(self.t_graph, self.t_state, one_device=mesh is None)
    self.d_weights = (None if drafter is None else
                      self._loop_weights(self.d_graph, self.d_state, one_device=mesh is None))
    if policy is not None:
      self.set_policy(policy, policy_sizes)

  def _loop_weights(self, graph, state, one_device: bool) -> LoopWeights:
    """A model's `LoopWeights`: its per-layer weights sliced once from `state` (placed as it
    is), none where the loops scan the stacked layers. Prefill and the loops read them; the
    stacked ones stay in `state` beside them: the layers' weights twice, which a loop call held
    anyway while it sliced its own copy, now without the copy. On `one_device`, the model's
    `loop_layers` (the target's projections concatenated, `layers.fuse_projections`); on a
    mesh the separate matrices (a concatenation would not follow the rule table's per-matrix
    sharding)."""
    model = nnx.merge(graph, state)
    layers = (None if self.scan_layers else
              tuple(model.loop_layers() if one_device else model.layers.per_layer()))
    return LoopWeights(state, layers)

  def _padded(self, loop: LoopOptions, target, batch_size: int,
              measured: ForwardCosts | None) -> LoopOptions:
    """`loop` with its AR steps' form decided by a measurement where nothing else decides it
    (`ar_step_tokens` auto and no costs, e.g. a plain AR engine, or the paper's loop's): two
    tokens where a forward over them costs below `PAD_AR_BELOW` of one over a single token,
    as `measured` (the caller's measurement at this batch size) has them, else as timed here
    (`costs.measure_ar_step`, on machines that `probes_ar_step`); sets `ar_step_probe` (the two
    forwards' seconds, None where not measured)."""
    self.ar_step_probe: tuple[float, float] | None = None
    if loop.ar_step_tokens or loop.controller_costs is not None:
      return loop
    if measured is not None and measured.batch_size == batch_size:
      one, two = measured.verify_s[:2]
    elif probes_ar_step():
      one, two = measure_ar_step(target, batch_size, self.max_len, scan_layers=loop.scan_layers)
    else:
      return loop
    self.ar_step_probe = (one, two)
    return loop.replace(ar_step_tokens=2 if two < PAD_AR_BELOW * one else 1)

  def _declining(self, loop: LoopOptions) -> LoopOptions:
    """`loop` with the priced decline decided where it is left to the engine
    (`controller_decline` None): on where a declined cycle saves at least `DECLINE_MIN_SAVING`
    AR steps at the costs in effect, the verify of a block size against an AR step
    (`options.declines_by_costs`), in the loops of the sizes where it does
    (`LoopOptions.decline_sizes`), else off: the loop then holds one verify and no loop of zero
    or one trips around it."""
    spec_sizes = [b for b in self.block_sizes if b > 1]
    if (loop.controller_decline is not None or loop.controller != "priced"
        or loop.controller_costs is None or not spec_sizes):
      return loop
    step = loop.ar_step_tokens_in_effect()
    sizes = tuple(b for b in spec_sizes if declines_by_costs(loop.controller_costs, b, step))
    return loop.replace(controller_decline=bool(sizes), decline_sizes=sizes or None)

  def _priced(self, loop: LoopOptions, target, drafter, batch_size: int,
              cost_cache: str | None, measured: ForwardCosts | None) -> LoopOptions:
    """`loop` with the costs of a controller that prices cycles (`confidence`, `priced`): as
    given, or measured on this engine's shapes (batch size, largest block size, cache length)
    where it runs: `measured` (the caller's measurement), else through the cache
    (`costs.forward_costs`); sets `measured_costs` and `costs_from_cache`."""
    self.measured_costs: ForwardCosts | None = None
    self.costs_from_cache: bool | None = None
    spec_sizes = [b for b in self.block_sizes if b > 1]
    if drafter is None or not spec_sizes or not loop.needs_costs():
      return loop
    if measured is None:
      # Several sizes: the smallest one's drafter pass is timed too, so that a block-size
      # policy weighs each size with its own (`OnlineCosts.size_prices`).
      measured, hit = forward_costs(target, drafter, batch_size, max(spec_sizes), self.max_len,
                                    scan_layers=loop.scan_layers, cache_dir=cost_cache,
                                    draft_blocks=(min(spec_sizes),))
    elif (measured.batch_size, measured.block_size) != (batch_size, max(spec_sizes)):
      raise BadInputError(f"measured_costs: measured at batch size {measured.batch_size} and "
                          f"block size {measured.block_size}, but the engine runs batch size "
                          f"{batch_size} and block sizes up to {max(spec_sizes)}")
    else:
      hit = False
    table, draft = measured.relative()
    self.measured_costs, self.costs_from_cache = measured, hit
    return loop.replace(controller_costs=table, controller_draft_cost=draft)

  def _online_prices(self, opts: LoopOptions) -> tuple[OnlineCosts | None, bool]:
    """(the priced controller's runtime prices, whether the loop calls update them): None for
    another controller; prior: the start-up costs, which a batch's prices never go below
    (`OnlineCosts.batch_prior_floor` 1: a batched fit that lost sight of AR steps cannot sink to
    a cycle "costing" one AR step, where no cycle is a miss and no AR step runs that could
    correct it; docs/results/controller.md), one request's never below half of them
    (`one_prior_floor`). Per `LoopOptions.online_costs`: True
    updates from every call; None (auto) from every call when the engine measured the costs;
    False never."""
    if opts.controller != "priced" or self.drafter is None:
      return None, False
    costs, draft = opts.controller_costs, opts.controller_draft_cost
    # The decline's cycles (a drafter pass and a one-token forward) are priced by the start-up
    # costs, not fitted (`OnlineCosts.by_prior`).
    measured = self.measured_costs
    shape = (None if measured is None or not measured.draft_by_block else
             lambda n: control.break_even(n - 1, costs, measured.draft_steps_at(n)))
    prices = OnlineCosts(lambda n: control.break_even(n - 1, costs, draft), batch_prior_floor=1.0,
                         one_prior_floor=0.5, by_prior=(1,) if opts.controller_decline else (),
                         size_shape=shape)
    online = (self.measured_costs is not None if opts.online_costs is None
              else opts.online_costs)
    return prices, online

  def break_even_N(self, block_size: int, rows: int) -> np.ndarray | None:
    """[N] float32 (N = the largest block size + 1, for every bucket alike) the priced
    controller's current break-even per verify length for a loop of `rows` slots
    (`LoopState.break_even_N`); None for AR loops and other controllers."""
    if self.prices is None or block_size == 1:
      return None
    price_N = self.prices.break_even_N(max(self.block_sizes), rows)
    weighed = self._policy_cycle_price(block_size, rows)
    if weighed is not None:
      price_N[block_size] = weighed
    return price_N

  def _policy_cycle_price(self, block_size: int, rows: int) -> float | None:
    """A full cycle of `block_size` at `rows` slots in AR steps (float32, as `break_even_N`'s
    entry holds it) where a block-size policy weighs this size at this batch size
    (`policy_prices`): the price it weighed it by (`OnlineCosts.size_prices`: a size the loops
    run rarely at its long-memory ratio to the most-run one); None where the fit's own
    break-even stands.
    The loop of a size the policy picked then judges its cycles (misses, the back-off gate,
    the decline) and a request's start at the price that picked it: the fit forgets fast, so
    its own price of a rare size is its last call or two (16-28% off the run's ratio on the
    2-core Xeon, model 207, docs/cpu_amx/size_prices_2026-12-07); the most-run size's price
    is the fit's either way. The size requests are routed as (`route_size`: alone the prior's
    cheapest, in a joined batch the joint size every drafting row runs) keeps the fit's own
    price: early in a run, and at T = 1 where most requests decode plain, the most-run length
    the ratios are taken against can be another one (a request's last, shorter cycle), and the
    static size's ratio price then read 0.39-2.2x its own fitted price (batch 1, T = 1, the
    2-core Xeon, model 207; docs/cpu_amx/repeats5_2026-12-07)."""
    if (rows == self.batch_size and block_size in self.policy_sizes
        and block_size != self.route_size):
      got = self.policy_prices()
      if got is not None:
        return float(np.float32(got[0][self.policy_sizes.index(block_size)]))
    return None

  def _loop_cycle_price(self, block_size: int, rows: int) -> float:
    """A full cycle of `block_size` at `rows` slots in AR steps as that size's loop weighs it:
    the policy's price where it applies (`_policy_cycle_price`), else the fit's break-even."""
    weighed = self._policy_cycle_price(block_size, rows)
    return self.prices.break_even(block_size, rows) if weighed is None else weighed

  def loop_ran(self, t0: float, counts_N, rows: int, block_size: int,
               decoding: int | None = None) -> float:
    """Books a loop call that started at `clock()` time t0 and ran `counts_N` target forwards
    per verify length (returned and read back already) over `rows` slots, `decoding` of them
    holding a decoding request when it started (a batched call): counts them, stops the clock,
    and feeds the online prices with a spec loop's call; returns its seconds.

    A call of the plain AR loop (a plain start, `starts_plain`, or a batch's plain bucket) is
    timed apart from the speculative loop's fit (`OnlineCosts.observe_plain`): what a request
    that does not draft costs a step, and the least one request's speculative-loop AR step
    costs (`OnlineCosts.break_even`). Fitted with the speculative calls, on a VM whose speed
    moved by a third between calls, one such call, slower than the calls before, priced the AR
    step above what the older calls' cycles and AR steps together took, their cycles near zero:
    the break-even fell to its floor of 1 and the next requests drafted every cycle (batch 1,
    T = 1, /tmp/s30/fit.py)."""
    counts_N = np.asarray(counts_N)
    for n in np.flatnonzero(counts_N):
      self.forwards_run[int(n)] += int(counts_N[n])
    secs = self.clock() - t0
    self.loop_calls.setdefault((int(block_size), int(rows)), CallTally()).add(
        secs, int(counts_N.sum()))
    if block_size > 1 and self.online:
      self.prices.observe(secs, counts_N, rows)
    elif self.online:
      self.prices.observe_plain(secs, int(counts_N[0]), rows)  # the plain AR loop's calls
    if block_size == 1 and self.starts is not None and rows == self.batch_size:
      self.starts.probe_due = False  # the batch's plain side timed (a probe or a plain call)
    if decoding is not None:
      self.slot_seconds += secs * rows
      self.decoding_slot_seconds += secs * decoding
    if self.call_log is not None:
      self.call_log.append(self._booked(t0 + secs, secs, counts_N, rows, block_size))
    return secs

  def _booked(self, end: float, secs: float, counts_N: np.ndarray, rows: int,
              block_size: int) -> LoopCall:
    """The `call_log` entry of a call just booked (ended at clock time `end`), with the prices
    in effect after it for a cycle of the call's block size (a plain call's: the largest,
    as the fit prices it): the loop's as its miss rule weighs it (a policy's size at the
    policy's price, `_policy_cycle_price`), and a batch start's. A plain call prices no
    policy size: a batch's plain calls would each solve them (`OnlineCosts.size_prices`),
    host work the engine does not do without a log."""
    prices = None
    if self.prices is not None:
      b = block_size if block_size > 1 else max(self.block_sizes)
      prices = (self._loop_cycle_price(b, rows) if block_size > 1
                else self.prices.break_even(b, rows),
                self.prices.start_break_even(b, rows, self._forward_prior))
    return LoopCall(end, secs, int(block_size), int(rows),
                    tuple(int(c) for c in counts_N), *(prices or (None, None)))

  def clear_tallies(self) -> None:
    """Forgets what the loop calls so far ran and took (`forwards_run`, `loop_calls`,
    `slot_use`'s seconds, `plain_probes`, `call_log`'s entries), keeping all the engine learned
    from them (its prices, its start rule's recent requests, the controller's evidence): after a
    warm-up, the tallies of a warm engine."""
    self.forwards_run.clear()
    self.loop_calls.clear()
    self.slot_seconds = self.decoding_slot_seconds = 0.0
    self.plain_probes = 0
    if self.call_log is not None:
      self.call_log.clear()

  @property
  def slot_use(self) -> float | None:
    """The share of the batched loop calls' slot time (seconds x slots) in which a slot held a
    decoding request, over every call so far (None before one): a step costs the same with
    idle slots, so 1 - slot_use is the batch's idle share (e.g. its tail, when the last
    requests of a batch end at scattered times)."""
    if self.slot_seconds <= 0:
      return None
    return self.decoding_slot_seconds / self.slot_seconds

  @property
  def cost_estimate(self) -> dict | None:
    """What the priced controller prices cycles with now: whether its loop calls update it
    (`online`), and per batch size the seconds per AR step and per cycle and each cycle's
    break-even in AR steps (`online_costs.CostEstimate`); None for another controller."""
    if self.prices is None:
      return None
    self.prices.estimate(self.batch_size)  # the engine's own batch size, even before a call
    return {"online": self.online,
            "by_batch_size": {str(e.rows): e.to_json() for e in self.prices.estimates()}}

  @property
  def costs_source(self) -> str | None:
    """Where the confidence or priced controller's costs came from: "given", "measured" (here,
    now), "cached" (measured earlier on this machine); None when the loops price nothing."""
    if self.measured_costs is not None:
      return "cached" if self.costs_from_cache else "measured"
    opts = self.loop_options
    return "given" if opts.controller in control.PRICED and opts.controller_costs else None

  @property
  def timed_decisions(self) -> bool:
    """Whether the controller's choices (verify lengths, back-offs, plain starts) follow this
    machine's timings from run to run: priced from costs measured now, or kept current by the
    loop calls' wall times. Where they do, verify=rejection at T > 0 draws other tokens for the
    same seed in another run (its draws depend on where cycles start); costs given (or read
    from the cost cache) with online costs off decide the same way every run."""
    return self.prices is not None and (bool(self.online) or self.costs_source == "measured")

  # The loop form in effect and the compiled programs (read by reports, summaries and tests).
  loop_options = property(lambda self: self.programs.options)
  scan_layers = property(lambda self: self.loop_options.scan_layers)
  ar_fallback = property(lambda self: self.loop_options.ar_fallback)
  ar_fallback_accept = property(lambda self: self.loop_options.ar_fallback_accept)
  verify = property(lambda self: self.loop_options.verify)
  # The verify-length controller in effect (`controller.CONTROLLERS`; "backoff" without fallback
  # steps reads "none").
  controller = property(lambda self: self.loop_options.controller)
  compiled = property(lambda self: self.programs.cache)

  @property
  def warmup_seconds(self) -> dict[int, float]:
    """Block size -> its loop's untimed first run (s), production loops only."""
    return {k[1]: s for k, s in self.programs.warmup_seconds.items()
            if k[0] in ("ar_loop", "spec_loop", "batch_ar_loop", "batch_spec_loop")}

  def set_policy(self, policy, block_sizes: Sequence[int]) -> None:
    """Makes `policy` (a `bp_jax.policy.mlp.BlockPolicy`) choose the bucket of LEARNED requests;
    class i decodes with `block_sizes[i]`, which must all be buckets of this engine."""
    sizes = tuple(int(b) for b in block_sizes)
    for b in sizes:
      self.check_block_size(b)
    check_policy_fits(policy, sizes, self.cfg, self.drafter)
    self.p_graph, self.p_state = nnx.split(policy)
    self.p_state = shard_state(self.p_state, self.mesh)
    self.policy_key, self.policy_sizes = policy.arch.signature, sizes
    self.policy = policy
    self._placed_prices, self._last_pick, self._joint, self._batch_prior = None, 0, None, None
    self._route_alone = None

  @property
  def joint_size(self) -> int | None:
    """The block size every request whose policy picks a speculative size decodes at in a
    batch (`BatchOptions.join_learned`), chosen at its first use and kept (a size that moved
    with the prices would spread a batch's requests over buckets again): with a priced policy
    and this engine's prices (`policy_prices`: at start-up, those it measured at its batch
    size), the speculative size its prior (the labelled prompts' mean cycles and fallback
    steps per new token at each size) expects cheapest per new token, where it beats the
    middle size by more than `JOINT_MARGIN`; else the middle of the policy's speculative sizes
    (the upper one of two; the drafter's training size for sizes around it). Where a long
    verify costs about what a short one does (an accelerator), the prior's cheapest is the
    longest size whose acceptance it expects to keep rising. None: each at its pick (no join,
    batch 1, or no speculative size)."""
    spec = sorted(b for b in self.policy_sizes if b > 1)
    if not (self.join_learned and spec):
      return None
    if self._joint is None:
      self._joint = self._cheapest_size(spec)
    return self._joint

  def _cheapest_size(self, spec: list[int]) -> int:
    """`joint_size`'s choice among the policy's speculative sizes `spec` (sorted)."""
    middle = spec[len(spec) // 2]
    prices = self.policy_prices() if self.policy.arch.head == "priced" else None
    if prices is None:
      return middle
    # Per new token at these prices, as the policy's own decision prices its prior.
    per_token_C = priced_costs(self._prior_counts()[None, :], np.concatenate(prices))[0]
    cost = dict(zip(self.policy_sizes, per_token_C))
    best = min(spec, key=lambda b: cost[b])
    return middle if cost[middle] <= (1.0 + JOINT_MARGIN) * cost[best] else best

  @property
  def batch_prior_tau(self) -> float | None:
    """The committed tokens per cycle a batch's start rule weighs before it has seen
    `StartBackoff.min_cycles` cycles (`StartBackoff.batch_prior_tau`): a priced policy's prior
    at the joint size, τ = (1 - s) / c from its mean cycles c and fallback steps s per new token
    (`value_prior`: the demo's, at 8, 4.27 against 4.5-5.0 measured on its evaluation prompts).
    So a cold engine's first batches start where the prices say (on the demo's CPU, plain at
    batch 4: a cycle there costs ~3.7 of its AR steps, drafting is not decisive) rather than
    drafting first. None (drafting first, as before any τ): no priced policy or no joint size."""
    joint = self.joint_size
    if joint is None or self.policy.arch.head != "priced":
      return None
    if self._batch_prior is None:
      C, i = len(self.policy_sizes), self.policy_sizes.index(joint)
      prior = self._prior_counts()
      cycles, steps = prior[i], prior[C + i]
      self._batch_prior = (max(1.0, (1.0 - steps) / cycles) if cycles > 0 else 0.0)
    return self._batch_prior or None

  def _prior_counts(self) -> np.ndarray:
    """A priced policy's prior counts per new token ([2C]: cycles at each of `policy_sizes`,
    then fallback steps), read from the device."""
    return np.asarray(self.policy.value_prior[...], np.float64)

  def _batch_starts(self) -> StartBackoff:
    """The start rule, with a batch's prior τ set (`batch_prior_tau`)."""
    self.starts.batch_prior_tau = self.batch_prior_tau
    return self.starts

  @property
  def routes_learned_early(self) -> bool:
    """Whether a learned request is routed before its prefill (`generate` alone, `Scheduler`
    in a batch or a server's batch of 1): its speculative picks may start plain (priced
    starts, plain starts on), so the start rule weighs it as a request of `route_size` first
    (in a batch the joint size, at which its speculative picks decode; alone the size the
    joint size's rule would choose). One it routes plain is prefilled as a plain request of
    that size (the target alone, `plain_prefill`), without its policy (its
    `Generation.policy_block_size` is None): its pick could not change its route. One it
    routes to draft (or an explorer) runs its policy and drafts at the pick (alone) or the
    joint size (a batch) from that start; a pick of size 1 decodes plain, counted as a start
    of `route_size` (its route was taken before the pick was known). At batch 8 on the demo's
    CPU, where nearly every request decodes plain, the policy's prefill (its features and the
    drafter's kept layer outputs) cost the learned default ~1% of its end-to-end time against
    a fixed size; at batch 1, T = 1 on the 2-core Xeon (model 207) 1.1% end to end
    (docs/cpu_amx/start_spread_2026-12-07). A batch without a joint size (`join_learned`
    off) routes after the pick: its picks decode at their own sizes, each a bucket."""
    return (self.may_start_plain and self.drafter is not None and self.route_size is not None
            and (self.batch_size == 1 or self.joint_size is not None))

  @property
  def route_size(self) -> int | None:
    """The speculative size a learned request is routed as before its prefill: the joint size
    in a batch (`joint_size`), alone the size the joint size's rule would choose (the prior's
    cheapest at the engine's prices, or the middle one), chosen at its first use and kept;
    None without a policy's speculative size."""
    if self.joint_size is not None:
      return self.joint_size
    spec = sorted(b for b in self.policy_sizes if b > 1)
    if not spec:
      return None
    if self._route_alone is None:
      self._route_alone = self._cheapest_size(spec)
    return self._route_alone

  def decode_size(self, picked: int) -> int:
    """The block size a request whose policy picked `picked` decodes at: the joint size for a
    speculative pick in a joined batch, else its pick (1, plain decoding, stays 1)."""
    joint = self.joint_size
    return picked if joint is None or picked == 1 else joint

  @property
  def learned_sizes(self) -> tuple[int, ...]:
    """The block sizes requests whose size the policy picks decode at (what to precompile)."""
    return tuple(sorted({self.decode_size(b) for b in self.policy_sizes}))

  @property
  def policy_prices_source(self) -> str | None:
    """Whose costs a priced policy decides with: the labelling machine's (stored with it) until
    this engine placed its own (`_place_policy_prices`); None for another head or none."""
    if self.policy is None or self.policy.arch.head != "priced":
      return None
    if self._placed_prices is None:
      return LABELLING_PRICES
    return (f"the engine's costs ({self.costs_source or 'prior'}"
            f"{', kept current by its loop calls' if self.online else ''})")

  def policy_prices(self) -> tuple[np.ndarray, np.ndarray] | None:
    """([C] a cycle of each of the policy's sizes, [C] a plain step in its loop) in AR steps on
    this machine at the engine's batch size: the priced controller's current prices across
    verify lengths (`OnlineCosts.size_prices`: the start-up shape on the scale its loop calls
    measure; a size-b cycle verifies b tokens; size 1's forwards are AR steps, priced at
    one; a fallback step in a speculative loop at one too, the unit the break-even is counted
    in, though it stages the drafter's context), None where the engine prices nothing (another
    controller). A priced policy is given them in place (`BlockPolicy.set_prices`)."""
    if self.prices is None or not self.policy_sizes:
      return None
    # They move only when a loop call (or a floor) reaches the prices (`OnlineCosts.version`):
    # requests prefilled between two calls take them as they were (pricing every size cost
    # ~0.28 ms of host time per learned request on the demo's CPU, batch 4).
    at = (self.prices.version, self.policy_sizes)
    if self._policy_prices_at is None or self._policy_prices_at[0] != at:
      spec = [b for b in self.policy_sizes if b > 1]
      priced = dict(zip(spec, self.prices.size_prices(spec, self.batch_size)))
      self._policy_prices_at = (at, np.asarray([priced.get(b, 1.0) for b in self.policy_sizes],
                                               np.float64))
    cycle_C = self._policy_prices_at[1].copy()
    return cycle_C, np.ones_like(cycle_C)

  def _place_policy_prices(self) -> None:
    """A priced policy's state with this machine's current costs (`policy_prices`), placed
    when one moved by more than `PRICE_PLACE_RTOL` since they were last placed (the online
    prices move a little after every loop call): the prefill that runs it takes them as an
    argument and compiles nothing new. Only the prices' leaf is placed anew (the whole state,
    flattened and placed again, cost ~0.5-1 ms of host time per request on the 2-core Xeon), as
    a host array that the prefill's call moves with its other arguments: a transfer of its own
    after a loop call (`BlockPolicy.set_prices`' indexed set, then reading it) cost ~0.9 ms of
    host time per learned request there, where prices moved before most requests."""
    if self.p_state is None or self.policy.arch.head != "priced":
      return
    got = self.policy_prices()
    if got is None:
      return
    key = np.concatenate(got).astype(np.float32)
    if self._placed_prices is not None and np.allclose(key, self._placed_prices,
                                                       rtol=PRICE_PLACE_RTOL, atol=0.0):
      return
    prices = check_prices(*got, self.policy.arch.num_classes)  # [2C] float32, on the host
    self.policy.size_prices.set_value(prices)  # the caller's policy keeps them too
    self.p_state["size_prices"].set_value(prices if self.mesh is None else
                                          jax.device_put(prices, replicated(self.mesh)))
    self._placed_prices = key

  # -- checks -------------------------------------------------------------------------------
  def check_block_size(self, block_size: int) -> None:
    self.checks.check_block_size(block_size)

  def check_request(self, prompt_len: int, max_new_tokens: int, block_size: int = 1) -> None:
    self.checks.check_request(prompt_len, max_new_tokens, block_size)

  # -- compiled pieces ----------------------------------------------------------------------
  def _prefill_args(self, tokens_1P, n, seed_key, sampling, with_policy: bool,
                    buffers: tuple | None = None,
                    context: DraftContext = DraftContext.BUILT) -> tuple:
    cache, draft_cache = buffers or (self.cache, self.draft_cache)
    d_weights, draft_cache = ((self.d_weights, draft_cache) if context == DraftContext.BUILT
                              else (None, None))
    if with_policy:
      self._place_policy_prices()
    return (self.t_weights, d_weights, tokens_1P, n, cache, draft_cache, seed_key,
            sampling) + ((self.p_state,) if with_policy else ())

  def _prefill(self, tokens_1P, n, seed_key, sampling, form: SamplingForm,
               with_policy: bool = False, buffers: tuple | None = None,
               context: DraftContext = DraftContext.BUILT, features: tuple[str, ...] = ()):
    """(compiled prefill, its arguments) into `buffers` (donated; default: the engine's own
    one-sequence caches), sampling the first token in `form` (the request's). `context`
    (`DraftContext`): NONE (`plain_prefill`) and LATER (`defers_context`) leave the drafter's
    buffer as it is. `features`: the feature types it returns besides the policy's decision."""
    args = self._prefill_args(tokens_1P, n, seed_key, sampling, with_policy, buffers, context)
    layers = (tuple(self.drafter.cfg.target_layer_ids) if context == DraftContext.LATER
              else ())
    fn = self.programs.prefill(args, self.p_graph if with_policy else None, self.policy_key,
                               form, context, features, layers)
    return fn, args

  def plain_prefill(self, block_size: int | str, return_features: bool = False) -> bool:
    """Whether a request that decodes in the plain AR loop (`block_size` 1: asked for, or the
    route its priced start took before its prefill, `starts_plain`) is prefilled without the
    drafter: the target's forward alone, with no drafter context, which only drafting reads
    (a speculative bucket's rows move to the plain one, never back). On the demo's CPU the
    drafter's part was ~19% of a prefill (`benchmarks/plain_prefill.py`, batch 4: prefill
    seconds 0.813x [0.798, 0.828]). A learned size's route is known only after its prefill
    (`defers_context`), except where the engine routes it before (`routes_learned_early`).
    Not where the prefill's features are returned (`return_features`: they include the
    drafter's)."""
    return (self.drafter is not None and block_size == 1 and not return_features)

  def defers_context(self, return_features: bool = False) -> bool:
    """Whether a learned size's request is prefilled without the drafter, its drafter context
    built after the prefill only where the request then drafts (`build_draft_context`): its
    policy reads no drafter output (every feature type but `draft_confidence`), and the route
    (drafting, or plain where its start is deep, `starts_plain`) is known only once the policy
    chose (where the engine routes it before its prefill, `routes_learned_early`, one routed
    plain is prefilled plain, without its policy; one routed to draft may still pick size 1).
    The prefill keeps the drafter's chosen layers' outputs for it (`DraftContext.LATER`).

    Only where the request is likely to decode plain: with priced starts, where the last
    learned request's pick was size 1 or the start rule would route a request of the size it
    decodes at (`decode_size`) plain now (`start_choice` at one size: at every size of the
    policy it cost ~1 ms of host time per request on the demo's CPU; an explorer still
    drafts); without, where the policy has size 1. A drafting request's prefill costs a little
    more in two programs (the demo's CPU, batch 4, every request drafting: prefill seconds
    1.019x [1.008, 1.031]); one that
    decodes plain after a prefill with the drafter paid for a context it never reads (~10% of
    its prefill there)."""
    if return_features or not self._may_defer_context():
      return False
    if self.may_start_plain:
      likely = self.decode_size(self._last_pick if self._last_pick in self.policy_sizes
                                else max(self.policy_sizes))
      return likely == 1 or self.start_choice(likely).plain
    return True

  def _may_defer_context(self) -> bool:
    """Whether a learned request's prefill may leave the drafter's context for later
    (`defers_context`, whatever the start rule says now): precompiled alike."""
    return (self.drafter is not None and self.policy is not None
            and self.policy.arch.feature_type != DRAFT_CONFIDENCE
            and (self.may_start_plain or 1 in self.policy_sizes))

  def _learned_contexts(self) -> tuple[DraftContext, ...]:
    """The forms a learned request's prefill (without returned features) may take: with the
    drafter's context, without it (`defers_context`), or either as the start rule moves."""
    if not self._may_defer_context():
      return (DraftContext.BUILT,)
    if self.may_start_plain:
      return (DraftContext.BUILT, DraftContext.LATER)
    return (DraftContext.LATER,)

  def _prefill_form(self, learned: bool, run_size: int | str,
                    return_features: bool) -> tuple[DraftContext, tuple[str, ...]]:
    """(what a prefill does about the drafter's context, the feature types it returns) for a
    request of a `learned` size or one that runs `run_size`'s loop."""
    features = FEATURE_TYPES if return_features else ()
    if learned:
      return (DraftContext.LATER if self.defers_context(return_features)
              else DraftContext.BUILT), features
    return (DraftContext.NONE if self.plain_prefill(run_size, return_features)
            else DraftContext.BUILT), features

  def build_draft_context(self, pre, n: int) -> tuple:
    """(`pre` with the drafter's context over its prompt of `n` tokens written into its drafter
    buffer, donated; the seconds that took, compiling apart): for a LATER prefill's request
    (`defers_context`) once it is known to draft, what a prefill with the drafter builds
    (`LoopPrograms.draft_context`). Other prefills' are returned as they are, in 0 s."""
    if pre.context_hiddens is None:
      return pre, 0.0
    args = (self.d_weights, pre.context_hiddens, np.int32(n), pre.draft_cache)
    fn = self.programs.draft_context(args)
    t0 = time.perf_counter()
    draft_cache = jax.block_until_ready(fn(*args))
    return pre._replace(draft_cache=draft_cache, context_hiddens=None), time.perf_counter() - t0

  def _warm_loop(self, pre, n, max_new_tokens: int, sampling, seed_key, block_size: int,
                 forced_seq, window: int | None, form: SamplingForm) -> None:
    """A one-request loop's untimed first runs, made only if it has not run yet
    (`LoopPrograms.warm`): on copies of the arguments of a request prefilled into `pre` (of
    `n` prompt tokens; `forced_seq` its forced drafts or None), with at most WARMUP_TOKENS new
    tokens. A request's first use (`generate`) and `precompile(warm=True)` alike."""
    self.programs.warm(block_size, lambda start: self._loop_args(
        pre, n, np.int32(min(max_new_tokens, WARMUP_TOKENS)), sampling, seed_key, block_size,
        forced_seq, start), forced_seq is not None, window, form)

  def _loop_args(self, pre, n, max_new, sampling, seed_key, block_size,
                 forced_seq=None, start: tuple[int, int] = (0, 0)) -> tuple:
    if block_size == 1:
      return (self.t_weights, self.seq, self.cache, pre.first_tok, n, max_new, sampling,
              seed_key, self._stop_arr)
    return (self.t_weights, self.d_weights, self.seq, self.cache, self.draft_cache,
            pre.first_tok, n, max_new, sampling, seed_key, self._stop_arr, forced_seq,
            self.break_even_N(block_size, 1), np.asarray(start, np.int32), self.evidence_state)

  def request_start(self, block_size: int, rows: int = 1) -> tuple[int, int]:
    """(misses, AR steps) the next request in a loop of `block_size` and `rows` slots starts
    with (`start_backoff`; (0, 0): it drafts first)."""
    if self.starts is None or block_size == 1:
      return 0, 0
    price, batch_rule = self._start_price(block_size, rows)
    if batch_rule:  # drafting or the plain bucket (`starts_plain`)
      return self._batch_starts().start(price, self.ar_fallback, rows,
                                        self._start_priced(block_size, rows))
    return self.starts.start(price, self.ar_fallback, rows)

  def _start_price(self, block_size: int, rows: int) -> tuple[float, bool]:
    """(the price a new request's start weighs the recent cycles against, whether the batch's
    rule weighs it: a batch that may start plain prices a cycle in steps of the plain loop at
    `rows` slots, `OnlineCosts.start_break_even`; otherwise the speculative loop's own
    break-even at `rows` slots)."""
    if rows > 1 and self.may_start_plain:
      return self.prices.start_break_even(block_size, rows, self._forward_prior), True
    # `break_even_N`'s entry (float32) without pricing every other length
    return float(np.float32(self._loop_cycle_price(block_size, rows))), False

  @property
  def _forward_prior(self) -> bool:
    """Whether a batch's start rule takes the start-up one-token forward for the plain step
    until the plain loop is timed (`StartBackoff.forward_prior`)."""
    return self.starts is not None and self.starts.forward_prior

  def _start_priced(self, block_size: int, rows: int) -> bool:
    """Whether a batch's start rule at `rows` slots weighs a cycle of `block_size` in steps of
    the plain loop, timed (`_plain_priced`) or, with `StartBackoff.forward_prior`, in the
    start-up one-token forward at `rows` once the loop's calls priced the cycle
    (`OnlineCosts.forward_priced`): its own margin then, not the decisive one
    (`StartBackoff.batch_plain_first`)."""
    return self._plain_priced(rows) or (self._forward_prior
                                        and self.prices.forward_priced(block_size, rows))

  def _plain_priced(self, rows: int) -> bool:
    """Whether the plain loop's step at batch size `rows` has been timed (a batch's start then
    weighs a cycle in its steps: `OnlineCosts.start_break_even`); True where prices are not
    kept current from the loop calls (the start-up costs are all the engine goes by)."""
    return not self.online or self.prices.plain_step_s(rows) is not None

  def plain_now(self, block_size: int) -> bool:
    """Whether a batch's request of `block_size` that is no explorer would take the plain
    bucket if routed now (`StartBackoff.batch_plain_now`): how the scheduler reconsiders the
    routes of requests still waiting for a slot once a bucket's drafting lost
    (`Scheduler._move_losing`)."""
    price = self._batch_price(block_size)
    return price is not None and self._batch_starts().batch_plain_now(*price)

  def cycles_lose(self, block_size: int, acceptance_lengths: Sequence[int]) -> bool:
    """Whether a batch's explorer rows drafting at `block_size`, whose cycles so far committed
    `acceptance_lengths`, would start plain by their own τ
    (`StartBackoff.batch_cycles_lose`, at the price `plain_now` weighs): the scheduler then
    moves them to the plain bucket (`Scheduler._move_losing`)."""
    price = self._batch_price(block_size)
    return price is not None and self._batch_starts().batch_cycles_lose(acceptance_lengths,
                                                                        *price)

  def tail_price(self, block_size: int, slots: int) -> float | None:
    """A cycle's price in plain-loop steps at `slots` rows, what a batch's tail drafting at
    `block_size` in a state of that many slots is weighed by (`StartBackoff.tail_loses`: the
    scheduler then moves all its rows to the plain bucket, `Scheduler._move_losing`); None
    where its rows may not move (no batch, no plain starts, the tail rule off), prices are not
    kept current, or the plain loop has not been timed at `slots` rows."""
    if not (self._batch_starts_plain(block_size) and self.starts.tail_move and self.online
            and self._plain_priced(slots)):
      return None
    return self.prices.start_break_even(block_size, slots)

  def plain_seconds(self, steps: int, slots: int, prior: bool = False) -> float | None:
    """Seconds of `steps` steps of the plain loop at `slots` rows, as timed from its calls
    (None: prices not kept current, or that loop not timed there); `prior`: else at the
    start-up one-token forward there where the start rule takes it for the plain step
    (`StartBackoff.forward_prior`)."""
    step_s = (self.prices.plain_s(slots, prior and self._forward_prior) if self.online
              else None)
    return None if step_s is None else steps * step_s

  def plain_probe_due(self, block_size: int) -> bool:
    """Whether a batch drafting at `block_size` times the plain loop by a probe now
    (`StartBackoff.plain_probes`, `Scheduler._probe_plain`): its requests may start plain,
    prices are kept current from the calls, and the rule asks for the plain side's time
    (`StartBackoff.probe_due`, where a plain explorer run would have begun). An untimed plain
    loop alone calls for a probe only where that loop is compiled (`plain_probe_untimed`): a
    batch that drafts from its first request would otherwise compile the plain loop to time
    it, which a short run never needs (the start-up forward prices the plain step meanwhile:
    `StartBackoff.forward_prior`)."""
    return self._probes_on(block_size) and self.starts.probe_due

  def plain_probe_untimed(self, block_size: int) -> bool:
    """Whether a batch drafting at `block_size` would time its plain loop by a probe because
    that loop is untimed at the batch size (`StartBackoff.probe_untimed`) and compiled there
    for some window: the start-up forward prices its step meanwhile
    (`StartBackoff.forward_prior`), which is no bound. The caller probes only where the plain
    loop of the rows' window is ready (`plain_loop_ready`): compiling it for a short decode
    that drafts throughout would cost more than the forward's error. Where no plain loop is
    compiled at the batch size (decode.py without precompile) this is false without the
    caller reading the rows back from the device after each call."""
    return (self._probes_on(block_size) and self.starts.probe_untimed and self._forward_prior
            and not self._plain_priced(self.batch_size) and self._plain_loop_compiled())

  def _plain_loop_compiled(self) -> bool:
    """Whether any plain loop at the batch size is compiled (any window, any form): a host
    lookup over the compiled programs' keys, by their head (name, block size, slots) as
    `programs.batched_loop_key` builds it."""
    head = self.programs.batched_loop_key(1, self.batch_size, None)[:3]
    return any(key[:3] == head for key in self.compiled.keys())

  def plain_loop_ready(self, max_pos: int, form: SamplingForm) -> bool:
    """Whether the plain loop a probe of decoding rows up to `max_pos` sampling in `form` would
    call at the batch size is compiled (`precompile`'s, or an earlier call's): the probe then
    compiles nothing."""
    return self.programs.batched_loop_key(
        1, self.batch_size, self._slots_window(1, max_pos), False, form) in self.compiled

  def _probes_on(self, block_size: int) -> bool:
    """Whether a batch drafting at `block_size` may time its plain side by probes: its
    requests may start plain, prices are kept current from the calls, probes are on."""
    return self._batch_starts_plain(block_size) and self.online and self.starts.plain_probes

  def start_priced(self, block_size: int) -> bool:
    """Whether a batch's start rule weighs a request of `block_size` in plain steps now, timed
    or by the forward prior (`_start_priced` at the engine's batch size)."""
    return self._start_priced(block_size, self.batch_size)

  def _batch_starts_plain(self, block_size: int) -> bool:
    """Whether a batch's request of `block_size` may start, and its rows move, plain: a
    speculative size, a batch, plain starts on."""
    return block_size > 1 and self.batch_size > 1 and self.may_start_plain

  def _batch_price(self, block_size: int) -> tuple[float, bool] | None:
    """(a cycle's price in plain-loop steps at the engine's batch size, whether the plain loop
    has been timed there): what a batch's start rule weighs a request of `block_size` by, for
    `plain_now` and `cycles_lose`; None where no batch request of it may start plain."""
    if not self._batch_starts_plain(block_size):
      return None
    return (self.prices.start_break_even(block_size, self.batch_size, self._forward_prior),
            self._start_priced(block_size, self.batch_size))

  def start_choice(self, block_size: int) -> StartChoice | None:
    """Where a request of `block_size` that is no explorer would start now, at the engine's
    batch size, and the recent τ and price that choice rests on (`StartChoice`); None where
    starts are not priced (no start rule, or block size 1). Counts no start."""
    if self.starts is None or block_size == 1:
      return None
    price, batch_rule = self._start_price(block_size, self.batch_size)
    if batch_rule:
      starts = self._batch_starts()
      plain = starts.batch_plain_now(price, self._start_priced(block_size, self.batch_size))
      return StartChoice(starts.batch_tau(), price, plain)
    return StartChoice(self.starts.tau(), price, self.starts.alone_plain_now(price))

  @property
  def last_start_explored(self) -> bool:
    """Whether the last `request_start` in a batch was an explorer's (`StartBackoff`)."""
    return self.starts is not None and self.starts.last_explored

  @property
  def may_start_plain(self) -> bool:
    """Whether a request decoded alone may run the plain AR loop in place of a deep start
    (`starts_plain`): the priced start is on, with `LoopOptions.start_plain`."""
    return self.starts is not None and self.loop_options.start_plain

  def starts_plain(self, block_size: int, start: tuple[int, int], forced: bool = False) -> bool:
    """Whether a request whose `request_start` is deep (`start_backoff`) runs the plain AR loop
    instead (`LoopOptions.start_plain`): alone, the recent requests' cycles committed clearly
    fewer tokens than a cycle costs, so it takes no probing cycle at all (each costs several AR
    steps where drafting loses); in a batch, fewer than a cycle costs in the plain loop's steps,
    and it takes a slot of the plain AR bucket (`Scheduler`). The explorers
    (`StartBackoff.start`) still draft. Never for the tests' forced drafts (they test the
    speculative loop)."""
    return block_size > 1 and start[1] > 0 and not forced and self.may_start_plain

  def request_done(self, gen: Generation) -> None:
    """A finished request's cycles inform where the next ones start (`start_backoff`); those of
    one that moved to the plain bucket did when it moved (`request_moved`)."""
    if self.starts is not None and gen.block_size > 1 and not gen.moved_plain:
      self.starts.observe(gen.acceptance_lengths)

  def request_moved(self, acceptance_lengths: Sequence[int]) -> None:
    """A request that moved to the plain bucket mid-decode (`BatchOptions.move_plain_after`):
    its cycles, all it will run, inform where the next requests start at once, not when it
    finishes: those routed meanwhile then see that its batch's drafting lost."""
    if self.starts is not None:
      self.starts.observe(acceptance_lengths)

  def request_window(self, prompt_len: int, max_new_tokens: int, block_size: int) -> int | None:
    """The attention window of a one-request loop (`programs.request_window`): room for the
    prompt, max_new_tokens and one block (None: all max_len slots)."""
    return request_window(prompt_len + max_new_tokens + block_size, self.max_len)

  def precompile(self, block_sizes: Sequence[int], length_buckets: Sequence[int] | None = None,
                 policy: bool = False, plain_prefill: bool = True,
                 request_lengths: Sequence[int] = (), all_windows: bool = False,
                 forms: Sequence[SamplingForm] = (SamplingForm.GREEDY,),
                 progress: bool | None = None, fit: bool = False, warm: bool = False) -> dict:
    """Compiles prefill for each length bucket and the loop of each block size ahead of time
    (`policy`: also the prefill that runs the policy; `plain_prefill`: the one without); with
    batch_size > 1, the batched loops instead of the one-request loops, which are compiled for
    the attention windows that requests of these lengths (prompt + max_new_tokens) take
    (`request_window`; none given: the loops over all slots). `all_windows` (batched): the
    batched loops for every attention window a call may pick (`programs.window_buckets`), each
    also run once (its warm-up, its rows made to decode), each prefill run once too
    (`_warm_prefill`), a request's insertion into a slot (`insert_program`) and
    every change of a bucket's size (`resize_program`), so
    that no request compiles anything: a server's start-up (with the moves of a speculative
    bucket's rows to the plain one, `BatchOptions.move_plain_after`). With
    `BatchOptions.shrink` the batched loops are compiled for every size of `slot_sizes`.
    `forms`: the sampling forms requests will need (`sampling.form_of` of their settings; each
    program is compiled once per form: greedy requests alone, the default, need GREEDY).
    `warm` (batch 1): each one-request loop is also run once, its untimed first runs
    (`LoopPrograms.warm`, which the request that first uses a loop otherwise makes: ~140 ms a
    loop at the demo's shapes on a CPU, in that request's wall time though not in its
    `decode_s`), and each prefill program and the drafter's context built after one
    (`_warm_prefill_alone`: a program's first run, otherwise in the `prefill_s` of the first
    request of its length bucket and form), so that timed requests hold none (a benchmark's,
    decode.py's). With batch_size > 1, `all_windows` warms the batched loops and prefills.
    Refuses (`compiled.MapLimitError`) where the programs would pass the process's memory-map
    limit, or with `fit` compiles those that fit, in order, and leaves the rest to compile on
    first use (a server's start-up). The summary's `precompile_left` counts those left."""
    if policy and self.p_graph is None:
      raise BadInputError("precompile(policy=True) on an engine without a policy")
    for b in block_sizes:
      self.check_block_size(b)
    steps = [step for form in forms for step in self._precompile_steps(
        block_sizes, length_buckets, policy, plain_prefill, request_lengths, all_windows,
        SamplingForm(form), warm)]
    left = run_steps(steps, progress, fit)
    return {**self.compiled.summary(), "precompile_left": left}

  def _precompile_steps(self, block_sizes, length_buckets, policy, plain_prefill,
                        request_lengths, all_windows, form: SamplingForm, warm: bool = False
                        ) -> list[PrecompileStep]:
    """`precompile`'s steps for one sampling form (its arguments checked), in order."""
    seed_key, z, sp = jax.random.key(0), jnp.int32(1), sampling_params()
    steps: list[PrecompileStep] = []
    add = lambda kind, program, done, build: steps.append(
        PrecompileStep(kind, build, program, done))
    never = lambda: False
    # A request that would start deep may run the plain AR loop (`starts_plain`), a bucket or not.
    plain = ((1,) if 1 not in block_sizes and any(b > 1 for b in block_sizes)
             and self.may_start_plain else ())
    # The plain loop's requests are prefilled without the drafter (`plain_prefill`), the
    # others with it: each that will run compiles here.
    kinds = dict.fromkeys(self._prefill_form(False, b, False)[0]
                          for b in tuple(block_sizes) + plain) or [DraftContext.BUILT]
    learned = self._learned_contexts()

    def prefill(tokens_1P, context, with_policy=False):
      """(A prefill program, compiled; its output where it ran, else None.) With `all_windows`
      (a server's start-up) a batch's also runs once (`_warm_prefill`: its first run's fixed
      cost, ~45 ms at the demo's shapes on a CPU, else in the wall time of the first request
      of its length bucket), and with `warm` a lone request's (`_warm_prefill_alone`)."""
      make = functools.partial(self._prefill, tokens_1P, z, seed_key, sp, form,
                               with_policy=with_policy, context=context)
      fn, args = make()
      if all_windows:
        self._warm_prefill(fn, make)
      elif warm and self.batch_size == 1:
        return fn, self._warm_prefill_alone(fn, args, context)
      return fn, None

    def policy_prefill(tokens_1P, context):
      fn, out = prefill(tokens_1P, context, with_policy=True)
      if context == DraftContext.LATER:  # and its drafter context, built after it
        hiddens = fn.out_info.context_hiddens
        context_fn = self.programs.draft_context((self.d_weights, hiddens, z, self.draft_cache))
        # its first run too, on the warmed prefill's output (once: each sampling form's
        # prefills share it)
        if out is not None and context_fn not in self._warmed_prefills:
          self.draft_cache = self._first_run(context_fn, (self.d_weights, out.context_hiddens,
                                                          z, self.draft_cache))

    if not plain_prefill:  # a learned request routed plain before its prefill: the target's
      kinds = ({DraftContext.NONE: None} if policy and self.routes_learned_early else {})
    for P in length_buckets or self.length_buckets:
      tokens_1P = jnp.zeros((1, P), jnp.int32)
      for context in kinds:
        add("prefill", None, never, functools.partial(prefill, tokens_1P, context))
      for context in learned if policy else ():
        add("policy prefill", None, never, functools.partial(policy_prefill, tokens_1P, context))
    if self.batch_size > 1:
      # Shapes suffice on one device; on a mesh the placements count too (a carry is then
      # made when its step runs, not held by the list). Keys read shapes alone.
      shape_of = functools.cache(self.carry_shape)
      carry_of = lambda b, rows: (self.slot_carry(b, rows=rows, compiled=False)
                                  if self.mesh is not None else shape_of(b, rows))
      compiled_key = lambda pkey: lambda: pkey in self.compiled
      # The fresh buffers each batch call makes (`LoopPrograms.fresh`): staging, and each
      # bucket's state of batch_size slots.
      pkey = ("staging_buffers",)
      add("buffers", pkey, compiled_key(pkey), self.staging_buffers)
      for b in tuple(block_sizes) + plain:
        pkey = ("slot_carry", b > 1, self.batch_size, False)
        add("buffers", pkey, compiled_key(pkey), functools.partial(self.slot_carry, b))
      for b in tuple(block_sizes) + plain:
        loop = "ar loop" if b == 1 else "spec loop"
        for rows in self.slot_sizes():  # the batch's, then its tail's (`BatchOptions.shrink`)
          for w in window_buckets(self.max_len) if all_windows and self.sync_cycles > 0 else ():
            max_pos = max(0, w - b * (1 + self.sync_cycles // 2))
            pkey = self.programs.batched_loop_key(b, rows, self._slots_window(b, max_pos),
                                                  False, form)
            add(loop, pkey, lambda pkey=pkey: (pkey in self.compiled
                                            and pkey in self.programs.warmup_seconds),
                lambda b=b, rows=rows, max_pos=max_pos: self.slots_program(
                    b, self.slot_carry(b, rows=rows, compiled=False), max_pos=max_pos,
                    form=form))
          pkey = self.programs.batched_loop_key(b, rows, None, False, form)  # one warmed above
          add(loop, pkey, compiled_key(pkey), lambda b=b, rows=rows: self.programs.batched_loop(
              b, rows, None, self._slots_args(b, carry_of(b, rows)), form=form))
          if not all_windows:
            continue
          if rows == self.batch_size:  # a request's insertion into a free slot
            pkey = self.programs.insert_key(shape_of(b, rows))
            add("insert", pkey, compiled_key(pkey), lambda b=b: self.insert_program(
                carry_of(b, self.batch_size), 0, BatchRequest(0, [0], 1, 0, b),
                decode_loops.PrefillOut(z, *self.staging_buffers(), None, None)))
          for size in self.slot_sizes():  # shrinking to any smaller size, growing back to B
            if size < rows or (size == self.batch_size and rows < size):
              pkey = self.programs.resize_key(shape_of(b, rows), size)
              add("resize", pkey, compiled_key(pkey), lambda b=b, rows=rows, size=size:
                  self.resize_program(carry_of(b, rows), [], size))
          if b > 1 and self.may_start_plain and self.move_plain_after:  # its rows moving to
            pkey = self.programs.move_key(shape_of(1, self.batch_size), shape_of(b, rows))
            add("move", pkey, compiled_key(pkey), lambda b=b, rows=rows: self.move_program(
                carry_of(1, self.batch_size), 0, carry_of(b, rows), 0))  # the plain bucket
      return steps
    pre = decode_loops.PrefillOut(z, self.cache, self.draft_cache, None, None)
    for b in tuple(block_sizes) + plain:
      windows = [request_window(n + b, self.max_len) for n in request_lengths] or [None]
      for window in dict.fromkeys(windows):
        loop = "ar loop" if b == 1 else "spec loop"
        if warm:  # compiled, then run on copies of the engine's buffers
          pkey = self.programs.loop_key(b, False, window, form)
          add(loop, pkey, lambda pkey=pkey: pkey in self.programs.warmup_seconds,
              lambda b=b, window=window: self._warm_loop(pre, z, WARMUP_TOKENS, sp, seed_key,
                                                         b, None, window, form))
          continue
        add(loop, None, never, lambda b=b, window=window: self.programs.loop(
            b, self._loop_args(pre, z, z, sp, seed_key, b), window=window, form=form))
    return steps

  # -- public -------------------------------------------------------------------------------
  def encode_padded(self, prompt_ids: Sequence[int]) -> tuple[np.ndarray, int]:
    n = len(prompt_ids)
    P = pick_bucket(n, self.length_buckets, flag="--config.max_len / --config.length_buckets")
    toks = np.zeros((1, P), np.int32)
    toks[0, :n] = prompt_ids
    return toks, P

  def _forced_seq(self, n: int, forced_continuation: Sequence[int]) -> np.ndarray:
    """[1, S] the perfect drafter's tokens at their positions (-1 past the continuation: the
    drafter's own drafts there)."""
    forced = np.full((1, self.max_len), -1, np.int32)  # -1: no forced token (the drafter's)
    cont = list(forced_continuation)[:self.max_len - n]
    forced[0, n:n + len(cont)] = cont
    return forced

  def _check_one(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 block_size: int | str) -> None:
    """Refuses a request this engine cannot serve (size, prompt ids, learned without policy)."""
    n = len(prompt_ids)
    if isinstance(block_size, str):
      if block_size != LEARNED:
        raise BadInputError(f"block_size={block_size!r}: give an integer bucket or {LEARNED!r}")
      if self.p_graph is None:
        raise BadInputError("block_size='learned' needs a block-size policy "
                            "(--config.policy with --config.block_policy=learned)")
      self.check_request(n, max_new_tokens, max(self.policy_sizes))
    else:
      self.check_request(n, max_new_tokens, block_size)
    self.checks.check_prompt_ids(prompt_ids)

  def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, block_size: int | str = 1, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0,
               forced_continuation: Sequence[int] | None = None,
               return_features: bool = False,
               sampling_form: SamplingForm | None = None) -> Generation:
    """Decodes one request with a fixed bucket `block_size`, or with the bucket the engine's
    policy picks from the prefill (`block_size=LEARNED`).

    `sampling_form` (benchmarks): the programs' sampling form (`sampling.SamplingForm`), at
    least the one the settings need (None: that one, `sampling.form_of`); the same tokens in
    any form that serves them.

    `forced_continuation` (tests, benchmarks): tokens the perfect drafter proposes after the
    prompt, e.g. the target's own greedy output (a separately compiled loop). `return_features`:
    copy the prefill's policy features to the host (`Generation.features`). The reported prefill
    time includes the policy and reading its choice back to the host.

    Raises:
      BadInputError: a request the engine cannot serve, or NaN/inf logits (the request stops
        there; nothing past the last finite position is returned).
    """
    n = len(prompt_ids)
    self._check_one(prompt_ids, max_new_tokens, block_size)
    check_sampling(temperature, top_k, top_p, min_p)
    settings = (temperature, top_k, top_p, min_p)
    n_arr, sp, form = np.int32(n), sampling_params(*settings), form_of([settings])
    if sampling_form is not None:
      if sampling_form not in tuple(SamplingForm) or sampling_form < form:
        given = getattr(sampling_form, "name", repr(sampling_form))
        raise BadInputError(f"sampling_form={given}: the request's settings need {form.name} "
                            f"or above ({', '.join(f.name for f in SamplingForm)})")
      form = SamplingForm(sampling_form)
    seed_key = seed_key_of(seed)
    forced = forced_continuation is not None
    # A fixed size's start is known before the prefill (a plain one's needs no drafter
    # context, `plain_prefill`); a learned size's once its policy chose, or before its prefill
    # where the start rule routes it (`routes_learned_early`): routed plain, it decodes as a
    # plain request of the route's size and its policy does not run.
    learned = isinstance(block_size, str)
    start = None
    if learned and not forced and self.routes_learned_early:
      size = self.route_size
      start = self.request_start(size)
      if self.starts_plain(size, start, forced):
        learned, block_size = False, size
    elif not learned:
      start = self.request_start(block_size)
    plain = not learned and self.starts_plain(block_size, start, forced)
    req = BatchRequest(0, prompt_ids, max_new_tokens, seed, block_size, sampling=settings)
    pre, block_size, prefill_s, probs = self.stage(
        req, (self.cache, self.draft_cache), form, run_size=1 if plain else None,
        return_features=return_features)
    self.cache, self.draft_cache = pre.cache, pre.draft_cache  # before any raise: donated
    self.check_prefill(pre, n)
    features = ({k: np.asarray(v[0]) for k, v in pre.features.items()} if return_features
                else None)
    forced_seq = self._forced_seq(n, forced_continuation) if forced else None
    if learned:
      start = self.request_start(block_size) if start is None else start  # (routed: drafting)
      plain = self.starts_plain(block_size, start, forced)
      if not plain:  # its drafter context, where the prefill left it for now
        pre, context_s = self.build_draft_context(pre, n)
        self.draft_cache, prefill_s = pre.draft_cache, prefill_s + context_s
    # A plain start runs the AR loop (its drafting is what recent requests lost: no probing
    # cycle); the request keeps its bucket, `Generation.plain_start` says how it ran.
    run_size, start = (1, (0, 0)) if plain else (block_size, start)
    loop_args = self._loop_args(pre, n_arr, np.int32(max_new_tokens), sp, seed_key,
                                run_size, forced_seq, start)
    window = self.request_window(n, max_new_tokens, run_size)
    self._warm_loop(pre, n_arr, max_new_tokens, sp, seed_key, run_size, forced_seq, window, form)
    fn = self.programs.loop(run_size, loop_args, forced, window, form)
    t2 = self.clock()
    out = fn(*loop_args)
    # What the host reads, in one read-back (an array read alone is a transfer of its own).
    host = jax.device_get((out.n_gen, out.forward_counts, out.forwards, out.bad_logits,
                           out.seq, out.accept_lens, out.is_cycle, out.verified, out.evidence))
    n_gen, counts_N, forwards, bad_logits, seq_1S, accept_S, is_cycle_S, verified_S, evid = host
    n_gen, forwards = int(n_gen), int(forwards)
    decode_s = self.loop_ran(t2, counts_N, 1, run_size)
    if evid is not None:
      self.evidence_state = evid
    self.seq, self.cache = out.seq, out.cache
    if out.draft_cache is not None:
      self.draft_cache = out.draft_cache
    if bool(bad_logits):
      self.raise_nonfinite(n + n_gen, "a decode step")
    if n_gen < max_new_tokens and not np.isin(seq_1S[0, n:n + n_gen], self.stop_ids).any():
      raise RuntimeError(f"the decode loop stopped at {n_gen} of {max_new_tokens} tokens with "
                         f"no stop token (window {window}): a bug, please report it")
    gen = generation_of(seq_1S[0], accept_S, is_cycle_S, verified_S, forwards, n,
                        n_gen, self.stop_ids, max_new_tokens, block_size, prefill_s, decode_s,
                        probs, features, plain_start=plain,
                        policy_block_size=block_size if learned else None)
    self.request_done(gen)
    return gen


  # -- many requests at once (continuous batching per bucket, `scheduler`) ------------------
  def generate_batch(self, prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int | Sequence[int], temperature=0.0,
                     seeds: Sequence[int] | int = 0,
                     block_size: int | str | Sequence[int | str] = 1, top_k=0,
                     top_p=1.0, min_p=0.0,
                     stop_token_ids: Sequence[Sequence[int]] | None = None,
                     forced_continuations: Sequence[Sequence[int]] | None = None
                     ) -> list[Generation]:
    """Decodes many requests, up to `batch_size` at a time per block-size bucket, refilling
    finished slots every `sync_cycles` cycles (`scheduler`). Every request's output is the one
    `generate` gives it alone (same seed and settings); results come back in the order of
    `prompts`.

    `max_new_tokens`, `seeds`, `block_size` (a bucket or LEARNED) and the sampling settings
    (`temperature`, `top_k`, `top_p`, `min_p`) may be one value or one per request (an int seed
    s gives request i the seed s + i): rows of one batch sample with their own settings, and
    one compiled loop per sampling form (`sampling.SamplingForm`) serves every value.
    `stop_token_ids`: per request, stop ids besides the engine's (at most
    `state.MAX_ROW_STOP_IDS`). `forced_continuations`: as in `generate`, one per request.
    """
    N = len(prompts)
    per = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * N
    max_new, sizes = per(max_new_tokens), per(block_size)
    seed_list = list(seeds) if isinstance(seeds, (list, tuple)) else [seeds + i for i in range(N)]
    temps, ks, ps, mins = per(temperature), per(top_k), per(top_p), per(min_p)
    stops = list(stop_token_ids) if stop_token_ids is not None else [()] * N
    for name, v in (("max_new_tokens", max_new), ("block_size", sizes), ("seeds", seed_list),
                    ("temperature", temps), ("top_k", ks), ("top_p", ps), ("min_p", mins),
                    ("stop_token_ids", stops)):
      if len(v) != N:
        raise BadInputError(f"generate_batch: {len(v)} {name} for {N} prompts")
    forced = forced_continuations is not None
    reqs = []
    for i, ids in enumerate(prompts):
      if forced and isinstance(sizes[i], str):
        raise BadInputError("forced continuations need fixed block sizes")
      reqs.append(self.batch_request(
          i, ids, max_new[i], seed_list[i], sizes[i], (temps[i], ks[i], ps[i], mins[i]),
          stops[i], forced_continuations[i] if forced else None))
    return Scheduler(self, reqs, forced=forced).run()

  def batch_request(self, index: int, prompt_ids: Sequence[int], max_new_tokens: int,
                    seed: int = 0, block_size: int | str = 1, sampling: tuple = (0.0, 0, 1.0, 0.0),
                    stop_token_ids: Sequence[int] = (),
                    forced_continuation: Sequence[int] | None = None) -> BatchRequest:
    """A checked `BatchRequest` (a scheduler's input): `sampling` = (temperature, top_k,
    top_p, min_p); raises BadInputError naming what this engine cannot serve."""
    self._check_one(prompt_ids, max_new_tokens, block_size)
    check_sampling(*sampling)
    stop_token_ids = [int(t) for t in stop_token_ids]
    if len(stop_token_ids) > MAX_ROW_STOP_IDS:
      raise BadInputError(f"stop_token_ids: at most {MAX_ROW_STOP_IDS} per request, got "
                          f"{len(stop_token_ids)}")
    if any(not 0 <= t < self.cfg.vocab_size for t in stop_token_ids):
      raise BadInputError(f"stop_token_ids: ids must be in [0, {self.cfg.vocab_size})")
    temperature, top_k, top_p, min_p = sampling
    return BatchRequest(index, list(prompt_ids), int(max_new_tokens), int(seed), block_size,
                        forced_continuation,
                        (float(temperature), int(top_k), float(top_p), float(min_p)),
                        tuple(stop_token_ids))

  def scheduler(self, track_progress: bool = True) -> Scheduler:
    """An empty scheduler over this engine's batched loops, for requests that arrive one by one
    (`Scheduler.submit` / `step` / `cancel`; a server's engine thread)."""
    return Scheduler(self, track_progress=track_progress)

  def slot_carry(self, block_size: int, forced: bool = False, rows: int | None = None,
                 compiled: bool = True) -> LoopState:
    """A batched loop state of `rows` (None: `batch_size`) empty slots for a bucket (fresh
    buffers), made by one compiled call (`LoopPrograms.fresh`: one program per (plain or
    speculative, rows, forced)); `compiled=False`: op by op (a state made once, e.g.
    precompile's of each shrunk size, needs no program of its own)."""
    rows = self.batch_size if rows is None else rows
    build, args = self._carry_build(block_size, rows, forced)
    if not compiled:
      return self._placed(build(*args))
    return self.programs.fresh(("slot_carry", block_size > 1, rows, forced), build, args,
                               None if self.mesh is None else self._placements)(*args)

  def carry_shape(self, block_size: int, rows: int | None = None) -> LoopState:
    """The abstract `slot_carry` (shapes and dtypes, nothing made)."""
    build, args = self._carry_build(block_size, self.batch_size if rows is None else rows)
    return jax.eval_shape(build, *args)

  def _carry_build(self, block_size: int, rows: int, forced: bool = False) -> tuple:
    """(`_empty_state` for a bucket of `block_size` and `rows` slots, its arguments: the
    priced controller's current break-even and the engine's evidence, both runtime values)."""
    build = functools.partial(self._empty_state, block_size > 1, rows, forced)
    return build, (self.break_even_N(block_size, rows),
                   self.evidence_state if block_size > 1 else None)

  def _empty_state(self, speculative: bool, rows: int, forced: bool, break_even_N,
                   evidence_7) -> LoopState:
    """A batched state of `rows` empty slots around zero buffers (pure: run op by op, traced
    by `LoopPrograms.fresh` or by `jax.eval_shape`); the plain loop's carries no drafter
    cache."""
    cache, draft_cache = self._new_caches(rows, speculative)  # in the form the loops carry
    seq = jnp.zeros((rows, self.max_len), jnp.int32)
    forced_seq = jnp.full_like(seq, -1) if forced else None
    return LoopState.empty(seq, cache, draft_cache, forced_seq, max(self.block_sizes),
                           break_even_N, evidence_7)

  def _placements(self, state: LoopState) -> LoopState:
    """The shardings `_placed` gives a batched state (concrete or abstract) on the mesh."""
    return state.replace(
        cache=cache_sharding(state.cache, self.mesh),
        draft_cache=(None if state.draft_cache is None
                     else cache_sharding(state.draft_cache, self.mesh))).map_rows(
                         lambda x: batch_sharding(x, self.mesh))

  def _placed(self, state: LoopState) -> LoopState:
    """A batched state's rows on the mesh's `data` axis (when the batch divides it), its caches
    by `cache_sharding` (no mesh: as it is)."""
    return state if self.mesh is None else jax.device_put(state, self._placements(state))

  def slot_sizes(self) -> tuple[int, ...]:
    """The row counts a bucket's state may have: `batch_size`, then halving (rounded up) to 1
    while `shrink` is on (`BatchOptions.shrink`); `batch_size` alone otherwise."""
    sizes = [self.batch_size]
    while self.shrink and sizes[-1] > 1:
      sizes.append(-(-sizes[-1] // 2))
    return tuple(sizes)

  def resize_program(self, carry: LoopState, rows: Sequence[int], size: int) -> tuple:
    """(compiled resize, its arguments): calling it returns a state of `size` slots whose slot
    i holds `carry`'s slot rows[i] (i < len(rows)), the rest empty (`LoopState.take_rows`): a
    bucket shrunk to the requests it holds, or grown back. Copies those requests' caches once;
    `carry` is not donated (its buffers are freed when the caller drops it)."""
    src = np.zeros((size,), np.int32)
    src[:len(rows)] = rows
    args = (carry, src, np.arange(size) < len(rows))
    fn = self.programs.resize(args)
    return (lambda *a: self._placed(fn(*a))), args

  def move_program(self, carry: LoopState, row: int, src: LoopState, src_row: int) -> tuple:
    """(compiled move, its arguments): calling it returns `carry` (donated) with slot `row`
    holding `src`'s request of slot `src_row` as it stands mid-decode (`LoopState.
    with_row_from`: its tokens, target cache, records and settings; one slot-sized copy).
    `src` is not donated: the caller empties that slot."""
    args = (carry, np.int32(row), src, np.int32(src_row))
    return self.programs.move(args), args

  def staging_buffers(self) -> tuple:
    """Fresh one-sequence caches a request is prefilled into before it takes a slot (the
    scheduler reuses them once the request is in its slot), placed on the mesh; made by one
    compiled call (`LoopPrograms.fresh`)."""
    build = lambda: self._new_caches(1)
    placements = None if self.mesh is None else (lambda caches: tuple(
        None if c is None else cache_sharding(c, self.mesh) for c in caches))
    return self.programs.fresh(("staging_buffers",), build, (), placements)()

  def stage(self, req: BatchRequest, buffers: tuple, form: SamplingForm | None = None,
            run_size: int | str | None = None, return_features: bool = False) -> tuple:
    """Prefills `req` with its sampling settings (`BatchRequest.sampling`; None: greedy; in
    `form`, None: the one they need) into one-sequence `buffers` (donated; the filled ones are
    `PrefillOut.cache` / `draft_cache`): (PrefillOut, its block size, prefill seconds including
    the policy and reading its choice back, the policy's decision scores or None: probabilities
    of a classify head, shrunk value ratios of a value head, `BlockPolicy.decide`). The caller
    checks `check_prefill` once it holds the filled buffers. `run_size`: the block size whose
    loop the request will run, where known before its prefill (None: its own); the plain
    loop's requests are prefilled without the drafter (`plain_prefill`: `draft_cache` is then
    the given buffer, untouched), and so are a learned size's where `defers_context` (its
    drafter context is built by `build_draft_context` once its route drafts).
    `return_features`: the prefill returns every feature type (`PrefillOut.features`); none
    otherwise."""
    learned = isinstance(req.block_size, str)
    context, features = self._prefill_form(
        learned, req.block_size if run_size is None else run_size, return_features)
    toks, _ = self.encode_padded(req.prompt_ids)
    settings = [req.sampling] if req.sampling else []  # none: greedy (`sampling_params()`)
    prefill = functools.partial(
        self._prefill, toks, np.int32(len(req.prompt_ids)), seed_key_of(req.seed),
        sampling_params(*(req.sampling or ())), form_of(settings) if form is None else form,
        with_policy=learned, context=context, features=features)
    fn, args = prefill(buffers=buffers)
    self._warm_prefill(fn, prefill)
    t0 = time.perf_counter()
    pre = fn(*args)
    if context != DraftContext.BUILT:  # (only with a drafter: `_prefill_form`)
      pre = pre._replace(draft_cache=buffers[1])
    # What the host reads, in one read-back (each array read alone is a transfer of its own):
    # the policy's choice and scores, and the check of the prompt's logits (`check_prefill`).
    bad, cls, scores_C = jax.device_get((pre.bad_logits, pre.policy_class, pre.policy_probs)
                                        if learned else (pre.bad_logits, None, None))
    pre.first_tok.block_until_ready()
    secs = time.perf_counter() - t0
    pre = pre._replace(bad_logits=bool(bad))
    block_size = self.policy_sizes[int(cls)] if learned else req.block_size
    if learned:
      self._last_pick = block_size
    probs = [round(float(p), 6) for p in scores_C] if learned else None
    return pre, block_size, secs, probs

  def _warm_prefill(self, fn, prefill) -> None:
    """Runs a batch's prefill program (batch_size > 1) once, untimed, into fresh staging
    buffers the first time it is used (`prefill(buffers=...)`: its arguments): a program's
    first run has a fixed cost of its own (~40-50 ms on the demo's CPU, against ~10-15 ms
    after), which the first request to use it paid in its `prefill_s`. A program two methods
    share (the target-only prefill of AR's requests and of learned ones routed plain) then
    charged it to whichever ran first: `python decode.py --config.batch_size=4` read the
    learned default at 0.82-0.85x AR end to end against 0.98-1.01x when each had a prefill of
    its own."""
    if self.batch_size == 1 or fn in self._warmed_prefills:
      return
    warm_fn, warm_args = prefill(buffers=self.staging_buffers())
    self._first_run(warm_fn, warm_args)
    self._warmed_prefills.add(fn)

  def _warm_prefill_alone(self, fn, args: tuple, context: DraftContext):
    """Runs a lone request's prefill program once, untimed, the first time `precompile(warm=
    True)` meets it (None after): its first run's fixed cost, which the first request of its
    length bucket and form otherwise pays in its `prefill_s`. Into the engine's own one-sequence
    buffers (`args`' donated ones; every request's prefill writes them anew); returns its output
    (`PrefillOut`)."""
    if fn in self._warmed_prefills:
      return None
    out = self._first_run(fn, args)
    self.cache = out.cache
    if context == DraftContext.BUILT:  # (the other forms leave the drafter's buffer undonated)
      self.draft_cache = out.draft_cache
    return out

  def _first_run(self, fn, args: tuple):
    """`fn(*args)` (a prefill's or drafter context's program), waited for, as its untimed
    first run: counted once (`_warmed_prefills`), its seconds in `prefill_warmup_seconds`."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    self.prefill_warmup_seconds += time.perf_counter() - t0
    self._warmed_prefills.add(fn)
    return out

  def check_prefill(self, pre, n: int) -> None:
    """Raises the clear error of NaN/inf logits at the prompt's last position (`stage` read
    the check back with the policy's choice)."""
    if pre.bad_logits:
      self.raise_nonfinite(n, "the prefill")

  def insert_program(self, carry: LoopState, row: int, req: BatchRequest, pre,
                     sp=None, start: tuple[int, int] = (0, 0)) -> tuple:
    """(compiled insertion, its arguments): calling it returns `carry` (donated) with slot
    `row` holding the prefilled request, with its sampling settings `sp` (SamplingParams; None:
    the request's own), its stop ids and the (misses, AR steps) it starts with (`start`,
    `request_start`). Compiles on first use, before any clock starts; one compilation for
    every setting."""
    n = len(req.prompt_ids)
    forced = (() if req.forced_continuation is None else
              (self._forced_seq(n, req.forced_continuation)[0],))
    draft_cache = pre.draft_cache if carry.draft_cache is not None else None
    if sp is None:
      sp = sampling_params(*(req.sampling or ()))  # None: greedy
    row_stop = np.full((MAX_ROW_STOP_IDS,), -1, np.int32)
    row_stop[:len(req.stop_token_ids)] = req.stop_token_ids
    args = (carry, np.int32(row), pre.cache, draft_cache, pre.first_tok, np.int32(n),
            np.int32(req.max_new_tokens), seed_key_of(req.seed), self._stop_arr, sp,
            row_stop, np.asarray(start, np.int32)) + forced
    return self.programs.insert(args), args

  def slots_program(self, block_size: int, carry: LoopState, forced: bool = False,
                    max_pos: int | None = None, ar_steps: int = 0,
                    form: SamplingForm = SamplingForm.ANY, forwards: int | None = None
                    ) -> tuple:
    """(compiled batched loop of a bucket, its arguments with `carry` donated): one call runs
    `sync_cycles` cycles (at most `forwards` where given: a runtime budget, the same program),
    or until no row decodes (0), each row with its own sampling settings
    (`LoopState.sp_B`) read in `form` (`sampling.form_of` the decoding rows' settings),
    attending over the window that the furthest decoding row (`max_pos`) needs
    (`programs.window_for`; `ar_steps`: the AR steps every decoding row asks for first, which
    need one slot each). Compiles the loop and runs
    it once on a copy of the carry (its first run's fixed cost) on first use, before any clock
    starts."""
    args = self._slots_args(block_size, carry)
    if forwards is not None and 0 < int(forwards) < self.sync_cycles:
      if int(forwards) not in self._budgets:  # placed once, not on every call
        self._budgets[int(forwards)] = jnp.asarray(int(forwards), jnp.int32)
      args = args[:-1] + (self._budgets[int(forwards)],)
    window = self._slots_window(block_size, max_pos, ar_steps)
    rows = int(carry.pos_B.shape[0])
    fn = self.programs.batched_loop(block_size, rows, window, args, forced, form)
    key = self.programs.batched_loop_key(block_size, rows, window, forced, form)
    self.programs.warm_batched(key, fn, args, block_size)
    return fn, args

  def _slots_args(self, block_size: int, carry: LoopState) -> tuple:
    """A batched loop's arguments around `carry` (concrete or abstract)."""
    states = (self.t_weights,) if block_size == 1 else (self.t_weights, self.d_weights)
    return states + (carry, self._stop_arr, self._sync_arr)

  def _slots_window(self, block_size: int, max_pos: int | None, ar_steps: int = 0
                    ) -> int | None:
    """The attention window of `slots_program`'s loop (`programs.window_for`; None: all)."""
    return (None if max_pos is None else
            window_for(max_pos, block_size, self.sync_cycles, self.max_len, ar_steps))

  @staticmethod
  def raise_nonfinite(pos: int, where: str) -> None:
    raise BadInputError(
        f"{where} produced NaN/inf logits at position {pos}: the model overflowed or its "
        "weights hold NaN (float16 overflows easily: try --config.dtype=bfloat16 or float32); "
        "the request was stopped, nothing past that position was kept")
