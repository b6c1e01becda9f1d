"""Records, for every full-cycle price the learned engine hands a loop or a start
(`Engine._cycle_price`), that price and the fit's own (float32 `OnlineCosts.break_even`) at that
moment, and prints how they differ by size and by whether the fit had timed 3 calls. Run at
0a759af it showed the routed size (8) repriced by its ratio to another length (0.39-2.2x its own
fitted price, 85 of its 90 calls once the fit priced), which the commit after it keeps at the
fit's own.

  # in a worktree of 0a759af (`Engine._cycle_price` is `_policy_cycle_price` after it):
  PYTHONPATH=. python docs/cpu_amx/repeats5_2026-12-07/start_prices.py --num_prompts 0 \
      --half eval --methods learned_default --precompile --repeats 1 --batch_size 1 \
      --temperature 1 --drafter demo/drafter_sampling --verify rejection --out DIR
"""
import collections
import numpy as np
from bp_jax.decoding import engine as E
from benchmarks import controllers as C
from bp_jax import cli

seen = collections.Counter(); diffs = []
orig = E.Engine._cycle_price
def rec(self, block_size, rows):
  new = orig(self, block_size, rows)
  old = float(np.float32(self.prices.break_even(block_size, rows)))
  seen[(block_size, rows)] += 1
  if abs(new - old) > 1e-6 * max(abs(old), 1):
    diffs.append((block_size, rows, round(old, 4), round(new, 4), self.prices._fit(rows).calls))
  return new
E.Engine._cycle_price = rec
def main(argv):
  C.main(argv)
  print("CHECK calls", dict(seen), "differing", len(diffs))
  by = collections.defaultdict(list)
  for b, r, old, new, calls in diffs:
    by[(b, calls >= 3)].append(new / old)
  for k, v in sorted(by.items()):
    print("CHECK", k, len(v), "new/old min %.3f median %.3f max %.3f" % (min(v), float(np.median(v)), max(v)))
  print("CHECK (8,1) late", [d for d in diffs if d[0] == 8 and d[4] >= 3][:15])
if __name__ == "__main__":
  cli.run(main, C.__doc__)
