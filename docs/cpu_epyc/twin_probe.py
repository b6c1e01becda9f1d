"""Three identical plain AR engines of the demo's target in one process, timed interleaved:
`a` and `b` with their own per-layer weight slices (as every engine builds them), `c` reading
`a`'s. Whether two identical engines' speed differs by where their weights lie (the batch-16
rows' identical AR engine read 0.979x and 1.059x our AR; docs/results/controller.md).

    PYTHONPATH=. python docs/cpu_epyc/twin_probe.py 16 30   # batch size, timed rounds

Prints the engines' median seconds per batch (16 random prompts of 20-59 tokens, 64 new
tokens each) and b / a, c / a with 95% bootstrap intervals over the rounds.
"""

import json
import sys
import time

import numpy as np

from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import BatchOptions, ShapeOptions
from bp_jax.weights.loading import load_target


def main(batch: int, rounds: int) -> None:
  target = decode_form(load_target("demo/target", "float32"))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(10, 4000, size=int(rng.integers(20, 60)))) for _ in range(batch)]
  build = lambda: Engine(target, stop_ids=[], batching=BatchOptions(batch_size=batch),
                         shapes=ShapeOptions(max_len=256, length_buckets=(64,)))
  engines = {"a": build(), "b": build(), "c": build()}
  engines["c"].t_weights = engines["a"].t_weights  # the same per-layer slices as `a`
  times = {k: [] for k in engines}
  for r in range(rounds + 1):  # round 0 warms up
    names = list(engines)
    for k in names[r % 3:] + names[:r % 3]:
      t0 = time.perf_counter()
      engines[k].generate_batch(prompts, max_new_tokens=64)
      if r:
        times[k].append(time.perf_counter() - t0)

  def ratio(x: str, y: str) -> tuple[float, list[float]]:
    tx, ty = np.asarray(times[x]), np.asarray(times[y])
    draws = np.random.default_rng(1).integers(0, len(tx), (2000, len(tx)))
    boot = [np.median(ty[i]) / np.median(tx[i]) for i in draws]
    return (round(float(np.median(ty) / np.median(tx)), 4),
            [round(float(np.percentile(boot, q)), 4) for q in (2.5, 97.5)])

  print(json.dumps({"batch": batch, "median_s": {k: round(float(np.median(v)), 4)
                                                 for k, v in times.items()},
                    "b/a (own weights)": ratio("a", "b"), "c/a (a's weights)": ratio("a", "c")}))


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
