"""What an engine's loop calls cost: by the shape they ran at (block size, slots), and call by
call where a caller asks for the record (`Engine.call_log`)."""

from __future__ import annotations

import dataclasses
import statistics


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


@dataclasses.dataclass(frozen=True)
class LoopCall:
  """One loop call as the engine booked it (`Engine.loop_ran`): when it ended (`end_s`, the
  engine's clock), its wall `seconds`, its shape, the target forwards it ran per verify length
  (`forwards_N[0]` AR steps, `forwards_N[n]` cycles verifying n tokens), and what the priced
  controller weighed drafting against once the call was booked, for a full cycle of the call's
  block size (a plain call's: the engine's largest) at these slots: `break_even` (the
  speculative loop's cycle in its own AR steps, a block-size policy's size at the price the
  policy weighed it by: a cycle's miss rule and a request's start alone) and `start_break_even`
  (in steps of the plain AR loop: a batch's request's start); None without the priced
  controller."""
  end_s: float
  seconds: float
  block_size: int
  rows: int
  forwards_N: tuple[int, ...]
  break_even: float | None = None
  start_break_even: float | None = None

  def to_json(self) -> dict:
    rnd = lambda x: None if x is None else round(float(x), 4)
    return {"end_s": round(self.end_s, 4), "seconds": round(self.seconds, 5),
            "block_size": self.block_size, "rows": self.rows, "forwards_N": list(self.forwards_N),
            "break_even": rnd(self.break_even), "start_break_even": rnd(self.start_break_even)}


def tally_json(tallies: dict[tuple[int, int], CallTally]) -> dict[str, dict]:
  """`Engine.loop_calls` as JSON: "b<block size>x<slots>" -> the tally, in shape order."""
  return {f"b{b}x{rows}": t.to_json() for (b, rows), t in sorted(tallies.items())}


def calls_line(calls: dict[str, dict]) -> str:
  """`tally_json`'s shapes in one line: per shape its calls, seconds and ms per forward."""
  return "; ".join(f"{shape} {c['calls']} calls, {c['seconds']:.2f} s, "
                   f"{c['ms_per_forward']:.3f} ms/forward"
                   for shape, c in calls.items() if c["forwards"])


def first_call_against_peers(log: list[LoopCall]) -> dict | None:
  """The first call of a log (a timed run's first) against the later calls that ran the same
  forwards at the same shape (a static method replays its calls every repeat): its seconds, the
  peers' median and how many; None when no later call ran the same. A first call far above its
  peers is a cost of the run's start, not of the method's work."""
  if not log:
    return None
  first = log[0]
  peers = [c.seconds for c in log[1:] if (c.forwards_N, c.block_size, c.rows)
           == (first.forwards_N, first.block_size, first.rows)]
  if not peers:
    return None
  return {"first_s": round(first.seconds, 5), "peers_median_s": round(statistics.median(peers), 5),
          "peers": len(peers)}
