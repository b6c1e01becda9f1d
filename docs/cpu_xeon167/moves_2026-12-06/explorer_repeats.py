"""The repeats of each group in which a method drafted (explorer runs, cold batches), from a
benchmarks/controllers.py report: per such repeat (group, requests that drafted, requests that
moved to the plain bucket, decode seconds, wall seconds, wall / AR's fastest wall of that group),
and the median wall / AR's fastest over the repeats in which nothing drafted.

  python docs/cpu_xeon167/moves_2026-12-06/explorer_repeats.py docs/cpu_xeon167/moves_2026-12-06/b8_t0_v2.json
"""

import json
import statistics
import sys


def main(path: str) -> None:
  report = json.load(open(path))
  # method -> group -> repeat -> [tokens, decode_s, drafted, moved, wall]
  per_group = report["repeats_per_group"]
  ar_best = [min(r[4] for r in reps) for reps in per_group["ar"]]
  for method, groups in per_group.items():
    if method.startswith("ar"):
      continue
    drafting, clean = [], []
    for g, reps in enumerate(groups):
      for _, decode_s, drafted, moved, wall in reps:
        if drafted:
          drafting.append((g, drafted, moved, decode_s, wall, round(wall / ar_best[g], 3)))
        else:
          clean.append(wall / ar_best[g])
    print(method)
    for row in drafting:
      print("  group %d: %d drafted, %d moved, decode %.3f s, wall %.3f s, %.3fx AR's fastest"
            % row)
    if clean:
      print("  %d clean repeats: median %.3fx AR's fastest" % (len(clean),
                                                              statistics.median(clean)))


if __name__ == "__main__":
  main(sys.argv[1])
