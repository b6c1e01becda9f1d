"""Replays a learned engine's batch-1 loop calls through `OnlineCosts`, built as
`Engine._online_prices` builds it from that engine's own start-up costs, and prints the price
of a b = 8 cycle (AR steps) over the run, in bins of 20 speculative calls.

    PYTHONPATH=. python docs/cpu_amx/fit_spike_2026-12-07/replay.py \
      docs/cpu_amx/fit_spike_2026-12-07/b1_t0_before.json \
      docs/cpu_amx/fit_spike_2026-12-07/learned_engine_costs_b1.json [OLD_ONLINE_COSTS.py]

The optional third argument is another version of bp_jax/decoding/online_costs.py to replay
with (e.g. `git show 8a6003c:bp_jax/decoding/online_costs.py > /tmp/oc_old.py`). The replay
prices what the engine's fit priced from the same calls; the run's own choices (how many AR
steps each call ran) are the old code's, so it shows the prices, not a new run.
"""
import importlib.util
import json
import sys

from bp_jax.decoding import controller as control
from bp_jax.decoding.costs import ForwardCosts


def online_costs_class(path: str | None):
  if path is None:
    from bp_jax.decoding.online_costs import OnlineCosts
    return OnlineCosts
  spec = importlib.util.spec_from_file_location("online_costs_other", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules["online_costs_other"] = module
  spec.loader.exec_module(module)
  return module.OnlineCosts


def b8_prices(prices, calls: list[dict]):
  """Feeds a report's logged loop calls to `prices` (an OnlineCosts); yields the price of a
  b = 8 cycle at batch 1 after each speculative call."""
  for call in calls:
    counts = call["forwards_N"]
    if call["block_size"] == 1:
      prices.observe_plain(call["seconds"], counts[0], call["rows"])
      continue
    prices.observe(call["seconds"], counts, call["rows"])
    yield prices.break_even(8, 1)


def main(report: str, costs_file: str, other: str | None = None) -> None:
  run = json.load(open(report))
  measured = ForwardCosts.from_json(json.load(open(costs_file))["costs"])
  costs, draft = measured.relative()
  shape = (None if not measured.draft_by_block else
           lambda n: control.break_even(n - 1, costs, measured.draft_steps_at(n)))
  prices = online_costs_class(other)(lambda n: control.break_even(n - 1, costs, draft),
                                     batch_prior_floor=1.0, one_prior_floor=0.5, by_prior=(1,),
                                     size_shape=shape)
  prices.set_ar_step_floor(measured.verify_s[0], measured.batch_size)
  bins: dict[int, list[float]] = {}
  for spec_calls, price in enumerate(b8_prices(prices, run["call_logs"]["learned_default"])):
    bins.setdefault(spec_calls // 20, []).append(price)
  print("speculative calls  price of a b = 8 cycle (AR steps, mean over the bin)")
  for k, seen in sorted(bins.items()):
    print(f"  {20 * k:4d}-{20 * k + len(seen) - 1:4d}  {sum(seen) / len(seen):6.2f}")
  last = [p for k in sorted(bins) for p in bins[k]][-12:]
  print("the last 12 calls: " + " ".join(f"{p:.2f}" for p in last))


if __name__ == "__main__":
  main(*sys.argv[1:])
