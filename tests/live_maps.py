"""A fake of the process's memory maps that follows the programs the engines hold (tests of
what happens near `vm.max_map_count`)."""

from __future__ import annotations

import weakref

from bp_jax.decoding import compiled

BASE, PER_PROGRAM = 1_000, 600


class LiveMaps:
  """The process's memory maps as BASE + PER_PROGRAM per program the (isolated) engines hold,
  under a limit whose share (`compiled.MAP_LIMIT_SHARE`) holds `room` programs and some."""

  def __init__(self, room: int):
    self.limit = int((BASE + PER_PROGRAM * room + PER_PROGRAM // 2) / compiled.MAP_LIMIT_SHARE)

  def __call__(self) -> tuple[int, int]:
    held = sum(len(cache.keys()) for cache in compiled._caches)
    return BASE + PER_PROGRAM * held, self.limit


def live_maps(monkeypatch, room: int):
  """Installs `LiveMaps(room)` over the caches made from now on alone (other tests' engines in
  this process keep their programs), with no shared programs; a generator for a fixture."""
  monkeypatch.setattr(compiled, "_caches", weakref.WeakSet())
  monkeypatch.setattr(compiled, "_added", {})
  maps = LiveMaps(room)
  monkeypatch.setattr(compiled, "maps_in_use", maps)
  with compiled.shared_programs_set_aside():
    yield maps
