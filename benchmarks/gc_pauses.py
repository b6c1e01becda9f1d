"""Python's garbage collections during a benchmark, and those that fell inside timed loop calls.

A collection of the oldest generation walks every object the process holds (after a run's
compiles, on the development CPU: 190-380 ms each at the test shapes), and one that starts while
the host dispatches a loop call or waits for it lengthens that call's wall time. The benchmark
records every collection (`gc.callbacks`) and, per method, counts those that started inside one
of its booked calls (`Engine.call_log`: each call's end and seconds on the engine's clock, here
`time.perf_counter`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Sequence


@dataclasses.dataclass
class GcPauses:
  """Every collection between `start` and `stop`: (start on `time.perf_counter`, seconds, generation)."""
  events: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
  _started: float | None = None

  def _callback(self, phase: str, info: dict) -> None:
    if phase == "start":
      self._started = time.perf_counter()
    elif self._started is not None:
      self.events.append((self._started, time.perf_counter() - self._started,
                          int(info["generation"])))
      self._started = None

  def start(self) -> "GcPauses":
    gc.callbacks.append(self._callback)
    return self

  def stop(self) -> None:
    if self._callback in gc.callbacks:
      gc.callbacks.remove(self._callback)

  def inside(self, calls: Sequence) -> dict:
    """The collections that started inside one of `calls` (`LoopCall`s: `end_s`, `seconds`):
    how many, their milliseconds in all and the longest, and how many were of the oldest
    generation."""
    spans = [(c.end_s - c.seconds, c.end_s) for c in calls]
    hit = [(s, d, g) for s, d, g in self.events if any(a <= s <= b for a, b in spans)]
    return {"count": len(hit), "ms": round(1e3 * sum(d for _, d, _ in hit), 2),
            "max_ms": round(1e3 * max((d for _, d, _ in hit), default=0.0), 2),
            "oldest": sum(g == 2 for _, _, g in hit)}
