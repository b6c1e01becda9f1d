"""Replays benchmark runs' logged loop calls through the priced controller's cost estimator.

Each `benchmarks.controllers` run keeps the default's loop calls in its json (`call_logs`:
seconds, forward counts, slots) and the start-up costs; this feeds them, in order, to an
`OnlineCosts` built as the engine builds it, and prints per batch size the full cycle's price
(in AR steps) after each priced call: calls, median, max, last. Open loop: the calls are the
run's, not what another estimator's prices would have made the loop run.

    PYTHONPATH=. python docs/cpu_epyc/price_replay.py docs/cpu_epyc/b16_t0_2026-11-29_rowgate
    # --no_plain_floor: one request's AR step as its fit prices it, not held at least at the
    #   plain loop's step (`OnlineCosts.one_plain_floor`, on since the thirty-sixth session)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from bp_jax.decoding import controller as control
from bp_jax.decoding.online_costs import OnlineCosts


def replay(run: Path, plain_floor: bool = True) -> dict[int, tuple[int, float, float, float]]:
  report = json.loads((run / "controllers.json").read_text())
  first = re.search(r"target forward over 1/2/4/8 tokens ([\d.]+)/",
                    (run / "controllers.log").read_text())
  costs = report["controller_costs"]
  prior = lambda n: control.break_even(n - 1, costs["controller_costs"],
                                       costs["controller_draft_cost"])
  est = OnlineCosts(prior, batch_prior_floor=1.0, one_prior_floor=0.5, by_prior=(1,),
                    one_plain_floor=plain_floor)
  est.set_ar_step_floor(float(first.group(1)) * 1e-3, report["batch_size"])
  prices: dict[int, list[float]] = {}
  for call in report["call_logs"]["priced_default"]:
    counts, rows = call["forwards_N"], call["rows"]
    if call["block_size"] == 1:  # the plain loop
      est.observe_plain(call["seconds"], counts[0], rows)
      continue
    est.observe(call["seconds"], counts, rows)
    prices.setdefault(rows, []).append(est.break_even(len(counts) - 1, rows))
  return {rows: (len(p), round(float(np.median(p)), 2), round(max(p), 2), round(p[-1], 2))
          for rows, p in sorted(prices.items())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", type=Path, help="run folders (controllers.json/.log)")
  parser.add_argument("--no_plain_floor", action="store_true",
                      help="one request's AR step as fitted, not held at least at the plain "
                           "loop's step")
  args = parser.parse_args()
  for run in args.runs:
    if not (run / "controllers.json").is_file() or not (run / "controllers.log").is_file():
      print(f"{run}: no controllers.json and .log, skipped")
      continue
    print(run.name, "{rows: (speculative-loop calls, median, max, last)}",
          replay(run, not args.no_plain_floor))


if __name__ == "__main__":
  main()
