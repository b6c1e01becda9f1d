"""Paired default-vs-reference latency ratio from arrivals json files of the same traces."""
import json, sys
from benchmarks import controllers
def load(path, method):
  d = json.load(open(path))
  return {L: ld["methods"][method]["latencies_s"] for L, ld in d["loads"].items()}
from absl import flags
flags.FLAGS(sys.argv[:1])
a_path, a_m, b_path, b_m = sys.argv[1:5]
A, Bm = load(a_path, a_m), load(b_path, b_m)
for L in [k for k in A if k in Bm]:
  ones = [1] * len(A[L])
  e = controllers.speedup_entry((ones, A[L]), (ones, Bm[L]))
  print(f"load {L}: {b_m} mean / {a_m} mean = {e}")
