"""The default at batch 1 with one request's AR step priced at least the plain loop's step
(`OnlineCosts.one_plain_floor`, the engine's default since the thirty-sixth session) against
the same engine with the fit's own step (host-side only, so both share their programs), on the
demo: HumanEval's evaluation half, 128 new tokens, the priced default's options as
`benchmarks/controllers.py` builds them, each engine measuring its own costs and keeping its
own history; a warm-up round, then ROUNDS timed rounds, each engine's round in turn.

    PYTHONPATH=. python docs/cpu_epyc/plainfloor_ab.py [rounds] [temperature] [num_prompts] [aa]
    # temperature 1: the sampling drafter, rejection verify, seed = the prompt's index
    # aa: both engines as the engine builds them (an A/A run: what two engines' own histories
    #   alone make them differ by)

Prints whether greedy runs give AR's tokens, each engine's drafted requests, AR steps and
cycles in the timed rounds, the range of its full cycle's price over its speculative calls,
and plain-floor / before time per request with a 95% bootstrap interval (over requests: it
leaves out how far two engines' histories part, which the A/A runs measure).

Until the thirty-sixth session the engine did not time one request's plain loop into its
prices, so the floor this script patched in never bound at batch 1: its two runs of the
session before and the four at that session's start were A/A runs (docs/results/controller.md).
"""

import sys

import numpy as np

from paired_ab import demo_default, paired_ratio, timed_summary


def main() -> None:
  rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
  limit = int(sys.argv[3]) if len(sys.argv) > 3 else 0
  same = len(sys.argv) > 4 and sys.argv[4] == "aa"
  sampled = temperature > 0
  build, prompts = demo_default(sampled, limit)
  engines = {"plain_floor": build(), "before": build()}
  engines["before"].prices.one_plain_floor = same
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
    plain = engines[name].prices.plain_step_s(1)
    print(f"{name}: {timed_summary(gs, len(prompts), ar)}; full cycle's price over "
          f"{len(prices)} calls: median {np.median(prices):.2f}, 5-95% "
          f"{np.percentile(prices, 5):.2f}-{np.percentile(prices, 95):.2f}, max "
          f"{max(prices):.2f}, last {prices[-1]:.2f}; plain loop's step "
          f"{'-' if plain is None else f'{1e3 * plain:.3f} ms'}")


if __name__ == "__main__":
  main()
