"""Ahead-of-time compiled functions keyed by their static bucket, with compile counts and times.

Programs are shared across the engines of one process: an engine's program is a pure function
of what builds it (the models' graph definitions, its loop options: `program`) and of its
arguments' shapes, dtypes and placements, never of the weights (an argument). A second engine
over models of the same architecture and options (a benchmark's methods, a test's engines, a
server's engine rebuilt) takes the executable the first one compiled instead of tracing,
lowering and compiling it again (on this CPU, tracing and lowering a loop cost as much as
compiling it, and the persistent cache saves only the compilation).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Hashable

import jax
import numpy as np

from bp_jax import compile_cache
from bp_jax.errors import BadInputError

SHARED_PROGRAMS = 64  # executables kept for the process's engines (least recently used out)
# XLA:CPU maps each executable's code into many memory regions (~420 per decoding loop of the
# tests' tiny models under their compile flags): a process that keeps hundreds alive passes
# the kernel's limit (`vm.max_map_count`, 65530 by default), and its next compilation or cache
# write segfaults (seen in full test runs with 256 kept). The shared programs also yield, least
# recently used first, while the process holds more than this share of that limit.
MAP_SHARE = 0.5
# Past the limit XLA:CPU's JIT aborts the whole process ("Unable to allocate section memory"):
# a compilation whose program may take the process past this share of it first makes room,
# the shared programs and then the engines' least recently used ones yielding (a program let
# go compiles again on its next use), and is refused (`MapLimitError`) only where nothing is
# left to let go. A decoding loop of the demo's models maps ~650 regions (a batch-16 learned
# engine's full precompile, 7 sizes x 5 slot counts x 4 windows, passed 65,530;
# docs/cpu_xeon167/map_limit_2026-12-05).
MAP_LIMIT_SHARE = 0.95
_added: dict[str, int] = {}  # function name -> the most regions one compilation of it mapped
_shared: collections.OrderedDict = collections.OrderedDict()
_shared_lock = threading.Lock()
_caches: "weakref.WeakSet[CompiledCache]" = weakref.WeakSet()  # every engine's cache
_clock = itertools.count(1)  # programs' last uses, in order across the caches
_room_lock = threading.RLock()  # one process-wide making of room at a time
log = logging.getLogger("bp_jax.compiled")


@contextlib.contextmanager
def shared_programs_set_aside():
  """The process's shared executables out of reach inside the block and back after it, and
  those compiled inside it forgotten: a test that patches code a program traces (a
  deliberately wrong rule, a spy) traces its own, which never reach the code after it, while
  the programs compiled before stay shared."""
  with _shared_lock:
    saved = collections.OrderedDict(_shared)
    _shared.clear()
  try:
    yield
  finally:
    with _shared_lock:
      _shared.clear()
      _shared.update(saved)


def maps_in_use() -> tuple[int, int] | None:
  """(memory regions this process maps, the kernel's limit), or None where the system does
  not say (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      mapped = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count", "rb") as f:
      return mapped, int(f.read())
  except (OSError, ValueError):
    return None


def _over_budget(use: tuple[int, int] | None = None) -> bool:
  """Whether the process maps more than `MAP_SHARE` of its limit (`use`: `maps_in_use` read
  already; None: read now)."""
  use = maps_in_use() if use is None else use
  return use is not None and use[0] > MAP_SHARE * use[1]


class MapLimitError(BadInputError):
  """A compilation would take the process past the kernel's limit on its memory maps
  (`vm.max_map_count`), where XLA:CPU's JIT aborts the process: the process holds more
  programs than this machine's limit allows; the message says how many regions it maps, how
  many the compilation needs, and what to change."""


def map_limit_advice(in_use: int, limit: int) -> str:
  """What to do when the programs a process needs pass its memory-map limit."""
  return (f"this process maps {in_use:,} memory regions of the kernel's limit "
          f"vm.max_map_count={limit:,} (XLA:CPU maps each compiled program's code into "
          f"hundreds; past the limit its compiler aborts the process). Raise the limit "
          f"(`sudo sysctl -w vm.max_map_count=262144`), or run fewer programs: fewer block "
          f"sizes (--config.block_sizes), no shrinking batch tails "
          f"(--config.shrink_batches=False), a smaller --config.max_len (fewer attention "
          f"windows)")


def expected_maps(name: str) -> int:
  """The regions a compilation of function `name` is expected to map: the most one of it
  mapped in this process, else the most any compilation did (0 before the first)."""
  return _added.get(name, max(_added.values(), default=0))


def _let_shared_go() -> tuple[int, int] | None:
  """Drops the shared programs (those that no engine holds free their maps) and returns the
  process's maps after."""
  with _shared_lock:
    _shared.clear()
  gc.collect()  # executables held by reference cycles only
  return maps_in_use()


def _held_programs() -> list[tuple[int, "CompiledCache", tuple]]:
  """(last use, cache, key) of every program the process's engines hold, least recently used
  first."""
  held = [(cache.last_use(key), cache, key) for cache in list(_caches) for key in cache.keys()]
  held.sort(key=lambda h: h[0])
  return held


def _let_engines_go(need: int, use: tuple[int, int]) -> tuple[tuple[int, int] | None, int]:
  """Lets the engines' least recently used programs go until `need` more regions fit under
  `MAP_LIMIT_SHARE` of the limit, or none is left. Returns (maps after, programs let go)."""
  gone = 0
  while use is not None and use[0] + need > MAP_LIMIT_SHARE * use[1]:
    held = _held_programs()
    if not held:
      break
    short, freed = use[0] + need - MAP_LIMIT_SHARE * use[1], 0
    for _, cache, key in held:  # about what the reading says is missing, then read again
      freed += cache.evict(key)
      gone += 1
      if freed >= short:
        break
    gc.collect()
    use = maps_in_use()
  return use, gone


def check_map_room(name: str, need: int | None = None, what: str = "",
                   use: tuple[int, int] | None = None, evict: bool = True
                   ) -> tuple[int, int] | None:
  """Makes room for compiling `need` more regions (default: one program of `name`,
  `expected_maps`) under `MAP_LIMIT_SHARE` of the process's limit: the shared programs yield
  (those that no engine holds free their maps), then, with `evict`, the engines' least
  recently used programs (`CompiledCache.evict`: each compiles again on its next use). Refuses
  (`MapLimitError`) where that is not enough. `use`: `maps_in_use` read already (None: read
  now; a read costs ~20 ms at 30,000 regions). Returns the process's maps as it goes on."""
  need = expected_maps(name) if need is None else need
  use = maps_in_use() if use is None else use
  if use is None or use[0] + need <= MAP_LIMIT_SHARE * use[1]:
    return use
  with _room_lock:
    use = _let_shared_go()
    if evict and use is not None and use[0] + need > MAP_LIMIT_SHARE * use[1]:
      before = use[0]
      use, gone = _let_engines_go(need, use)
      if gone:
        log.warning("%s: let %d compiled programs go (%s memory regions mapped before, %s "
                    "after, of vm.max_map_count=%s); each compiles again on its next use",
                    what or "compiling " + name, gone, f"{before:,}",
                    f"{use[0]:,}" if use else "?", f"{use[1]:,}" if use else "?")
  if use is not None and use[0] + need > MAP_LIMIT_SHARE * use[1]:
    raise MapLimitError(f"{what or 'compiling ' + name}: it needs about {need:,} more memory "
                        f"regions, and {map_limit_advice(*use)}")
  return use


def _trace_context() -> tuple:
  """JAX's settings that change what a trace produces (matmul precision, x64, ...): JAX's own
  key for its trace caches, else the two this project sets (`--config.matmul_precision`)."""
  try:
    from jax._src import config as jax_config
    return jax_config.trace_context()
  except (ImportError, AttributeError):
    return (jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64)


def _leaf_signature(x) -> tuple:
  if isinstance(x, jax.Array):
    return (jax.typeof(x), x.sharding, getattr(x, "_committed", None))
  if isinstance(x, jax.ShapeDtypeStruct):  # an abstract argument (`Engine.precompile`)
    return ("abstract", x.shape, x.dtype, x.sharding, x.weak_type)
  return (type(x).__name__, np.shape(x), np.result_type(x))


def _shared_key(program: Hashable, args: tuple, donate_argnums: tuple[int, ...]):
  """What an executable compiled for `args` depends on besides `program`: the arguments' tree
  and, per leaf, shape, dtype, weak type and placement, and JAX's settings in effect; None where
  that cannot be hashed (the program is then not shared)."""
  leaves, tree = jax.tree.flatten(args)
  key = (program, tree, tuple(_leaf_signature(x) for x in leaves), tuple(donate_argnums),
         _trace_context())
  try:
    hash(key)
  except TypeError:
    return None
  return key


class CompiledCache:
  """Compiles `jax.jit(fn)` once per key (a bucket) and reuses it; counts every compilation.
  Near the process's memory-map limit its least recently used programs may be let go
  (`check_map_room`, `evict`): such a program compiles again on its next use."""

  def __init__(self):
    self._fns: dict[Hashable, Any] = {}
    self._used: dict[Hashable, int] = {}   # key -> its last use (`_clock`)
    self._maps: dict[Hashable, int] = {}   # key -> regions its compilation mapped
    self.counts: collections.Counter = collections.Counter()  # name -> compilations
    self.seconds: dict[Hashable, float] = {}                   # key -> compile seconds
    self.cache_hits = 0  # compilations served by the persistent compilation cache
    self.shared = 0      # programs taken from another engine of this process
    self.evicted = 0     # programs let go near the map limit (each compiles again when used)
    # Called with a key let go: what was kept about the program (its warm-up) goes with it.
    self.on_evict: list[Callable[[Hashable], None]] = []
    _caches.add(self)

  def get(self, key: tuple, make: Callable[[], Callable], args: tuple,
          donate_argnums: tuple[int, ...] = (), out_shardings: Any = None,
          program: Hashable = None) -> Any:
    """The compiled function for `key` (first element = a name); compiles on first use.
    `out_shardings`: pinned output placements (a carry that goes back in must keep its own).
    `program`: everything `make`'s function depends on (hashable; equal values build the same
    function): the process's other engines then share the executable for equal arguments'
    signatures; None: this cache's own (also with `out_shardings`)."""
    fn = self._fns.get(key)
    self._used[key] = next(_clock)
    if fn is None:
      t0, hits0 = time.perf_counter(), compile_cache.hits()
      shared_key = (None if program is None or out_shardings is not None
                    else _shared_key(program, args, donate_argnums))
      with _shared_lock:
        fn = None if shared_key is None else _shared.get(shared_key)
        if fn is not None:
          _shared.move_to_end(shared_key)
      if fn is not None:
        self.shared += 1
      else:
        maps0 = check_map_room(key[0], what=f"compiling {key!r}")
        kw = {} if out_shardings is None else {"out_shardings": out_shardings}
        fn = jax.jit(make(), donate_argnums=donate_argnums, **kw).lower(*args).compile()
        self._fns[key] = fn  # held before the reading (what tests' fake maps count)
        maps1 = maps_in_use()
        if maps0 is not None and maps1 is not None:
          self._maps[key] = maps1[0] - maps0[0]
          _added[key[0]] = max(_added.get(key[0], 0), self._maps[key])
        self.cache_hits += compile_cache.hits() > hits0
        if shared_key is not None:
          with _shared_lock:
            _shared[shared_key] = fn
            use = maps1  # read again after each program let go
            while len(_shared) > SHARED_PROGRAMS or (len(_shared) > 1 and _over_budget(use)):
              _shared.popitem(last=False)
              use = None
      self.seconds[key] = time.perf_counter() - t0
      self.counts[key[0]] += 1
      self._fns[key] = fn
    return fn

  def __contains__(self, key) -> bool:
    return key in self._fns

  def keys(self) -> list:
    return list(self._fns)

  def last_use(self, key) -> int:
    return self._used.get(key, 0)

  def evict(self, key) -> int:
    """Lets the program of `key` go (it compiles again on its next use; `on_evict` is told).
    Returns the regions it is expected to free: what its compilation mapped, else what one of
    its function does (`expected_maps`; a program shared with another engine frees them only
    when that one lets it go too)."""
    if self._fns.pop(key, None) is None:
      return 0
    self._used.pop(key, None)
    self.evicted += 1
    for hook in self.on_evict:
      hook(key)
    return self._maps.pop(key, 0) or expected_maps(key[0])

  def program_text(self, key) -> str:
    """The compiled program of `key` as XLA's optimised HLO text (what tests and benchmarks
    read instructions from: its `conditional`s, its cache-sized copies)."""
    return self._fns[key].as_text()

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def compile_seconds(self) -> float:
    return sum(self.seconds.values())

  def summary(self) -> dict:
    return {"compilations": self.total, "by_function": dict(self.counts),
            "compile_cache_hits": self.cache_hits, "shared_programs": self.shared,
            "programs_let_go": self.evicted,
            "compile_s": round(self.compile_seconds(), 3),
            "per_key_s": {"/".join(map(str, k)): round(s, 3) for k, s in self.seconds.items()}}
