"""Near the kernel's limit on a process's memory maps (XLA:CPU maps each compiled program into
hundreds of regions and aborts the process past the limit), the engines' least recently used
programs make room for the one being compiled: each compiles again, and warms again, on its
next use, and the outputs stay those of plain decoding. A compilation is refused only where
nothing is left to let go."""

from __future__ import annotations

import weakref

import jax.numpy as jnp
import pytest

from bp_jax.decoding import compiled
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import BatchOptions, ShapeOptions
from live_maps import live_maps
from toy_models import zeros_drafter_pair

V = 48


@pytest.fixture
def room_for_two(monkeypatch):
  yield from live_maps(monkeypatch, 2)


@pytest.fixture
def room_for_five(monkeypatch):
  yield from live_maps(monkeypatch, 5)


def _times(cache: compiled.CompiledCache, name: str, k: float):
  return cache.get((name,), lambda: lambda v: v * k, (jnp.ones(3),))


def test_the_least_recently_used_program_makes_room(room_for_two):
  cache = compiled.CompiledCache()
  _times(cache, "a", 2.0)
  _times(cache, "b", 3.0)
  _times(cache, "a", 2.0)  # a used after b
  assert float(_times(cache, "c", 4.0)(jnp.ones(3))[0]) == 4.0
  assert sorted(cache.keys()) == [("a",), ("c",)] and cache.evicted == 1
  assert float(_times(cache, "b", 3.0)(jnp.ones(3))[0]) == 3.0  # compiled again, a let go
  assert sorted(cache.keys()) == [("b",), ("c",)] and cache.counts["b"] == 2
  assert cache.summary()["programs_let_go"] == 2


def test_a_compilation_is_refused_only_where_nothing_is_left_to_let_go(monkeypatch):
  monkeypatch.setattr(compiled, "_caches", weakref.WeakSet())
  monkeypatch.setattr(compiled, "_added", {"a": 900})
  monkeypatch.setattr(compiled, "maps_in_use", lambda: (61_500, 65_530))
  cache = compiled.CompiledCache()
  with pytest.raises(compiled.MapLimitError, match=r"needs about 900 more.*61,500 memory "
                     r"regions.*vm.max_map_count=65,530.*sysctl"):
    _times(cache, "a", 2.0)
  assert cache.total == 0


def test_an_engines_programs_let_go_compile_and_warm_again_and_decode_the_same(room_for_five):
  """A batched engine that needs more programs than the limit holds (a plain batch's five:
  staging buffers, its bucket's state, prefill, slot insertion, plain loop; a speculative
  batch's four others) decodes every request, lets its least recently used
  programs go, compiles each again on its next use, and warms each loop again: its warm-ups
  are always of programs it holds, and its tokens are plain decoding's."""
  target, drafter = zeros_drafter_pair(V)
  eng = Engine(target, drafter=drafter, stop_ids=[V - 1],
               shapes=ShapeOptions(max_len=64, length_buckets=(16,)),
               batching=BatchOptions(batch_size=2, sync_cycles=2, shrink=False))
  prompts = [[3, 4, 5], [7, 8, 9, 10]]
  plain = [g.output_ids for g in eng.generate_batch(prompts, max_new_tokens=8, block_size=1)]
  held = lambda: set(eng.compiled.keys())
  assert set(eng.programs.warmup_seconds) <= held()
  spec = [g.output_ids for g in eng.generate_batch(prompts, max_new_tokens=8, block_size=4)]
  assert spec == plain
  assert eng.compiled.evicted >= 1 and len(held()) <= 5  # the room's
  assert set(eng.programs.warmup_seconds) <= held()
  before = eng.compiled.total
  again = [g.output_ids for g in eng.generate_batch(prompts, max_new_tokens=8, block_size=1)]
  assert again == plain and eng.compiled.total > before  # what was let go, compiled again
  assert set(eng.programs.warmup_seconds) <= held() and eng.programs.warmup_seconds
