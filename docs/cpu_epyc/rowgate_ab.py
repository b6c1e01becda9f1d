"""The default at batch 1 with the back-off gate counting each row's own misses (the engine's
code, 3884410) against the rule before it (a cycle follows a miss when the batch's back-off
level is above 0; patched in for the second engine, whose programs are traced and kept apart),
alternated round by round in one process (`paired_ab`) on the demo: HumanEval's evaluation
half, 128 new tokens, the priced default's options as `benchmarks/controllers.py` builds them,
each engine measuring its own costs and keeping its own history; a warm-up round, then ROUNDS
timed rounds.

    PYTHONPATH=. python docs/cpu_epyc/rowgate_ab.py [rounds] [num_prompts]
    AA=1 PYTHONPATH=. python docs/cpu_epyc/rowgate_ab.py 3   # the A/A check

Prints whether both give AR's tokens, each engine's drafted requests, AR steps and cycles in
the timed rounds, and per-row / batch-level time per request with a 95% bootstrap interval.
"""

import contextlib
import os
import sys

from bp_jax.decoding import compiled, controllers, decline as decline_rule, evidence
from paired_ab import demo_default, paired_ratio, timed_summary


def batch_level_observed(self, s, k, a_B, expected_B=None):
  """`controllers.Priced.observed` before 3884410."""
  e = s.evidence_7
  if self.decline:
    e = e.at[evidence.DECLINE].set(decline_rule.observed(e[evidence.DECLINE], k,
                                                         self.block_size, expected_B, a_B))
  if self.persist:
    e = evidence.observed(e, k, self.block_size, a_B, s.backoff_level(a_B >= 0) > 0)
  return s.replace(evidence_7=e) if self.stateful else s


@contextlib.contextmanager
def batch_level_rule():
  """The rule before, its programs kept apart; with AA=1 in the environment, only kept apart (an
  A/A check of the setup: both engines run the per-row rule)."""
  new = controllers.Priced.observed
  if not os.environ.get("AA"):
    controllers.Priced.observed = batch_level_observed
  try:
    with compiled.shared_programs_set_aside():
      yield
  finally:
    controllers.Priced.observed = new


def main() -> None:
  rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  limit = int(sys.argv[2]) if len(sys.argv) > 2 else 0
  build, prompts = demo_default(limit=limit)
  per_row = build()
  with batch_level_rule():
    batch_level = build()
  gens = {"per_row": [], "batch_level": []}

  def run(name, eng, p):
    g = eng.generate(p, max_new_tokens=128, block_size=8)
    gens[name].append(g)
    return g

  def run_old(p):
    with batch_level_rule():
      return run("batch_level", batch_level, p)

  decode = {"per_row": lambda p: run("per_row", per_row, p), "batch_level": run_old}
  print("per_row / batch_level: " + paired_ratio(decode, prompts, rounds=rounds, new_tokens=128))
  ar = [list(per_row.generate(p, max_new_tokens=128, block_size=1).output_ids) for p in prompts]
  for name, gs in gens.items():
    print(f"{name}: {timed_summary(gs, len(prompts), ar)}")


if __name__ == "__main__":
  main()
