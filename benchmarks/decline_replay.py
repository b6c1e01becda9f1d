"""Replay of the priced back-off with and without its decline (`bp_jax.decoding.decline`) and
its gate (`bp_jax.decoding.evidence`), at given costs, on teacher-forced acceptances: what each
can gain where one timed run cannot resolve a percent or two.

For each prompt the target decodes greedily; at every position t of its output the drafter
drafts b-1 tokens as a cycle starting there would (`replay.teacher_forced`),
giving the drafts a cycle there accepts (the leading run equal to the target's tokens) and the
drafter's probability of each. The priced controller at batch 1 is then simulated over each
prompt's positions, in units of AR steps: a cycle costs --draft_cost + --verify_cost and
commits a+1 tokens, and is a miss below that cost; a miss backs off 2, 4, ... AR steps (at
most --cap); with the decline, a cycle whose evidence-scaled expectation is below the verify
cost commits one token for --draft_cost + 1 (a miss), under the engine's rules (evidence of
EVIDENCE_ROWS cycles, at most MAX_DECLINE_LEVEL misses deep, forgetting EVIDENCE_FORGET per
verified cycle; one evidence across the prompts, as the engine carries it). Also the per-cycle
oracle (a cycle exactly where it commits more than it costs, an AR step elsewhere), the gated
back-off (the engine's gate, `evidence.backs_off`: a miss backs off only while the cycles right
after misses commit clearly less than cycles on average and less than PAYS_MULTIPLE times the
cycle's price, or while cycles lose on average; no decline), the same gate without its pay
test (the rule before it) and every cycle verified (the paper's loop, no misses). Reported:
committed tokens per AR step of cost, each over the simulated back-off without the decline.
With --iid each half is replayed again (--iid_seeds times) with every position's acceptance
drawn independently from the half's (`replay.iid`): the same profile without runs of hard
positions, where backing off after a miss gains nothing.

  python -m benchmarks.decline_replay --halves label,eval --costs 1.26:2.62,1.1:3.0,0.3:1.2

Costs are given, not timed: the figures say what the rule does at those prices, not how fast
this machine runs it.
"""

from __future__ import annotations

import math
import os

from absl import flags

from benchmarks import common
from benchmarks.replay import accepted_and_expected, iid, oracle, simulate, teacher_forced
from bp_jax import cli
from bp_jax.decoding import controller as control
from bp_jax.errors import BadInputError

common.define_flags("target", "drafter", "max_len", "max_new_tokens", "block_size",
                    num_prompts=0)
flags.DEFINE_string("halves", "label,eval", "HumanEval halves of configs/demo.py's split, "
                    "comma-separated (each replayed and reported apart)")
flags.DEFINE_string("costs", "1.26:2.62,1.1:3.0,1.4:2.4,0.3:1.2", "comma-separated "
                    "draft_cost:verify_cost pairs in AR steps (a drafter pass; a target forward "
                    "over b tokens), each simulated")
flags.DEFINE_integer("cap", control.PRICED_SKIP_CAP, "most AR steps in a row after misses")
flags.DEFINE_string("calibration", "", "also simulate with this calibration JSON's rates "
                    "(--config.controller_calibration) in place of the raw probabilities")
flags.DEFINE_bool("iid", False, "also replay each half with independently drawn acceptances "
                  "(`replay.iid`, seeds 0 .. --iid_seeds - 1)")
flags.DEFINE_integer("iid_seeds", 1, "with --iid: how many independent draws of each half")
flags.DEFINE_string("pays_multiples", "", "also simulate the gate with each of these "
                    "comma-separated margins of its pay test (`evidence.pays_after_miss`; the "
                    "engine's is PAYS_MULTIPLE): how the choice of margin was made")
flags.DEFINE_string("out", "", "folder for decline_replay.json (empty: print only)")
FLAGS = flags.FLAGS


def parse_costs(text: str) -> list[tuple[float, float]]:
  try:
    pairs = [tuple(float(x) for x in item.split(":")) for item in text.split(",") if item]
  except ValueError:
    pairs = []
  if not pairs or any(len(p) != 2 or p[0] < 0 or p[1] < 1 for p in pairs):
    raise BadInputError(f"--costs={text!r}: expected draft_cost:verify_cost pairs, e.g. "
                        "1.26:2.62,0.3:1.2 (draft_cost >= 0, verify_cost >= 1 AR step)")
  return pairs


