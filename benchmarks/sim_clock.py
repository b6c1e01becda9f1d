"""A simulated device's clock for an engine (`benchmarks/controllers.py --sim_clock_ms`): time
passes as the engine's target forwards run, at a cost table's prices, with per-call noise and
stalls, so that the online prices (`bp_jax.decoding.online_costs`) fit calls shaped like a
device's while the decoding runs here.

An engine books each loop call as the clock's reading after the call less its reading before
(`Engine.loop_ran`, which counts the call's forwards first). Each reading charges the forwards
run since the last one: `ar_ms` per AR step and, per forward verifying n tokens after a drafter
pass, `ar_ms` x (the table's cost of a forward over n tokens + the drafter's), times a lognormal
factor of sigma `noise`, plus `stall_s` on every `stall_every`-th charged call (0: none). A reading
with nothing new to charge (a call's start; a resize or a row's move between buckets, which the
scheduler times on the engine's clock too) does not move the clock: a row's copy runs no
forward, only one row's caches copied at the device's memory bandwidth. Prices do not depend on
the rows a forward computes (an accelerator's batch forwards, at a batch size's own table).
An idle device's time passes by `advance_to` (a server waiting for requests,
`benchmarks/arrivals.py`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bp_jax.decoding.controller import verify_cost


class SimClock:
  """`Engine.clock` replacement (module doc); `engine` is read at each call."""

  def __init__(self, engine, costs: Sequence[float], draft_cost: float, ar_ms: float,
               noise: float = 0.0, stall_s: float = 0.0, stall_every: int = 0, seed: int = 0):
    if ar_ms <= 0 or noise < 0 or stall_s < 0 or stall_every < 0:
      raise ValueError(f"SimClock: ar_ms {ar_ms} must be > 0; noise {noise}, stall_s "
                       f"{stall_s} and stall_every {stall_every} >= 0")
    self.engine = engine
    self.costs, self.draft_cost = tuple(float(c) for c in costs), float(draft_cost)
    self.ar_s = ar_ms * 1e-3
    self.noise, self.stall_s, self.stall_every = noise, stall_s, int(stall_every)
    self.rng = np.random.default_rng(seed)
    self.now = 0.0
    self.charged = 0.0  # the noiseless seconds of every forward charged so far
    self.calls = 0  # readings that charged forwards

  def price_s(self, n: int) -> float:
    """Seconds of one target forward of verify length n (0: an AR step)."""
    if n == 0:
      return self.ar_s
    return self.ar_s * (verify_cost(n, self.costs) + self.draft_cost)

  def __call__(self) -> float:
    total = sum(self.price_s(int(n)) * c for n, c in self.engine.forwards_run.items())
    if total < self.charged:  # the engine's tallies were cleared (`Engine.clear_tallies`,
      self.charged = 0.0      # between decodes): what it counts now ran since
    new = total - self.charged
    if new > 0:
      self.charged = total
      self.calls += 1
      factor = float(np.exp(self.rng.normal(0.0, self.noise))) if self.noise else 1.0
      stall = self.stall_s if self.stall_every and self.calls % self.stall_every == 0 else 0.0
      self.now += new * factor + stall
    return self.now

  def advance_to(self, t: float) -> None:
    """The device idles until `t` (nothing where the clock is past it already)."""
    self.now = max(self.now, float(t))
