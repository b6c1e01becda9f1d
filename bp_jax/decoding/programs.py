"""The compiled programs of an engine: one prefill per (length bucket[, policy architecture])
and one decode loop per block size (and loop form), compiled ahead of time on first use, plus
each loop's untimed first run (warm-up).

An XLA:CPU executable's first run costs ~75-90 ms more than later runs (measured on the demo):
that belongs with start-up, not in a request's decode time, so each loop runs once on copies of
the first request's buffers. Compile time (`cache.seconds`) and warm-up time (`warmup_seconds`)
are measured apart: the warm-up clock starts after its loop is compiled.
"""

from __future__ import annotations

import enum
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding import loops
from bp_jax.decoding.compiled import CompiledCache
from bp_jax.decoding.options import LoopOptions, form_key
from bp_jax.decoding.sampling import SamplingForm


class DraftContext(enum.Enum):
  """What a prefill does about the drafter's context over the prompt (`LoopPrograms.prefill`)."""
  BUILT = "built"  # built in the prefill: the request drafts, or its policy reads the drafter
  # None: the target's forward alone (the request decodes plain, `Engine.plain_prefill`).
  NONE = "target_only"
  # Built after it, where the request then drafts: the prefill keeps the drafter's chosen
  # layers' outputs (`LoopPrograms.draft_context`; a learned size, `Engine.defers_context`).
  LATER = "context_later"


WARMUP_TOKENS = 16  # new tokens of a loop's untimed first run
# (misses, AR steps) a speculative loop's second untimed run starts with (`LoopState.start_row`;
# the first runs the request or rows as they are): two AR steps (the steps' loop past its first
# trip), their drafter context added, then cycles as far as the call's budget goes, so that the
# two runs reach every part of the loop body. A
# part's first run has a fixed cost of its own (XLA:CPU's kernels set up on first use; on a
# GPU, kernels loaded on first launch): warmed by cycles alone, the first timed call that took
# AR steps paid it (this CPU, test shapes, batch 4: 49 ms against 3 ms for the same call run
# again; an H200 at Qwen3-4B shapes, batch 4: ~20 ms more than the call's forwards).
WARMUP_START = (0, 2)
# Target forwards of each untimed first run of a batched loop (its calls' runtime budget): a
# cycle or a step of the rows as they are, and the second run's two AR steps and a cycle
# (`WARMUP_START`). With the engine's whole budget (`BatchOptions.sync_cycles`) a first use at
# batch 16 ran 2 x 16 speculative forwards untimed in a request's path (a b = 8 forward at batch
# 16 prices at ~28 ms on the 2-core Xeon at the demo's shapes: ~0.9 s) to pay a fixed cost that
# one forward pays.
WARMUP_FORWARDS = 3


def _placements_of(state):
  """The loop state's own shardings when it is placed on a mesh (a batched state goes back into
  the programs that returned it, so it must come out placed as it went in), else None (XLA's
  choice, one device)."""
  from jax.sharding import NamedSharding
  shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
  if any(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings)):
    return shardings
  return None


MIN_WINDOW = 128


def window_buckets(max_len: int) -> tuple[int, ...]:
  """The attention windows of the batched loops: powers of two from MIN_WINDOW below max_len,
  then max_len (a bounded set: at most log2(max_len / MIN_WINDOW) + 1 programs per loop)."""
  out, w = [], MIN_WINDOW
  while w < max_len:
    out.append(w)
    w *= 2
  return tuple(out) + (max_len,)


