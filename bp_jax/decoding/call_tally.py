"""What an engine's loop calls cost, by the shape they ran at (block size, slots)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CallTally:
  """Loop calls of one (block size, slots) shape: how many, their wall seconds and the target
  forwards they ran (a batched forward counts once however many rows decode)."""
  calls: int = 0
  seconds: float = 0.0
  forwards: int = 0

  def add(self, seconds: float, forwards: int) -> None:
    self.calls += 1
    self.seconds += float(seconds)
    self.forwards += int(forwards)

  @property
  def ms_per_forward(self) -> float | None:
    """Milliseconds per target forward (None before one ran)."""
    return 1e3 * self.seconds / self.forwards if self.forwards else None

  def to_json(self) -> dict:
    per = self.ms_per_forward
    return {"calls": self.calls, "seconds": round(self.seconds, 4), "forwards": self.forwards,
            "ms_per_forward": None if per is None else round(per, 4)}


def tally_json(tallies: dict[tuple[int, int], CallTally]) -> dict[str, dict]:
  """`Engine.loop_calls` as JSON: "b<block size>x<slots>" -> the tally, in shape order."""
  return {f"b{b}x{rows}": t.to_json() for (b, rows), t in sorted(tallies.items())}


def calls_line(calls: dict[str, dict]) -> str:
  """`tally_json`'s shapes in one line: per shape its calls, seconds and ms per forward."""
  return "; ".join(f"{shape} {c['calls']} calls, {c['seconds']:.2f} s, "
                   f"{c['ms_per_forward']:.3f} ms/forward"
                   for shape, c in calls.items() if c["forwards"])
