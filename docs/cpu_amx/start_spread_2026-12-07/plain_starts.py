"""Where a batch-1 benchmark's `learned_fixed` (b = 8 in the learned default's engine) started
requests plain, against how much b = 8 in its own engine (`priced_default`) sped those prompts
up, and how a prompt's speed-up relates to its neighbours' (the evaluation half's order).

    PYTHONPATH=. python docs/cpu_amx/start_spread_2026-12-07/plain_starts.py REPORT.json [...]

Per report: the (prompt, repeat) decodes `learned_fixed` started plain (no cycle), b = 8's
speed over AR on those and on all (medians, same repeat), the time those plain starts cost
against b = 8, and the lag-1..3 autocorrelation of log(AR time / b = 8 time) per prompt
(fastest of the repeats).
"""
import json
import sys

import numpy as np


def main(paths: list[str]) -> None:
  for path in paths:
    runs = json.load(open(path))["repeats_per_group"]
    field = lambda m, i: np.array([[r[i] for r in g] for g in runs[m]], float)
    ar, b8, fixed = (field(m, 1) for m in ("ar", "priced_default", "learned_fixed"))
    plain = field("learned_fixed", 2) == 0  # no cycle run: a plain start
    speed = ar / b8
    best = np.log(ar.min(1) / b8.min(1))
    lags = [np.corrcoef(best[:-k], best[k:])[0, 1] for k in (1, 2, 3)]
    print(f"{path}\n  learned_fixed plain starts {int(plain.sum())} of {plain.size}; b = 8 / AR "
          f"speed there median {np.median(speed[plain]) if plain.any() else float('nan'):.2f}x, "
          f"over all {np.median(speed):.2f}x; b = 8 faster than AR on "
          f"{int((speed[plain] > 1).sum())} of them\n  their time against b = 8: "
          f"{(fixed - b8)[plain].sum():+.2f} s of learned_fixed's {fixed.sum():.2f} s\n"
          f"  per-prompt log speed-up: sd {best.std():.2f}, lag-1..3 autocorrelation "
          + " ".join(f"{x:+.2f}" for x in lags))


if __name__ == "__main__":
  main(sys.argv[1:])
