"""Batch-1 rows: the learned default's requests against b = 8 decoded in the same engine, by the
size the learned request ran at.

  python docs/cpu_xeon167/matrix_2026-12-06/pairs.py docs/cpu_xeon167/matrix_2026-12-06/b1_t0.json

At batch 1 every method makes one loop call per request, so the run's calls sorted by their end
time fall into one run of calls per (request, repeat), one per method (learned_default and
learned_fixed share an engine: two calls in its log). Per request it prints, by the learned
request's size, the learned call's seconds over the fixed call's; where both ran b = 8 (the two
calls then do the same work) the first call's over the second's: the order's own effect.
"""
import collections
import json
import sys

import numpy as np


def main(path: str) -> None:
  run = json.load(open(path))
  calls = sorted((c["end_s"], engine, c["block_size"], c["seconds"])
                 for engine, log in run["call_logs"].items() for c in log)
  n = len(run["methods"])
  if len(calls) % n:
    raise SystemExit(f"{path}: {len(calls)} calls is not one per method and request "
                     "(a batch-1 run of the learned default and learned_fixed?)")
  ratios = collections.defaultdict(list)
  for i in range(0, len(calls), n):
    shared = [c for c in calls[i:i + n] if c[1] == "learned_default"]
    if len(shared) != 2:
      raise SystemExit(f"{path}: request {i // n}: {len(shared)} calls of the shared engine")
    other = [c for c in shared if c[2] != 8]
    if not other:  # both at 8: the first call over the second
      ratios["both 8 (first / second)"].append(shared[0][3] / shared[1][3])
    elif len(other) == 1 and other[0][2] != 1:
      fixed = shared[0] if shared[1] is other[0] else shared[1]
      ratios[f"learned {other[0][2]}"].append(other[0][3] / fixed[3])
    else:  # one or both routed plain (size 1): which call is which is not told apart
      ratios["a plain route"].append(shared[0][3] / shared[1][3])
  for key, values in sorted(ratios.items()):
    v = np.asarray(values)
    print(f"{key:28s} {len(v):4d} requests x repeats: mean {v.mean():.3f}, "
          f"median {np.median(v):.3f}")


if __name__ == "__main__":
  main(sys.argv[1])
