"""The default at batch 1 with one request's AR step priced at least the plain loop's step (the
variant below, patched into the first engine's prices; measured, not landed) against the
engine's estimator (the fit's own AR step; host-side only, so both share their programs),
on the demo: HumanEval's evaluation half, 128 new tokens, the priced default's options as
`benchmarks/controllers.py` builds them, each engine measuring its own costs and keeping its
own history; a warm-up round, then ROUNDS timed rounds, each engine's round in turn.

    PYTHONPATH=. python docs/cpu_epyc/plainfloor_ab.py [rounds] [temperature] [num_prompts]
    # temperature 1: the sampling drafter, rejection verify, seed = the prompt's index

Prints whether greedy runs give AR's tokens, each engine's drafted requests, AR steps and
cycles in the timed rounds, the range of its full cycle's price over its speculative calls,
and plain-floor / before time per request with a 95% bootstrap interval.
"""

import sys

import numpy as np

from bp_jax.decoding.online_costs import OnlineCosts
from paired_ab import demo_default, paired_ratio, timed_summary


class PlainFloor(OnlineCosts):
  """One request's cycle refitted to its calls with the AR step held at the plain loop's step
  (`plain_step_s`) where its fit prices the step below it; its price and start price in that
  step. Batches as the engine's."""

  def _cycle_s(self, n, rows):
    fit = self._fit(int(rows))
    seconds, plain = fit.seconds(int(n)), self.plain_step_s(rows)
    if rows != 1 or seconds is None or plain is None or not fit.seconds(0) < plain:
      return None
    rest = list(range(1, len(fit.lengths)))
    A_rr = fit.A[np.ix_(rest, rest)]
    R = np.diag(self.ridge * np.diag(A_rr) + 1e-9 * (float(np.trace(A_rr)) / len(rest) + 1.0))
    theta = np.linalg.solve(A_rr + R, fit.b[rest] - fit.A[rest, 0] * plain + R @ fit.theta[rest])
    return float(theta[rest.index(fit.lengths.index(int(n)))]), plain

  def break_even(self, n, rows):
    refit = self._cycle_s(n, rows)
    if refit is None:
      return super().break_even(n, rows)
    return self.clip(n, refit[0] / refit[1], 1)

  def start_break_even(self, n, rows):
    refit = self._cycle_s(n, rows)
    if refit is None:
      return super().start_break_even(n, rows)
    plain = self._plain_at_fit.get(1) or refit[1]
    return self.clip(n, refit[0] / plain, 1)


def main() -> None:
  rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
  limit = int(sys.argv[3]) if len(sys.argv) > 3 else 0
  sampled = temperature > 0
  build, prompts = demo_default(sampled, limit)
  engines = {"plain_floor": build(), "before": build()}
  engines["plain_floor"].prices.__class__ = PlainFloor
  gens = {name: [] for name in engines}
  for eng in engines.values():
    eng.call_log = []
  index = {id(p): i for i, p in enumerate(prompts)}

  def runner(name):
    def run(p):
      g = engines[name].generate(p, max_new_tokens=128, block_size=8,
                                 temperature=temperature, seed=index[id(p)])
      gens[name].append(g)
      return g
    return run

  decode = {name: runner(name) for name in engines}
  print("plain_floor / before: " + paired_ratio(decode, prompts, rounds=rounds, new_tokens=128))
  ar = None if sampled else [
      list(engines["before"].generate(p, max_new_tokens=128, block_size=1).output_ids)
      for p in prompts]
  for name, gs in gens.items():
    prices = [c.break_even for c in engines[name].call_log
              if c.block_size > 1 and c.break_even is not None]
    print(f"{name}: {timed_summary(gs, len(prompts), ar)}; full cycle's price over "
          f"{len(prices)} calls: median {np.median(prices):.2f}, 5-95% "
          f"{np.percentile(prices, 5):.2f}-{np.percentile(prices, 95):.2f}, max "
          f"{max(prices):.2f}, last {prices[-1]:.2f}")


if __name__ == "__main__":
  main()
