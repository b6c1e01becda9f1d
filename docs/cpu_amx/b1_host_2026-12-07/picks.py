"""Batch 1: the learned default against b = 8 in the same engine (`learned_fixed`), request by
request, from a `benchmarks.controllers` report with both methods: each request's fastest loop
call of each (its decode), grouped by the size the default's fastest decode used, and over every
repeat the calls where the default picked 8 (the same size: the same program, the same engine).

  PYTHONPATH=. python docs/cpu_amx/b1_host_2026-12-07/picks.py REPORT.json [...]
"""
import collections
import json
import sys

import numpy as np

from benchmarks import controllers as C


def calls_by_request(report: dict) -> dict:
  """request -> method -> [(block size, seconds, forwards)] of each repeat, from the learned
  engine's call log (both methods' calls, in the order the benchmark ran them)."""
  methods = list(report["methods"])
  log = report["call_logs"]["learned_default"]
  out, k = collections.defaultdict(lambda: collections.defaultdict(list)), 0
  for i in range(len(report["repeats_per_group"]["ar"])):
    for _ in range(report["repeats"]):
      for m in C.method_order(methods, i):
        if m in ("learned_default", "learned_fixed"):
          c = log[k]
          k += 1
          out[i][m].append((c["block_size"], c["seconds"], sum(c["forwards_N"])))
  if k != len(log):
    raise SystemExit(f"{k} calls placed of {len(log)}: a report with warm-up groups or batches")
  return out


def main(paths):
  for path in paths:
    calls = calls_by_request(json.load(open(path)))
    by_pick = collections.defaultdict(list)
    same = []
    for per in calls.values():
      fastest = lambda m: min(per[m], key=lambda t: t[1])
      by_pick[fastest("learned_default")[0]].append((fastest("learned_default")[1],
                                                     fastest("learned_fixed")[1]))
      same += [(a[1], a[2], b[1], b[2]) for a, b in zip(per["learned_default"],
                                                        per["learned_fixed"]) if a[0] == 8]
    print(path)
    allp = np.array([t for v in by_pick.values() for t in v])
    print(f"  fastest decodes, every request: b = 8 time / default time "
          f"{allp[:, 1].sum() / allp[:, 0].sum():.4f} ({len(allp)} requests)")
    for b in sorted(by_pick):
      a = np.array(by_pick[b])
      print(f"    default's size {b:2d}: {len(a):2d} requests, {a[:, 1].sum() / a[:, 0].sum():.4f},"
            f" {1e3 * (a[:, 1] - a[:, 0]).sum():+7.1f} ms saved by the default")
    s = np.array(same)
    print(f"  every repeat, the default's calls at size 8 against b = 8's of the same request: "
          f"{len(s)} pairs, forwards {s[:, 1].mean():.1f} / {s[:, 3].mean():.1f}, ms per forward "
          f"{1e3 * s[:, 0].sum() / s[:, 1].sum():.4f} / {1e3 * s[:, 2].sum() / s[:, 3].sum():.4f}, "
          f"b = 8 time / default time {s[:, 2].sum() / s[:, 0].sum():.4f}")


if __name__ == "__main__":
  main(sys.argv[1:])
