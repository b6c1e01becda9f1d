"""Batch 1: the learned default's moves off b = 8, repriced at each run's own measured prices.

For each `benchmarks.controllers` report given (HumanEval's evaluation half, batch 1, the learned
default and b = 8 in its engine, `learned_fixed`): each request's fastest default decode and the
size it used; the demo policy's predicted cost of every size for that prompt (its counts from
the prompt's prefill features, shrunk as `BlockPolicy.decide` does), priced at the run's own
measured prices (each size's cycle at its whole-run ratio to a b = 8 cycle, `replay.py`, times
the median break-even of b = 8's calls; a fallback step at one AR step). Prints how many moves
were predicted cheaper than b = 8 at those prices (>= 0, 2%, 5%), and b = 8's time over the
default's as the run went and as it would have gone with every move predicted less than m
cheaper held at b = 8 (its time then: b = 8's own on that request).

  PYTHONPATH=. python docs/cpu_amx/size_prices_2026-12-07/departures.py REPORT.json [...]
"""
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay import calls, whole_run_ratios  # noqa: E402

MARGINS = (0.0, 0.02, 0.05, 0.1, float("inf"))


def policy_counts(keys: set[str]) -> tuple[dict, tuple, float, np.ndarray]:
  """({prompt key: [2C] the demo policy's counts}, its sizes, lam, [2C] prior)."""
  from absl import flags
  import jax.numpy as jnp
  from benchmarks import controllers as C
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import ShapeOptions
  from bp_jax.policy.mlp import load_policy
  flags.FLAGS(["departures", "--num_prompts", "0", "--half", "eval"])
  setup = C.load_setup()
  policy, info = load_policy("demo/policy")
  engine = Engine(setup.target, shapes=ShapeOptions(max_len=setup.max_len, block_sizes=(1,)))
  out = {}
  for key, ids in setup.prompts:
    if key in keys:
      g = engine.generate(ids, max_new_tokens=1, block_size=1, return_features=True)
      x = jnp.asarray(g.features[policy.arch.feature_type][None, :])
      out[key] = np.asarray(policy(x))[0]
  return (out, tuple(info.block_sizes), float(policy.value_lam[...]),
          np.asarray(policy.value_prior[...]))


def per_request(report: dict) -> dict[int, dict[str, list[dict]]]:
  """request index -> method -> its calls (the learned engine's log, both learned methods)."""
  from benchmarks import controllers as C
  methods, log = list(report["methods"]), report["call_logs"]["learned_default"]
  out, k = collections.defaultdict(lambda: collections.defaultdict(list)), 0
  for i in range(len(report["repeats_per_group"]["ar"])):
    for _ in range(report["repeats"]):
      for m in C.method_order(methods, i):
        if m in ("learned_default", "learned_fixed"):
          out[i][m].append(log[k])
          k += 1
  return out


def main(paths):
  reports = [json.load(open(p)) for p in paths]
  counts, sizes, lam, prior = policy_counts({k for r in reports for k in r["prompts"]})
  C = len(sizes)
  pooled = {m: [0.0, 0.0] for m in MARGINS}
  ran = [0.0, 0.0]
  moves = np.zeros(4, int)
  for path, report in zip(paths, reports):
    log, X, y = calls(report)
    ratio = whole_run_ratios(X, y)
    be8 = float(np.median([c["break_even"] for c in log if c["block_size"] == 8]))
    price_C = np.asarray([1.0 if b == 1 else be8 * ratio.get(b, np.nan) for b in sizes])
    gains, rows = [], []
    for i, per in per_request(report).items():
      d = min(per["learned_default"], key=lambda c: c["seconds"])
      f = min(c["seconds"] for c in per["learned_fixed"])
      b = d["block_size"]
      gain = np.inf
      if b != 8:
        c2 = lam * np.maximum(counts[report["prompts"][i]], 0) + (1 - lam) * prior
        cost = c2[:C] * price_C + c2[C:]
        gain = cost[sizes.index(8)] / cost[sizes.index(b)] - 1.0
        gains.append(gain)
      rows.append((d["seconds"], f, gain))
    g = np.nan_to_num(np.asarray(gains), nan=-1.0)
    row = np.asarray(rows)
    moves += [len(g), (g >= 0).sum(), (g >= 0.02).sum(), (g >= 0.05).sum()]
    ran[0] += row[:, 1].sum()
    ran[1] += row[:, 0].sum()
    line = []
    for m in MARGINS:
      held = np.where(row[:, 2] >= m, row[:, 0], row[:, 1])
      pooled[m][0] += row[:, 1].sum()
      pooled[m][1] += held.sum()
      line.append(f"{m:g}: {row[:, 1].sum() / held.sum():.4f}")
    print(f"{path}\n  moves off 8: {len(g)}, predicted cheaper than 8 at the run's prices: "
          f"{(g >= 0).sum()} (>= 2%: {(g >= 0.02).sum()}, >= 5%: {(g >= 0.05).sum()}); "
          f"b = 8 time / default time as run {row[:, 1].sum() / row[:, 0].sum():.4f}; with "
          f"moves under m held at 8: " + ", ".join(line))
  print(f"every report: moves {moves[0]}, predicted cheaper {moves[1]} (>= 2%: {moves[2]}, "
        f">= 5%: {moves[3]}); b = 8 time / default time as run {ran[0] / ran[1]:.4f}; held: "
        + ", ".join(f"{m:g}: {v[0] / v[1]:.4f}" for m, v in pooled.items()))


if __name__ == "__main__":
  main(sys.argv[1:])
