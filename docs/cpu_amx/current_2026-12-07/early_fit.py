"""Replays the batch-1 `priced_default` engines' loop calls of the reports given through two
versions of `OnlineCosts` (built as `Engine._online_prices` builds it from the report's costs,
without the decline's by-prior length) and prints the price of a b = 8 cycle (AR steps) after
each of the first 8 speculative calls, each version's median over the run, and the largest
difference after the 8th call. Where the report's own logged prices match the first version's
replay the last column says so (reports of older code, or with the decline on, do not).

    git show bb7d5f4:bp_jax/decoding/online_costs.py > /tmp/oc_before.py
    PYTHONPATH=. python docs/cpu_amx/current_2026-12-07/early_fit.py /tmp/oc_before.py \
        docs/cpu_amx/*/b1_t*.json docs/cpu_amx/*/controllers.json
"""
import json
import os
import sys

import numpy as np

from bp_jax.decoding import controller as control

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "fit_spike_2026-12-07"))
from replay import b8_prices, online_costs_class  # noqa: E402


def replay(online_costs, run: dict) -> np.ndarray:
  given = run["controller_costs"]
  costs, draft = tuple(given["controller_costs"]), given["controller_draft_cost"]
  prices = online_costs(lambda n: control.break_even(n - 1, costs, draft),
                        batch_prior_floor=1.0, one_prior_floor=0.5)
  return np.asarray(list(b8_prices(prices, run["call_logs"]["priced_default"])))


def main(before: str, paths: list[str]) -> None:
  old, new = online_costs_class(before), online_costs_class(None)
  for path in sorted(set(paths)):
    run = json.load(open(path))
    if run.get("batch_size") != 1 or "priced_default" not in run.get("call_logs", {}):
      continue
    a, b = replay(old, run), replay(new, run)
    logged = [c["break_even"] for c in run["call_logs"]["priced_default"] if c["block_size"] > 1]
    first = lambda v: " ".join(f"{p:.1f}" for p in v[:8])
    print(f"{path.removeprefix('docs/cpu_amx/')}  T={run['temperature']:g}  calls {len(a)}\n"
          f"  first 8 before: {first(a)}\n  first 8 now:    {first(b)}\n"
          f"  median {np.median(a):.2f} / {np.median(b):.2f}; largest difference after the 8th "
          f"call {np.max(np.abs(a[8:] - b[8:])):.3f}; the log matches the replay before: "
          f"{np.allclose(a, logged[:len(a)], rtol=1e-3)}")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
