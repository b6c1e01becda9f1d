"""Replays batch-1 reports' speculative engines' loop calls (`call_logs`) through `OnlineCosts`
as the engine builds it (its start-up costs as the prior; plain calls timed apart) and prints
each engine's price of a full b = 8 cycle after each speculative call: with the plain-step
floor lapsing past `PLAIN_FLOOR_CALLS` speculative calls (now) and never lapsing (before).
The prior is the report's measured start-up table (the learned default's engine measured its
own at larger sizes: its prior differs a little, which moves only the first calls).

  PYTHONPATH=. python docs/cpu_epyc/model17_2026-12-08/plain_floor.py REPORT.json ...
"""
import json
import sys

import numpy as np

from bp_jax.decoding import controller as control
from bp_jax.decoding import online_costs
from bp_jax.decoding.online_costs import OnlineCosts


def prices(calls, table, draft, lapse):
  online_costs.PLAIN_FLOOR_CALLS = lapse
  est = OnlineCosts(lambda n: control.break_even(n - 1, table, draft), batch_prior_floor=1.0,
                    one_prior_floor=0.5)
  out = []
  for c in calls:
    if c["block_size"] == 1:
      est.observe_plain(c["seconds"], c["forwards_N"][0], 1)
    else:
      est.observe(c["seconds"], np.asarray(c["forwards_N"]), 1)
      out.append(est.break_even(8, 1))
  return np.asarray(out)


def main(paths):
  now = online_costs.PLAIN_FLOOR_CALLS
  for path in paths:
    d = json.load(open(path))
    if d.get("batch_size") != 1 or d.get("block_size") != 8:
      continue
    costs = d["controller_costs"]
    for m in ("priced_default", "learned_default"):
      calls = d.get("call_logs", {}).get(m)
      if not calls or not any(c["block_size"] > 1 for c in calls):
        continue
      new = prices(calls, costs["controller_costs"], costs["controller_draft_cost"], now)
      old = prices(calls, costs["controller_costs"], costs["controller_draft_cost"], 10**9)
      moved = np.abs(np.log(new / old)) > 0.05
      print(f"{path} T={d['temperature']:g} {m}: {len(new)} calls, b=8 price median "
            f"{np.median(old):.2f} before, {np.median(new):.2f} now; moved >5% at "
            f"{moved.mean():.0%} of calls")
  online_costs.PLAIN_FLOOR_CALLS = now


if __name__ == "__main__":
  main(sys.argv[1:])
