"""The options an engine is built from, frozen and checked once when made.

  ShapeOptions  the static shapes it compiles for: cache length, prompt length buckets, block
                sizes;
  LoopOptions   the form of its decode loops (verify rule, controller and its settings, AR
                fallback, layer form) and, per compiled loop, its bucket (block size, window,
                forced drafts, sampling form): what the loop builders read, and, with the batch
                size, what tells one compiled loop from another (`LoopOptions.key`);
  BatchOptions  how many requests decode at once and how often the host refills slots (a value
                the batched loops get with each call: no program of its own).

A bad value raises `BadInputError` naming the parameter (`ar_fallback=-1 ...`); the command line
maps parameter names to its flags (`errors.named_as_flags`).
"""

from __future__ import annotations

import dataclasses
from bp_jax.decoding import controller as control
from bp_jax.decoding.requests import check_batching, check_block_sizes
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.decoding.verify import check_verify_mode
from bp_jax.errors import BadInputError

DEFAULT_BLOCK_SIZES = tuple(range(2, 33))


def _set(obj, **fields) -> None:
  """Normalises fields of a frozen dataclass inside its `__post_init__`."""
  for name, value in fields.items():
    object.__setattr__(obj, name, value)


def _int_at_least(value, least: int, name: str) -> int:
  if isinstance(value, bool) or int(value) != value or value < least:
    raise BadInputError(f"{name}={value} must be an integer >= {least}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class ShapeOptions:
  """The static shapes an engine compiles for.

  max_len: cache slots per sequence (prompt + new tokens + block size - 1 must fit).
  length_buckets: prompt lengths are padded up to one of these (None: powers of two from 32 up
    to max_len).
  block_sizes: the block-size buckets requests may ask for (1 = plain AR decoding).
  """
  max_len: int
  length_buckets: tuple[int, ...] | None = None
  block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES

  def __post_init__(self):
    check_block_sizes(list(self.block_sizes), "block_sizes")
    _set(self, max_len=_int_at_least(self.max_len, 1, "max_len"),
         block_sizes=tuple(sorted(set(int(b) for b in self.block_sizes))),
         length_buckets=(tuple(sorted(int(n) for n in self.length_buckets))
                         if self.length_buckets else None))
    if self.length_buckets and self.length_buckets[-1] > self.max_len:
      raise BadInputError(f"length bucket {self.length_buckets[-1]} exceeds "
                          f"max_len={self.max_len}")


@dataclasses.dataclass(frozen=True)
class BatchOptions:
  """batch_size: slots per block-size bucket (1: one request at a time, the one-request loops);
  sync_cycles: target forwards (cycles; the priced controller's AR steps count one each)
  between the host's refills of finished slots (0: a batch runs until all its rows finish);
  shrink: a bucket whose requests no other request waits for (a batch's tail) runs a loop of
  fewer slots, the fewest of batch_size, ceil(batch_size / 2), ..., 1 that holds its
  requests, and grows back to batch_size when requests come for it (`Scheduler`): a step
  costs the same with idle slots, so a tail of 2 requests in 8 slots paid for 8. No effect
  with sync_cycles 0 (a static batch runs to its end in one call), nor where the engine
  measured its costs and a one-token forward over all rows costs under
  `engine.SHRINK_ROWS_COST` one-row ones (bandwidth-bound: fewer slots save little, and each
  tail size compiles a loop);
  join_learned: every request whose policy (`LEARNED`) picks a speculative size decodes at one
  size (`Engine.joint_size`: a priced policy's prior's cheapest at the engine's costs, else
  the middle of the policy's speculative sizes; a pick of 1 stays
  plain, `Engine.decode_size`): each bucket's calls
  compute all its slots, so requests spread over 3 sizes ran 3 half-empty loops by turns
  (`python decode.py --config.batch_size=4`: 0.44x plain decoding), and the picks, chosen for
  one request's costs, never beat one size in a batch (docs/design.md); one size also compiles
  one speculative loop per shape instead of one per policy size. The per-cycle controller
  still chooses how many drafts each cycle verifies; the policy's pick stays in
  `Generation.policy_block_size`. No effect at batch_size 1;
  move_plain_after: a speculative bucket's decoding requests move to the plain AR bucket
  (block size 1) mid-decode once their batch's cycles missed this many times in a row (the
  priced back-off's shared level; 0: never, nor the next), an explorer run's also once its
  own cycles commit too few tokens for the batch's start rule (`Engine.cycles_lose`: a miss
  weighs a cycle against the speculative loop's dearer AR steps), where that bucket has room:
  where
  drafting loses, a batch's explorers and its first requests (which draft before any τ is
  known) then pay a few cycles, not their whole decode in a second, half-empty bucket that
  runs by turns with the plain one (`Scheduler._move_losing`). Only with the priced start's
  plain starts (`LoopOptions.start_plain`), not for forced drafts; no effect at batch_size 1
  or with sync_cycles 0."""
  batch_size: int = 1
  sync_cycles: int = 16
  shrink: bool = True
  join_learned: bool = True
  move_plain_after: int = 3

  def __post_init__(self):
    check_batching(self.batch_size, self.sync_cycles, prefix="")
    _set(self, batch_size=int(self.batch_size), sync_cycles=int(self.sync_cycles),
         shrink=bool(self.shrink), join_learned=bool(self.join_learned),
         move_plain_after=_int_at_least(self.move_plain_after, 0, "move_plain_after"))


# `LoopOptions.controller_decline` None keeps the decline where a declined cycle saves at least
# this many AR steps: the verify of a loop's block size less an AR step, in the costs in effect
# (each size's loop its own verdict, `LoopOptions.decline_sizes`). It saves at most that per
# declined cycle, and every cycle pays for it: its full verify runs behind a branch (one branch
# index per cycle, a wait of the host for the device on a GPU) and its drafter probabilities
# over the vocabulary. On the first development CPU a b = 8 verify cost 1.9-2.5 AR steps (saving
# 0.9-1.5: kept), on the 2-core Xeon of model 207 1.43 (off: b = 8 with the decline forced on
# ran 0.961x b = 8 without it, docs/cpu_amx/start_spread_2026-12-07); on an H100 at Qwen3-4B
# shapes a b = 16 verify cost 1.23 / 1.44 / 1.90 AR steps at batch 4 / 8 / 16 (saving 0.23 /
# 0.44 / 0.90), and at batch 1 a 16-token forward cost less than the AR step; replayed at an
# accelerator's prices the decline gained 0.999-1.000x (docs/results/controller.md).
DECLINE_MIN_SAVING = 0.5


def declines_by_costs(costs, block_size: int, ar_step_tokens: int) -> bool:
  """Whether a declined cycle saves at least `DECLINE_MIN_SAVING` AR steps at `costs` (relative
  costs of forwards over 1, 2, 4, ... tokens, `LoopOptions.controller_costs`): a verify of
  `block_size` tokens less an AR step, a forward over `ar_step_tokens` tokens."""
  saving = control.verify_cost(block_size, costs) - control.verify_cost(ar_step_tokens, costs)
  return saving >= DECLINE_MIN_SAVING


# `LoopOptions.ar_step_tokens` 0 pads AR steps to two tokens where a forward over 2 tokens is
# priced below this many AR steps: clearly cheaper, not timing noise (on the development CPU it
# costs 1.1; on an H200 at Qwen3-4B shapes 0.62).
PAD_AR_BELOW = 0.9


@dataclasses.dataclass(frozen=True)
class LoopOptions:
  """The form of a decode loop; hashable (frozen, tuples only).

  Engine-wide (one value per engine):
    verify: the verify rule (`verify.VERIFY_MODES`): `exact` or `rejection`.
    controller: the verify-length controller (`controller.CONTROLLERS`, or the tests' "fixed:k"
      verifying k drafts every cycle).
    controller_costs: relative costs of a target forward over 1, 2, 4, ... tokens
      (`controller.parse_costs`; a comma-separated string is read too), in AR steps
      (`confidence` and `priced` read them).
    controller_draft_cost: one drafter pass, same unit. The two come as a pair: both given, or
      neither (None: measured where the engine runs, `Engine` through `costs.forward_costs`).
    controller_poor_miss: `confidence` counts a poorly accepted cycle as a miss too.
    controller_calibration: acceptance rates per p bin replacing the drafter's p (None: raw p;
      `confidence`, and `priced`'s decline).
    controller_decline: `priced`: after the drafter pass, a cycle verifies none of its drafts
      (a miss) when they are not expected to commit more tokens than their verify costs AR
      steps, by the drafter's probabilities scaled to the acceptance measured on the recent
      cycles (`decline`); False: every cycle verifies all its drafts. None: the engine
      decides from its costs (`declines_by_costs`): on in the loops of the block sizes whose
      verify costs at least `DECLINE_MIN_SAVING` AR steps more than an AR step
      (`decline_sizes`), off where a declined cycle would save less (on an H100 at Qwen3-4B
      shapes, batches 1-8); a loop built outside an engine declines.
    decline_sizes: with `controller_decline` on, the block sizes whose loops decline (None:
      every size); the engine sets it where it decided the decline from its costs: a block-size
      policy's engine (sizes up to 11) declined at b = 8 too, where b = 8's own engine, its
      verify saving less, did not (the 2-core Xeon, model 207: a b = 8 verify 1.43 AR steps).
      `for_loop` resolves it into each loop's `controller_decline`.
    controller_persist: `priced`: after a miss the rows take AR steps only while the cycles
      right after misses commit clearly less than cycles do on average (`evidence`: where one
      cycle's acceptance says nothing of the next, backing off is a pure loss); False: every
      miss backs off.
    online_costs: `priced` keeps its costs current from the engine's timed loop calls
      (`online_costs.OnlineCosts`; a runtime value of the loop state, no recompilation): True
      (every loop call), False (the start-up costs throughout), or None: every call when the
      engine measures the costs, off when they are given. The start-up costs bound a batch's
      prices below (`OnlineCosts.batch_prior_floor`). Host-side only: no compiled loop
      depends on it.
    start_backoff: `priced`: a request (alone, or taking a batch's slot) starts deep in the
      back-off (the cap's AR steps, then a miss backs off the whole cap) when
      the recent requests' cycles committed clearly fewer tokens than a cycle costs, every 4th
      request still starting with a cycle (`start_backoff.StartBackoff`); False: every
      request drafts first. Host-side only (runtime scalars of the loop state).
    start_plain: with `start_backoff`, a request that would start deep runs the plain AR loop
      instead, with no probing cycle (`Engine.starts_plain`): alone, the one-request AR loop;
      in a batch, a slot of the plain AR bucket, where drafting is weighed against the plain
      loop's measured step (`OnlineCosts.start_break_even`) and runs of explorers keep both
      sides measured (`start_backoff.StartBackoff`). False: it takes the cap's AR steps in the
      speculative loop and then probes.
    ar_fallback: at most this many AR steps in a row after poor cycles (0: none; `confidence`:
      16, `priced`: 64).
    priced_cap: `priced`: at most this many AR steps in a row after misses (0: `ar_fallback`,
      64 when that is 0 too): a cap of its own, so that a config may keep `ar_fallback` as the
      back-off its label sets were measured under (`controller.labelled_as`).
    ar_fallback_accept: a cycle accepting at most this many drafts is poor (`backoff`; unused by
      `priced`, whose misses are priced by the costs).
    scan_layers: run layers with `lax.scan` over stacked weights (else unrolled, per-layer
      weights and caches).
    ar_step_tokens: tokens a forward of one token per row runs over (an AR step, a declined
      cycle): 1; 2, the token and a copy after it whose output is dropped (its cache write lies
      past the row's position: the next forward overwrites it, or it falls past the cache),
      for machines where a one-row matrix product costs more than a two-row one (an H200 at
      Qwen3-4B shapes, batch 1: 5.39 ms against 3.32 ms); 0: 2 where the costs in effect
      price a forward over 2 tokens below `PAD_AR_BELOW` AR steps, else 1 (`in_effect`).
  Per compiled loop (`LoopPrograms` fills them in):
    block_size: tokens per cycle (1: plain AR decoding).
    window: attention reads cache slots [0, window) only (None: all).
    forced_drafts: the tests' perfect drafter (the carry's `forced_BS`; `exact` only).
    sampling_form: what the loop's sampling may do (`sampling.SamplingForm`, the engine's
      choice per call from the requests it decodes: a greedy loop draws nothing and branches on
      no setting); ANY (any settings) for a loop built outside an engine.
  """
  verify: str = "exact"
  controller: str = "backoff"
  controller_costs: tuple[float, ...] | None = None
  controller_draft_cost: float | None = None
  controller_poor_miss: bool = False
  controller_calibration: tuple[float, ...] | None = None
  controller_decline: bool | None = None
  decline_sizes: tuple[int, ...] | None = None
  controller_persist: bool = True
  online_costs: bool | None = None
  start_backoff: bool = True
  start_plain: bool = True
  ar_fallback: int = 0
  priced_cap: int = 0
  ar_fallback_accept: int = 1
  scan_layers: bool = False
  ar_step_tokens: int = 0
  block_size: int = 1
  window: int | None = None
  forced_drafts: bool = False
  sampling_form: SamplingForm = SamplingForm.ANY

  def __post_init__(self):
    for name in ("ar_fallback", "priced_cap", "ar_fallback_accept"):
      _int_at_least(getattr(self, name), 0, name)
    _int_at_least(self.block_size, 1, "block_size")
    if isinstance(self.ar_step_tokens, bool) or self.ar_step_tokens not in (0, 1, 2):
      raise BadInputError(f"ar_step_tokens={self.ar_step_tokens!r}: expected 1, 2 or 0 (2 where "
                          "the measured costs price two tokens below one)")
    check_verify_mode(self.verify, "verify")
    if not self.controller.startswith(control.FIXED_PREFIX):  # "fixed:k": checked when built
      control.check_controller(self.controller, "controller")
    calibration = self.controller_calibration
    if self.online_costs not in (None, True, False):
      raise BadInputError(f"online_costs={self.online_costs!r}: expected True, False or None "
                          "(on when the engine measures the costs)")
    costs, draft_cost = self.controller_costs, self.controller_draft_cost
    if (costs is None) != (draft_cost is None):
      raise BadInputError(f"controller_costs={costs!r} and controller_draft_cost={draft_cost!r}: "
                          "give both or neither (neither: the engine measures them)")
    _set(self, controller_costs=(None if costs is None else
                                 control.parse_costs(costs, "controller_costs")),
         controller_draft_cost=(None if draft_cost is None else
                                control.check_draft_cost(draft_cost, "controller_draft_cost")),
         controller_calibration=(None if calibration is None else
                                 control.check_calibration(calibration,
                                                           "controller_calibration")),
         controller_poor_miss=bool(self.controller_poor_miss),
         controller_decline=(None if self.controller_decline is None
                             else bool(self.controller_decline)),
         decline_sizes=(None if self.decline_sizes is None
                        else tuple(sorted(int(b) for b in self.decline_sizes))),
         controller_persist=bool(self.controller_persist),
         online_costs=None if self.online_costs is None else bool(self.online_costs),
         start_backoff=bool(self.start_backoff), start_plain=bool(self.start_plain),
         ar_fallback=int(self.ar_fallback), priced_cap=int(self.priced_cap),
         ar_fallback_accept=int(self.ar_fallback_accept),
         scan_layers=bool(self.scan_layers), ar_step_tokens=int(self.ar_step_tokens),
         block_size=int(self.block_size), forced_drafts=bool(self.forced_drafts),
         sampling_form=SamplingForm(self.sampling_form))
    if self.forced_drafts and self.verify != "exact":
      raise BadInputError("forced drafts are not draws from the drafter: only verify='exact'")

  def replace(self, **changes) -> "LoopOptions":
    return dataclasses.replace(self, **changes)

  def in_effect(self) -> "LoopOptions":
    """These options with the loop form in effect (`controller.loop_form`): `backoff` without
    fallback steps reads `none`, `none` takes no AR steps, `confidence` backs off up to
    `ar_fallback` steps (0: `controller.DEFAULT_SKIP_CAP`) and `priced` up to `priced_cap`
    (0: `ar_fallback`, or `PRICED_SKIP_CAP`); `ar_fallback` then holds the cap in effect."""
    controller, ar_fallback = control.loop_form(self.controller, self.ar_fallback,
                                                self.priced_cap)
    return self.replace(controller=controller, ar_fallback=ar_fallback, priced_cap=0,
                        ar_step_tokens=self.ar_step_tokens_in_effect())

  def ar_step_tokens_in_effect(self) -> int:
    """`ar_step_tokens`, with 0 read as 2 where the costs price a forward over 2 tokens below
    `PAD_AR_BELOW` AR steps (a one-row product dearer than a two-row one), else 1."""
    if self.ar_step_tokens:
      return self.ar_step_tokens
    costs = self.controller_costs
    return 2 if costs is not None and len(costs) > 1 and costs[1] < PAD_AR_BELOW else 1

  def needs_costs(self) -> bool:
    """Whether the loop form in effect prices its choices (`confidence`, `priced`) and has no
    costs."""
    return self.in_effect().controller in control.PRICED and self.controller_costs is None

  def for_loop(self, block_size: int, forced: bool = False, window: int | None = None,
               form: SamplingForm = SamplingForm.ANY) -> "LoopOptions":
    """The options of one compiled loop: forced drafts verify with `exact`; `form`: the
    sampling its calls need (ANY: any settings). A greedy loop verifies with `exact`, whatever
    the engine's rule: at T = 0 both rules are the greedy rule, one computation (the drafter's
    argmax, kept while it equals the target's), so an engine of either rule runs the same
    greedy program. A batched loop's forwards per call (`BatchOptions.sync_cycles`) are an
    argument of its calls, not an option. The decline is this block size's
    (`decline_sizes`)."""
    exact = forced or SamplingForm(form) == SamplingForm.GREEDY
    decline = self.controller_decline
    if decline and self.decline_sizes is not None:  # this size's own verdict (`decline_sizes`)
      decline = int(block_size) in self.decline_sizes
    return self.replace(block_size=block_size, forced_drafts=forced, window=window,
                        verify="exact" if exact else self.verify, sampling_form=form,
                        controller_decline=decline, decline_sizes=None)

  def ar_program(self) -> tuple:
    """What an AR loop of these options is built from (`loops.make_batched_ar_loop` and
    `make_ar_loop` read nothing else): its window, AR step form, layer form and sampling
    form. Engines whose options differ elsewhere (a controller, its costs, a verify rule) run
    the same AR loop, and share its executable (`compiled.CompiledCache`'s `program`): in one
    process a speculative engine's plain bucket and an AR engine's loop are one program."""
    return (self.window, self.ar_step_tokens_in_effect(), self.scan_layers, self.sampling_form)

  def spec_program(self, runtime_prices: bool) -> "LoopOptions":
    """What a speculative loop of these options is built from: all of them but those only the
    host reads (`online_costs`, `start_backoff`, `start_plain`), and, for the `priced`
    controller given its prices at run time (`runtime_prices`: the loop state's
    `break_even_N`, as every engine gives them), its start-up costs, which it then never reads
    (`controllers.Priced.price_N`). Engines that differ only there run the same loop and share
    its executable: a server's engine rebuilt with costs measured afresh, a benchmark's
    methods."""
    host_only = dict(online_costs=None, start_backoff=True, start_plain=True)
    if runtime_prices and self.controller == "priced":
      host_only.update(controller_costs=None, controller_draft_cost=None)
    return self.replace(**host_only)

  def key(self, batch: int | None = None) -> tuple:
    """The compile key of this loop within one engine (whose engine-wide options are fixed): its
    name and bucket; `batch`: the batched loop over that many slots (None: one request)."""
    name = ("ar_loop" if self.block_size == 1 else
            "spec_loop_forced" if self.forced_drafts else "spec_loop")
    if batch is None:  # the window only when the loop reads part of the cache
      key = (name, self.block_size) + (() if self.window is None else (self.window,))
    else:
      key = ("batch_" + name, self.block_size, batch, self.window or "all")
    return key + form_key(self.sampling_form)


def form_key(form: SamplingForm) -> tuple:
  """A compile key's suffix for a program's sampling form: none for GREEDY (the common case:
  keys read as they always did), else the form's name."""
  return () if form == SamplingForm.GREEDY else (SamplingForm(form).name.lower(),)


# Every option's parameter name (for `errors.named_as_flags` at the command line).
OPTION_NAMES = tuple(sorted({f.name for cls in (ShapeOptions, LoopOptions, BatchOptions)
                             for f in dataclasses.fields(cls)}))
