"""Precompile's steps: one of each kind first, and a refusal before the steps left would pass
the process's memory-map limit (XLA:CPU aborts the process past it), not when they get there."""

from __future__ import annotations

import pytest

from bp_jax.decoding import compiled
from bp_jax.decoding.precompiling import PrecompileStep, kinds_first, run_steps, to_run


class FakeMaps:
  """A process's memory maps as a counter that each step's compilation raises."""

  def __init__(self, in_use: int, limit: int):
    self.in_use, self.limit, self.built = in_use, limit, []

  def step(self, kind: str, maps: int) -> PrecompileStep:
    def build():
      self.built.append(kind)
      self.in_use += maps
    return PrecompileStep(kind, build)


@pytest.fixture
def fake(monkeypatch):
  maps = FakeMaps(1_000, 10_000)
  monkeypatch.setattr(compiled, "maps_in_use", lambda: (maps.in_use, maps.limit))
  monkeypatch.setattr(compiled, "_added", {})
  return maps


def test_kinds_first_keeps_each_kinds_order():
  steps = [PrecompileStep(k, lambda: None) for k in ("a", "a", "b", "a", "c", "b")]
  assert [s.kind for s in kinds_first(steps)] == ["a", "b", "c", "a", "a", "b"]
  assert kinds_first(steps)[3] is steps[1] and kinds_first(steps)[4] is steps[3]


def test_steps_that_fit_all_run(fake):
  run_steps([fake.step("loop", 600) for _ in range(10)] + [fake.step("resize", 30)],
            progress=False)
  assert fake.built == ["loop", "resize"] + ["loop"] * 9 and fake.in_use == 1_000 + 6_030


def test_steps_that_would_pass_the_limit_are_refused_once_known(fake):
  """20 loops of 600 regions from 1,000 of a 10,000 limit: refused as soon as the first loop
  says what one maps (a kind not yet run counts nothing), with 19 loops never started."""
  steps = [fake.step("loop", 600) for _ in range(20)] + [fake.step("resize", 30)] * 3
  with pytest.raises(compiled.MapLimitError) as e:
    run_steps(steps, progress=False)
  assert fake.built == ["loop"]
  msg = str(e.value)
  assert "precompile (1 of 23 programs compiled, 22 left)" in msg
  assert "needs about 11,400 more" in msg
  assert "vm.max_map_count=10,000" in msg and "1,600 memory regions" in msg
  assert "sysctl -w vm.max_map_count" in msg  # and what to do


def test_programs_compiled_before_count_as_free(fake):
  """A step whose program another engine compiled maps nothing: the kind's mean over its
  steps, not its largest, prices the rest (an engine precompiled twice refuses nothing)."""
  steps = [fake.step("loop", 0) for _ in range(30)]
  fake.in_use = 9_000
  run_steps(steps, progress=False)
  assert len(fake.built) == 30


def test_each_program_compiles_once_and_done_work_is_left_out(fake):
  """Steps of one program (a window that is the loop over all slots) run once, and steps
  whose work is done already (compiled, and warmed where they warm) not at all: the count
  and the estimate are of what will compile."""
  a, b = fake.step("loop", 600), fake.step("loop", 600)
  steps = [PrecompileStep("loop", a.build, program=("loop", "all")),
           PrecompileStep("loop", b.build, program=("loop", "all")),
           PrecompileStep("resize", fake.step("resize", 30).build, program=("resize", 8),
                          done=lambda: True)]
  assert to_run(steps) == [steps[0]]
  run_steps(steps, progress=False)
  assert fake.built == ["loop"] and fake.in_use == 1_600


def test_a_start_up_compiles_what_fits_and_leaves_the_rest(fake, monkeypatch):
  """With `fit` (a server's start-up) the steps run in order until the next one's program may
  not fit (the most one of its kind mapped): 14 loops of 600 regions and a resize fit from
  1,000 under 95% of 10,000; the 8 steps left are counted, none refused, none let go."""
  steps = [fake.step("loop", 600) for _ in range(20)] + [fake.step("resize", 30)] * 3
  assert run_steps(steps, progress=False, fit=True) == 8
  assert fake.built == ["loop", "resize"] + ["loop"] * 13 and fake.in_use == 9_430
  monkeypatch.setattr(compiled, "_added", {"spec loop": 600})  # what compilations mapped
  assert run_steps([fake.step("loop", 600)], progress=False, fit=True) == 1  # no room
