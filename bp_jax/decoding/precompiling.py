"""An engine's precompile run as a list of steps: one program each, one of every kind first,
refused before it starts a compilation that would take the process past the kernel's limit on
its memory maps (`compiled.MapLimitError`) instead of minutes later, when XLA:CPU would abort;
or, for a server's start-up (`fit`), stopped where the next program may not fit, the rest left
to compile on first use (where the engines' least recently used programs then make room).

`Engine.precompile` lists the steps (`PrecompileStep`: what it compiles and how); `run_steps`
compiles them, each program once (a step whose program an earlier step compiles, or one done
already, is left out: the count and the estimate are of what will compile). After the first
step of each kind it knows what one program of that kind maps (the mean over its steps so far:
a program another engine compiled maps nothing), and it refuses as soon as the steps left would
pass `compiled.MAP_LIMIT_SHARE` of the limit (a batch-16 learned engine's full precompile,
207 programs, needed ~105,000 regions of a 65,530 limit here;
docs/cpu_xeon167/map_limit_2026-12-05).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

from tqdm import tqdm

from bp_jax.decoding import compiled


@dataclasses.dataclass(frozen=True)
class PrecompileStep:
  """kind: what the step compiles (programs of one kind map about as many regions: "spec
  loop", "resize", ...); build: compiles it (and may run it once, its warm-up); program: the
  key of the program it compiles (None: its own); done: whether its work is done already (its
  program compiled, and warmed where it warms one)."""
  kind: str
  build: Callable[[], object]
  program: Hashable = None
  done: Callable[[], bool] = lambda: False


def to_run(steps: Sequence[PrecompileStep]) -> list[PrecompileStep]:
  """`steps` less those done already and those whose program an earlier step compiles."""
  seen: set = set()
  out = []
  for step in steps:
    if step.program is not None:
      if step.program in seen:
        continue
      seen.add(step.program)
    if not step.done():
      out.append(step)
  return out


def kinds_first(steps: Sequence[PrecompileStep]) -> list[PrecompileStep]:
  """The first step of each kind, then the others, each group in the given order: what every
  kind maps is known after len(kinds) steps."""
  seen: set[str] = set()
  first, rest = [], []
  for step in steps:
    (rest if step.kind in seen else first).append(step)
    seen.add(step.kind)
  return first + rest


def run_steps(steps: Sequence[PrecompileStep], progress: bool | None = None,
              fit: bool = False) -> int:
  """Runs `steps` (`to_run`, `kinds_first`), with a progress bar on a terminal (`progress` None) or
  where asked, and returns how many were left out. Before a step where the maps the steps left
  are expected to add (each kind's mean so far, 0 for a kind not yet run) would pass the
  process's share of its limit, it refuses (`compiled.MapLimitError`), or with `fit` (a
  server's start-up: those programs compile on first use) stops before the first step whose
  program may not fit (the most one of its kind mapped, else the most any step did, else
  `compiled.expected_maps`). Neither lets a program compiled before go to make room."""
  order = kinds_first(to_run(steps))
  added: dict[str, list[int]] = {}
  use = compiled.maps_in_use()  # each step's reading after it is the next one's before it
  for i, step in enumerate(tqdm(order, desc="precompiling", unit="program",
                                disable=None if progress is None else not progress)):
    if fit:  # one program: the most one of its kind mapped, else the most any did
      seen = added.get(step.kind) or [m for v in added.values() for m in v]
      need = max(seen) if seen else compiled.expected_maps(step.kind)
    else:
      mean = {k: sum(v) / len(v) for k, v in added.items()}
      need = int(sum(mean.get(s.kind, 0.0) for s in order[i:]))
    what = f"precompile ({i} of {len(order)} programs compiled, {len(order) - i} left)"
    try:
      use = compiled.check_map_room(step.kind, need, use=use, what=what, evict=False)
    except compiled.MapLimitError:
      if not fit:
        raise
      return len(order) - i
    step.build()
    after = compiled.maps_in_use()
    if use is not None and after is not None:
      added.setdefault(step.kind, []).append(max(0, after[0] - use[0]))
    use = after
  return 0
