"""Batch 1: how well the learned default's prices of its block sizes tell the sizes apart.

For each `benchmarks.controllers` report given (its learned engine's call log: both learned
methods' loop calls, in order), the whole run's ratio of each verify length's cycle to a b = 8
cycle (a least-squares fit of every call's seconds to its forward counts, relative to the call's
time, iteratively reweighted against stalls: the reference), then the calls replayed through
`OnlineCosts`: before each call of a size other than 8, once that size ran in
`SIZE_PRICE_CALLS` calls, its price over 8's by the rule in effect (`size_prices`) and by the
fit's own break-evens (the rule before 030dd01), as log errors against the reference.

  PYTHONPATH=. python docs/cpu_amx/size_prices_2026-12-07/replay.py REPORT.json [...]
"""
import json
import sys

import numpy as np

from bp_jax.decoding.online_costs import SIZE_PRICE_CALLS, OnlineCosts


def calls(report: dict) -> tuple[list[dict], np.ndarray, np.ndarray]:
  """(the learned engine's call log, [calls, 12] forward counts, [calls] seconds)."""
  log = report["call_logs"]["learned_default"]
  X = np.zeros((len(log), 12))
  for i, c in enumerate(log):
    X[i, :len(c["forwards_N"])] = c["forwards_N"]
  return log, X, np.asarray([c["seconds"] for c in log])


def whole_run_ratios(X: np.ndarray, y: np.ndarray) -> dict[int, float]:
  """verify length -> its cycle's seconds over a b = 8 cycle's (0: an AR step), every call."""
  used = [0] + [n for n in range(6, X.shape[1]) if X[:, n].any()]
  A, w = X[:, used], np.ones(len(y))
  for _ in range(10):
    theta = np.linalg.lstsq(A * (w / y)[:, None], w, rcond=None)[0]
    residual = (y - A @ theta) / y
    spread = 1.5 * np.median(np.abs(residual)) + 1e-9
    w = np.minimum(1.0, 2 * spread / np.maximum(np.abs(residual), 1e-9))
  return {n: float(t / theta[used.index(8)]) for n, t in zip(used, theta)}


def replay(log: list[dict], truth: dict[int, float]) -> dict[int, np.ndarray]:
  """size -> [calls, 2] log errors (size_prices' ratio, the fit's own) before each of its calls."""
  est = OnlineCosts(lambda n: 1.0 + 0.35 * n, one_prior_floor=0.5, by_prior=(1,))
  errors: dict[int, list] = {}
  for c in log:
    n = c["block_size"]
    if n != 8 and n in truth and est._fit(1).calls_with.get(n, 0) >= SIZE_PRICE_CALLS:
      p8, pn = est.size_prices([8, n], 1)
      own = est.break_even(n, 1) / est.break_even(8, 1)
      errors.setdefault(n, []).append((np.log(pn / p8 / truth[n]), np.log(own / truth[n])))
    est.observe(c["seconds"], c["forwards_N"], 1)
  return {n: np.asarray(e) for n, e in errors.items()}


def main(paths):
  pooled: dict[int, list] = {}
  for path in paths:
    log, X, y = calls(json.load(open(path)))
    truth = whole_run_ratios(X, y)
    print(path)
    print("  whole run, a cycle over b = 8's: " +
          " ".join(f"{n}: {r:.2f}" for n, r in sorted(truth.items()) if n))
    for n, e in sorted(replay(log, truth).items()):
      pooled.setdefault(n, []).append(e)
      print(f"  size {n:2d}, {len(e):2d} calls: |log error| median size_prices "
            f"{np.median(np.abs(e[:, 0])):.3f} ({np.median(e[:, 0]):+.3f}), the fit's own "
            f"{np.median(np.abs(e[:, 1])):.3f} ({np.median(e[:, 1]):+.3f})")
  print("every report: median |log error| (size_prices, the fit's own)")
  for n, parts in sorted(pooled.items()):
    e = np.concatenate(parts)
    print(f"  size {n:2d}, {len(e):3d} calls: {np.median(np.abs(e[:, 0])):.3f}, "
          f"{np.median(np.abs(e[:, 1])):.3f}")


if __name__ == "__main__":
  main(sys.argv[1:])