def parse_multiples(text: str) -> list[float]:
  try:
    values = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = [0.0]
  if any(not v > 0 for v in values):
    raise BadInputError(f"--pays_multiples={text!r}: expected comma-separated numbers > 0, "
                        "e.g. 1.5,2,3")
  return values


def main(_):
  costs = parse_costs(FLAGS.costs)
  multiples = parse_multiples(FLAGS.pays_multiples)
  halves = [h.strip() for h in FLAGS.halves.split(",") if h.strip()]
  if not halves or any(h not in ("label", "eval") for h in halves):
    raise BadInputError(f"--halves={FLAGS.halves!r}: expected label and/or eval")
  rates = control.load_calibration(FLAGS.calibration, "--calibration") if FLAGS.calibration else None
  target, drafter, tok, stop_ids = common.load_models(FLAGS)
  report = {"command": common.command_line(), "block_size": FLAGS.block_size, "rows": []}
  for half in halves:
    prompts = common.demo_prompts(tok, half, limit=FLAGS.num_prompts)
    raw = teacher_forced(target, drafter, prompts, FLAGS.block_size, FLAGS.max_len,
                         FLAGS.max_new_tokens, stop_ids)
    forms = {"raw p": [accepted_and_expected(p, h) for p, h in raw]}
    if rates is not None:
      forms["calibrated"] = [accepted_and_expected(p, h, rates) for p, h in raw]
    if FLAGS.iid:
      if FLAGS.iid_seeds < 1:
        raise BadInputError(f"--iid_seeds={FLAGS.iid_seeds}: expected at least 1")
      for seed in range(FLAGS.iid_seeds):
        forms["iid" if seed == 0 else f"iid seed {seed}"] = iid(forms["raw p"], seed)
    for draft_cost, verify_cost in costs:
      for form, per_prompt in forms.items():
        base = simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap, declines=False)
        new = simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap, declines=True)
        gated = simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap, declines=False,
                         gate=True)
        unpaid = simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap, declines=False,
                          gate=True, pays_multiple=math.inf)
        every = simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap, declines=False,
                         every_cycle=True)
        row = {"half": half, "prompts": len(prompts), "draft_cost": draft_cost,
               "verify_cost": verify_cost, "probabilities": form,
               "backoff": round(base["tokens_per_ar_step"], 4),
               "with_decline": round(new["tokens_per_ar_step"], 4),
               "ratio": round(new["tokens_per_ar_step"] / base["tokens_per_ar_step"], 4),
               "declined": new["declined"], "verified": new["verified"],
               "gated": round(gated["tokens_per_ar_step"], 4),
               "gated_ratio": round(gated["tokens_per_ar_step"] / base["tokens_per_ar_step"], 4),
               "every_cycle": round(every["tokens_per_ar_step"], 4),
               "every_cycle_ratio": round(every["tokens_per_ar_step"] /
                                          base["tokens_per_ar_step"], 4),
               "gated_without_pay_test": round(unpaid["tokens_per_ar_step"], 4),
               "gated_without_pay_test_ar_steps": unpaid["ar_steps"],
               "ar_steps": base["ar_steps"], "gated_ar_steps": gated["ar_steps"],
               "oracle": round(oracle(per_prompt, draft_cost, verify_cost), 4),
               "gated_at_multiple": {
                   f"{m:g}": round(simulate(per_prompt, draft_cost, verify_cost, FLAGS.cap,
                                            declines=False, gate=True,
                                            pays_multiple=m)["tokens_per_ar_step"], 4)
                   for m in multiples}}
        report["rows"].append(row)
        print(f"  {half} ({len(prompts)} prompts), draft {draft_cost:g} + verify "
              f"{verify_cost:g} AR steps, {form}: back-off {row['backoff']:.4f}, with the "
              f"decline {row['with_decline']:.4f} tokens per AR step ({row['ratio']:.3f}x; "
              f"{row['declined']} declined, {row['verified']} verified); gated "
              f"{row['gated']:.4f} ({row['gated_ratio']:.3f}x; AR steps {row['gated_ar_steps']} "
              f"against {row['ar_steps']}; without its pay test {row['gated_without_pay_test']:.4f}"
              f", {row['gated_without_pay_test_ar_steps']} AR steps); every cycle "
              f"{row['every_cycle']:.4f} "
              f"({row['every_cycle_ratio']:.3f}x); oracle {row['oracle']:.4f}", flush=True)
  if FLAGS.out:
    common.write_json(os.path.join(FLAGS.out, "decline_replay.json"), report)


if __name__ == "__main__":
  cli.run(main, __doc__)
