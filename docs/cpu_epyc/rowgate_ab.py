"""The default at batch 1 with the back-off gate counting each row's own misses (the engine's
code, 3884410) against the rule before it (a cycle follows a miss when the batch's back-off
level is above 0; patched in for the second engine, whose programs are traced and kept apart),
alternated per request in one process on the demo: HumanEval's evaluation half, 128 new
tokens, the priced default's options as `benchmarks/controllers.py` builds them, each engine
measuring its own costs and keeping its own history; a warm-up round, then ROUNDS timed rounds.

    PYTHONPATH=. python docs/cpu_epyc/rowgate_ab.py [rounds] [num_prompts]
    AA=1 PYTHONPATH=. python docs/cpu_epyc/rowgate_ab.py 3   # the A/A check

Prints whether both give AR's tokens, each engine's drafted requests, AR steps and cycles in
the timed rounds, and per-row / batch-level time per request with a 95% bootstrap interval.
"""

import contextlib
import os
import sys

from benchmarks.common import demo_prompts
from bp_jax.decoding import compiled, controllers, decline as decline_rule, evidence
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.text.tokenizer import load_tokenizer, stop_token_ids
from bp_jax.weights.loading import load_drafter, load_target
from paired_ab import paired_ratio


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
  target = decode_form(load_target("demo/target", "float32"))
  drafter = load_drafter("demo/drafter", target.cfg, "float32")
  tok = load_tokenizer("demo/target")
  prompts = [ids for _, ids in demo_prompts(tok, "eval", limit=limit)]
  loop = LoopOptions(controller="priced", ar_fallback=16, priced_cap=64, online_costs=True,
                     start_backoff=True, start_plain=True, ar_fallback_accept=1)
  build = lambda: Engine(target, drafter=drafter, stop_ids=stop_token_ids(tok),
                         shapes=ShapeOptions(max_len=1024, block_sizes=(1, 8)), loop=loop)
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
  n = len(prompts)
  for name, gs in gens.items():
    timed = gs[n:]
    same = all(list(g.output_ids) == ar[i % n] for i, g in enumerate(gs))
    print(f"{name}: AR's tokens {same}; timed rounds: {sum(not g.plain_start for g in timed)} of "
          f"{len(timed)} requests drafted, {sum(g.ar_steps for g in timed)} AR steps, "
          f"{sum(g.cycles for g in timed)} cycles")


if __name__ == "__main__":
  main()
