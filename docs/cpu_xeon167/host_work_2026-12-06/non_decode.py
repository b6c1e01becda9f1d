"""Seconds outside the loop calls per method of a `benchmarks.controllers` run.

  python docs/cpu_xeon167/host_work_2026-12-06/non_decode.py OUT/controllers.json

Per group, the repeat with the fastest wall time per token (what the end-to-end intervals
compare): its wall time less its requests' decode seconds, summed over the groups; and the
same over every repeat, per run of the groups.
"""
import json
import sys


def main(path: str) -> None:
  per_group = json.load(open(path))["repeats_per_group"]
  for method, groups in per_group.items():
    # each repeat: [new tokens, decode s, drafted, moved, wall s]
    fastest = sum(min(reps, key=lambda r: r[4] / max(r[0], 1))[4]
                  - min(reps, key=lambda r: r[4] / max(r[0], 1))[1] for reps in groups)
    every = sum(r[4] - r[1] for reps in groups for r in reps)
    runs = sum(len(reps) for reps in groups) / len(groups)
    print(f"{method:16s} fastest repeats {fastest:.2f} s; every repeat {every / runs:.2f} s per run")


if __name__ == "__main__":
  main(sys.argv[1])
