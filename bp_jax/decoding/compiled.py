"""Ahead-of-time compiled functions keyed by their static bucket, with compile counts and times."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Hashable

import jax

from bp_jax import compile_cache


class CompiledCache:
  """Compiles `jax.jit(fn)` once per key (a bucket) and reuses it; counts every compilation."""

  def __init__(self):
    self._fns: dict[Hashable, Any] = {}
    self.counts: collections.Counter = collections.Counter()  # name -> compilations
    self.seconds: dict[Hashable, float] = {}                   # key -> compile seconds
    self.cache_hits = 0  # compilations served by the persistent compilation cache

  def get(self, key: tuple, make: Callable[[], Callable], args: tuple,
          donate_argnums: tuple[int, ...] = (), out_shardings: Any = None) -> Any:
    """The compiled function for `key` (first element = a name); compiles on first use.
    `out_shardings`: pinned output placements (a carry that goes back in must keep its own)."""
    fn = self._fns.get(key)
    if fn is None:
      t0, hits0 = time.perf_counter(), compile_cache.hits()
      kw = {} if out_shardings is None else {"out_shardings": out_shardings}
      fn = jax.jit(make(), donate_argnums=donate_argnums, **kw).lower(*args).compile()
      self.seconds[key] = time.perf_counter() - t0
      self.cache_hits += compile_cache.hits() > hits0
      self.counts[key[0]] += 1
      self._fns[key] = fn
    return fn

  def __contains__(self, key) -> bool:
    return key in self._fns

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def compile_seconds(self) -> float:
    return sum(self.seconds.values())

  def summary(self) -> dict:
    return {"compilations": self.total, "by_function": dict(self.counts),
            "compile_cache_hits": self.cache_hits,
            "compile_s": round(self.compile_seconds(), 3),
            "per_key_s": {"/".join(map(str, k)): round(s, 3) for k, s in self.seconds.items()}}