def request_windows(max_len: int) -> tuple[int, ...]:
  """The attention windows of the one-request loops: MIN_WINDOW * 2^k and 1.5x those below
  max_len, then max_len (at most about 2 log2(max_len / MIN_WINDOW) + 1 programs per loop).
  Steps of at most 1.5x keep a request's window within 1.5x of the cache it needs."""
  out, w = set(), MIN_WINDOW
  while w < max_len:
    out.update(x for x in (w, w * 3 // 2) if x < max_len)
    w *= 2
  return tuple(sorted(out)) + (max_len,)


def request_window(extent: int, max_len: int) -> int | None:
  """The window of a one-request loop whose request never writes at or past slot `extent` (its
  prompt, max_new_tokens and one block of room): the smallest of `request_windows` that holds
  it; None (all slots) when that is max_len."""
  w = next((w for w in request_windows(max_len) if w >= extent), max_len)
  return None if w >= max_len else w


def window_for(max_pos: int, block_size: int, sync_cycles: int, max_len: int,
               ar_steps: int = 0) -> int | None:
  """The window of a batched loop call whose furthest decoding row is at `max_pos`: room for
  about half of `sync_cycles` full cycles (the loop returns early when a row reaches the
  window's end); None (all slots) for static batching (sync_cycles = 0) or past the largest
  power of two. `ar_steps`: the AR steps every decoding row still asks for before the batch
  may run a cycle (the least `LoopState.wait_B` of the priced back-off): the call's first
  forwards advance one position each, so they need one slot each, not a cycle's room (a batch
  backed off took a window up to twice the AR loop's, and every AR step read it); a call of AR
  steps alone gets the AR loop's room (about half its steps)."""
  if sync_cycles <= 0:
    return None
  steps = max(int(ar_steps), 0)
  if steps >= sync_cycles:
    need = max_pos + 1 + sync_cycles // 2
  else:
    need = max_pos + steps + block_size * (1 + (sync_cycles - steps) // 2)
  w = next((w for w in window_buckets(max_len) if w >= need), max_len)
  return None if w >= max_len else w


def donated(block_size: int, batched: bool) -> tuple[int, ...]:
  """The arguments a loop donates (its carry and caches), by position after its weights (the
  target's, and the drafter's for block sizes > 1): one request's loops their sequence and
  caches, the batched loops their carry."""
  if batched:
    return (1,) if block_size == 1 else (2,)
  return (1, 2) if block_size == 1 else (2, 3, 4)


def _copy_donated(args: tuple, donated: tuple[int, ...]) -> tuple:
  """`args` with copies of the donated ones (a warm-up run consumes those): the weights are
  read, not donated, and stay shared (a copy would hold a second model on the device)."""
  return tuple(jax.tree.map(jnp.copy, a) if i in donated else a for i, a in enumerate(args))


def _forward_counts(out) -> tuple[int, ...]:
  """A loop's target forwards by verify length, from its output (a `LoopState` or `LoopOut`)."""
  counts = getattr(out, "forward_counts_N", getattr(out, "forward_counts", None))
  return () if counts is None else tuple(int(c) for c in np.asarray(counts))


# `loops.make_spec_loop`'s arguments: the priced controller's runtime prices (`break_even_N`)
# come 13th, after the two weights, the sequence, the caches and the request's scalars.
_SPEC_BREAK_EVEN_ARG = 12


def _runtime_prices(args: tuple) -> bool:
  """Whether a one-request speculative loop's `args` give the priced controller its prices."""
  return len(args) > _SPEC_BREAK_EVEN_ARG and args[_SPEC_BREAK_EVEN_ARG] is not None


def _ar_first(args: tuple) -> tuple:
  """A batched speculative loop's arguments whose decoding rows first ask for `WARMUP_START`'s
  AR steps (the carry, after the two weights, is `LoopState`)."""
  s = args[2]
  wait_B = jnp.where(s.active_B(), WARMUP_START[1], s.wait_B).astype(s.wait_B.dtype)
  return args[:2] + (s.replace(wait_B=wait_B),) + args[3:]


def _warm_args(args: tuple, budget: jax.Array) -> tuple:
  """A batched loop's arguments (weights, carry, stop ids, budget) for an untimed first run:
  the budget of `WARMUP_FORWARDS`, and where no row decodes (an idle carry: `precompile`'s
  fresh one), every row decoding `WARMUP_TOKENS` new tokens from its empty slot, so that the
  run reaches the loop body (whose first run has a fixed cost an idle carry never pays). Their
  tokens are a zero cache's, never read: the run is on copies."""
  s = args[-3]
  idle = ~jnp.any(s.active_B())
  s = s.replace(max_new_B=jnp.where(idle, WARMUP_TOKENS + 1, s.max_new_B),
                done_B=s.done_B & ~idle)
  return args[:-3] + (s, args[-2], budget)


class LoopPrograms:
  """Builds, caches and warms the jitted functions of one (target, drafter, loop form).

  `options`: the engine-wide `LoopOptions`, in effect (`LoopOptions.in_effect`); each compiled
  loop's own options add its bucket (`LoopOptions.for_loop`), whose `key` names it in `cache`.
  """

  def __init__(self, t_graph, d_graph, options: LoopOptions = LoopOptions()):
    self.t_graph, self.d_graph = t_graph, d_graph
    self.options = options.in_effect()
    self.cache = CompiledCache()
    self.warmup_seconds: dict[tuple, float] = {}  # loop key -> its untimed first run (s)
    # loop key -> the target forwards its untimed first run ran, by verify length (0: AR steps)
    self.warmup_forwards: dict[tuple, tuple[int, ...]] = {}
    # A loop let go near the map limit (`CompiledCache.evict`) warms again once compiled
    # again: its first run's fixed cost stays out of the timed calls.
    seconds, forwards = self.warmup_seconds, self.warmup_forwards
    self.cache.on_evict.append(lambda key: (seconds.pop(key, None), forwards.pop(key, None)))
    # `fresh`'s key -> (its output's signature, its placements or None)
    self._fresh_out: dict[tuple, tuple] = {}

  def prefill(self, args: tuple, p_graph=None, policy_key=None,
              form: SamplingForm = SamplingForm.ANY, context: DraftContext = DraftContext.BUILT,
              features: tuple[str, ...] = (), context_layers: tuple[int, ...] = ()):
    """The compiled prefill for `args` (`loops.make_prefill`'s, shapes pick the bucket) for a
    request of sampling `form`: GREEDY's, or one for both drawing forms (ANY's: it samples one
    token, whose truncation costs nothing next to the prompt's forward, and a third program
    per length bucket took the demo server's start-up ~6 s). `context`: what it does about the
    drafter's context (`DraftContext`; its `args` carry None for the drafter's state and cache
    unless BUILT; LATER keeps the drafter's `context_layers`' outputs); an engine without a
    drafter has no other than BUILT's. `features`: the feature types it returns."""
    form = SamplingForm.GREEDY if form == SamplingForm.GREEDY else SamplingForm.ANY
    tokens_1P = args[2]
    if self.d_graph is None:
      context = DraftContext.BUILT
    built = context == DraftContext.BUILT
    d_graph = self.d_graph if built else None
    layers = tuple(context_layers)  # LATER's (`loops.make_prefill` refuses them with a drafter)
    features = tuple(features)
    key = (("prefill", tokens_1P.shape[1]) + ((policy_key,) if p_graph is not None else ())
           + form_key(form) + (() if built else (context.value,))
           + ((("features",) + features) if features else ()))
    return self.cache.get(key, lambda: loops.make_prefill(self.t_graph, d_graph, p_graph, form,
                                                          features, layers),
                          args, donate_argnums=(4, 5) if built else (4,),
                          program=("prefill", self.t_graph, d_graph, p_graph, form, features,
                                   layers))

  def draft_context(self, args: tuple):
    """The compiled drafter context over a prompt from the hiddens a LATER prefill kept
    (`loops.make_draft_context`; args: drafter state, hiddens [n, 1, P, D], n, draft cache,
    donated): one compilation per length bucket."""
    key = ("draft_context", args[1].shape[2])
    return self.cache.get(key, lambda: loops.make_draft_context(self.d_graph), args,
                          donate_argnums=(3,), program=("draft_context", self.d_graph))

  def loop_key(self, block_size: int, forced: bool = False, window: int | None = None,
               form: SamplingForm = SamplingForm.ANY) -> tuple:
    return self.options.for_loop(block_size, forced, window, form).key()

  def loop(self, block_size: int, args: tuple, forced: bool = False,
           window: int | None = None, form: SamplingForm = SamplingForm.ANY):
    """The compiled decode loop of a block size (1 = plain AR) for `args`, attending over cache
    slots [0, window) (None: all; `request_window`), sampling in `form` (the request's)."""
    opts = self.options.for_loop(block_size, forced, window, form)
    if block_size == 1:
      return self.cache.get(opts.key(), lambda: loops.make_ar_loop(self.t_graph, opts),
                            args, donate_argnums=donated(1, batched=False),
                            program=("ar_loop", self.t_graph, opts.ar_program()))
    return self.cache.get(opts.key(),
                          lambda: loops.make_spec_loop(self.t_graph, self.d_graph, opts),
                          args, donate_argnums=donated(block_size, batched=False),
                          program=("spec_loop", self.t_graph, self.d_graph,
                                   opts.spec_program(_runtime_prices(args))))

  def batched_loop(self, block_size: int, batch: int, window: int | None, args: tuple,
                   forced: bool = False, form: SamplingForm = SamplingForm.ANY):
    """The compiled batched loop (`loops.make_batched_*_loop`) of a block size for a state of
    `batch` rows, attending over `window` cache slots (None: all), sampling in `form` (what the
    rows it decodes need); compiled once per (block size, batch, window bucket, form). Its
    calls' last argument is their budget of target forwards (`BatchOptions.sync_cycles`; 0:
    until no row decodes), a value: engines of any budget share the program."""
    opts = self.options.for_loop(block_size, forced, window, form)
    if block_size == 1:
      return self.cache.get(opts.key(batch), lambda: loops.make_batched_ar_loop(self.t_graph, opts),
                            args, donate_argnums=donated(1, batched=True),
                            out_shardings=_placements_of(args[1]),
                            program=("batched_ar_loop", self.t_graph, opts.ar_program()))
    make = lambda: loops.make_batched_spec_loop(self.t_graph, self.d_graph, opts)
    return self.cache.get(opts.key(batch), make, args,
                          donate_argnums=donated(block_size, batched=True),
                          out_shardings=_placements_of(args[2]),
                          program=("batched_spec_loop", self.t_graph, self.d_graph,
                                   opts.spec_program(args[2].break_even_N is not None)))

  def batched_loop_key(self, block_size: int, batch: int, window: int | None,
                       forced: bool = False, form: SamplingForm = SamplingForm.ANY) -> tuple:
    return self.options.for_loop(block_size, forced, window, form).key(batch)

  @staticmethod
  def insert_key(state) -> tuple:
    """The key of `insert`'s program into `state` (concrete or abstract)."""
    return ("insert", state.seq_BS.shape[0], state.draft_cache is not None,
            state.forced_BS is not None)

  def insert(self, args: tuple):
    """The compiled slot insertion (`loops.make_insert`) for a state's shapes."""
    s = args[0]
    return self.cache.get(self.insert_key(s), loops.make_insert, args, donate_argnums=(0,),
                          out_shardings=_placements_of(s), program=("insert",))

  @staticmethod
  def resize_key(state, size: int) -> tuple:
    """The key of `resize`'s program for `state` (concrete or abstract) to `size` rows."""
    return ("resize", state.seq_BS.shape[0], size, state.draft_cache is not None,
            state.forced_BS is not None)

  @staticmethod
  def move_key(state, src) -> tuple:
    """The key of `move`'s program from a slot of `src` into one of `state`."""
    return ("move", state.seq_BS.shape[0], src.seq_BS.shape[0], state.draft_cache is not None,
            src.draft_cache is not None, state.forced_BS is not None, src.forced_BS is not None)

  def resize(self, args: tuple):
    """The compiled change of a batched state's row count (`LoopState.take_rows`), for
    (state, rows_R, keep_R): one compilation per (rows before, rows after) and state form."""
    return self.cache.get(self.resize_key(args[0], args[1].shape[0]),
                          lambda: lambda state, rows, keep: state.take_rows(rows, keep),
                          args, program=("resize",))

  def move(self, args: tuple):
    """The compiled move of one request between batched states (`LoopState.with_row_from`),
    for (state, row, source state, source row), the state donated: one compilation per
    (rows, source rows) and state forms."""
    s = args[0]
    return self.cache.get(self.move_key(s, args[2]),
                          lambda: lambda state, row, source, source_row:
                          state.with_row_from(row, source, source_row),
                          args, donate_argnums=(0,), out_shardings=_placements_of(s),
                          program=("move",))

  def fresh(self, key: tuple, build: Callable, args: tuple = (),
            placements: Callable | None = None):
    """The compiled `build` (pure: zero-filled buffers, or a state around them) for `key`,
    which names everything it depends on besides `args`' shapes: fresh buffers in one call.
    Built op by op (a dispatch per buffer), a speculative bucket's state of 4 slots cost ~8.5
    ms of host time and a staging pair ~1.9 ms on the demo's CPU (1.0 and 0.4 ms by one call),
    on every `generate_batch` call. `placements`: abstract output -> its shardings on a mesh
    (None: one device); the output's signature names the program, so engines of equal shapes
    share it."""
    if key not in self._fresh_out:
      out = jax.eval_shape(build, *args)
      leaves, tree = jax.tree.flatten(out)
      signature = (key, tree, tuple((x.shape, str(x.dtype)) for x in leaves))
      self._fresh_out[key] = (signature, None if placements is None else placements(out))
    signature, shardings = self._fresh_out[key]
    return self.cache.get(key, lambda: build, args, out_shardings=shardings,
                          program=("fresh",) + signature)

  def warm_batched(self, key: tuple, fn, args: tuple, block_size: int) -> None:
    """Runs a batched loop, untimed, on copies of its carry the first time the loop is used,
    `WARMUP_FORWARDS` forwards each: the rows as they are, or all rows decoding where none does
    (`_warm_args`: the loop body's first run has a fixed cost of its own, e.g. XLA:CPU's kernels
    set up on first use, ~60 ms at the test shapes and ~110 ms at the demo's on the 2-core Xeon,
    that an idle carry never pays: warmed by `precompile`'s idle carries, an explorer's first
    call at batch 4 took 145-185 ms for 4 forwards against 25-45 ms for the same call later),
    and a speculative loop again with its decoding rows asking for AR steps first
    (`WARMUP_START`). Priced by the online costs, that cost made a new batch size's first call
    look several times dearer than its next, and a least-squares fit over the two priced its
    AR steps at ~0 and its cycles at the cap (64 AR steps)."""
    if key in self.warmup_seconds:
      return
    budget = jnp.asarray(WARMUP_FORWARDS, jnp.int32)
    copy = lambda: _warm_args(_copy_donated(args, donated(block_size, batched=True)), budget)
    runs = [copy]
    if block_size > 1:
      runs.append(lambda: _ar_first(copy()))
    self._warm_runs(key, fn, runs)

  def _warm_runs(self, key: tuple, fn, runs) -> None:
    """Runs `fn` on each of `runs`' arguments (callables making them), untimed as far as the
    requests go: `warmup_seconds` and `warmup_forwards` (summed over the runs) record them."""
    t0, counts = time.perf_counter(), []
    for make_args in runs:
      counts.append(_forward_counts(jax.block_until_ready(fn(*make_args()))))
    self.warmup_forwards[key] = tuple(int(sum(c)) for c in zip(*counts))
    self.warmup_seconds[key] = time.perf_counter() - t0

  def warm(self, block_size: int, make_args: Callable[[tuple[int, int]], tuple],
           forced: bool = False, window: int | None = None,
           form: SamplingForm = SamplingForm.ANY) -> None:
    """Runs a loop, untimed, the first time it is used: on copies of the donated arguments
    `make_args((0, 0))` gives (the caller caps max_new at WARMUP_TOKENS), and a speculative
    loop again on those of `make_args(WARMUP_START)` (the same request starting with AR steps;
    `make_args(start)`: the loop's arguments with (misses, AR steps) `start`); compiles it
    first, outside the warm-up clock. A loop already warm makes no arguments."""
    key = self.loop_key(block_size, forced, window, form)
    if key in self.warmup_seconds:
      return
    fn = self.loop(block_size, make_args((0, 0)), forced, window, form)
    starts = [(0, 0)] + ([WARMUP_START] if block_size > 1 else [])
    self._warm_runs(key, fn, [lambda st=st: _copy_donated(make_args(st),
                                                          donated(block_size, batched=False))
                              for st in starts])
