"""The rows of this folder as a markdown table: the shipped default (`learned_default`) against
our AR measured twice, from each report's every repeat of every group.

A batch row's report (`benchmarks.controllers --out`) holds each repeat of each group
(`repeats_per_group`: new tokens, decode seconds, requests that drafted, moved, wall seconds).
Per group this takes each method's fastest repeat (decode seconds per new token, as the report's
table does; end to end by wall seconds per new token) and gives the default's speedup over `ar`,
and over `ar` and `ar_twin` together (per group their mean seconds per new token: the two
identical AR engines differ by the run's luck alone; what `benchmarks.controllers` now reports
as `ar_both`), with 95% paired bootstrap intervals over the groups (bp_jax.eval.bootstrap, 2,000
resamples, seed 0: the report's own intervals over `ar` are the same), and `ar_twin` over `ar`;
then, from the report's own intervals, the default over b = 8 with the same controller in its
own engine (`priced_default`) and in the default's engine (`learned_fixed`), the fixed sizes
that ran.

    PYTHONPATH=. python docs/cpu_amx/repeats5_2026-12-07/table.py REPORT.json [...]
"""

from __future__ import annotations

import json
import sys

import numpy as np

from bp_jax.eval.bootstrap import bootstrap_speedup

DECODE, WALL = 1, 4  # columns of a repeat in `repeats_per_group`


def fastest(groups: list[list[list]], column: int) -> np.ndarray:
  """[G, 2] (new tokens, seconds) of each group's fastest repeat by seconds per new token."""
  return np.array([min(((r[0], r[column]) for r in g), key=lambda ts: ts[1] / max(ts[0], 1))
                   for g in groups], np.float64)


def speedup(a: np.ndarray, b: np.ndarray) -> str:
  s = bootstrap_speedup(a[:, 0], a[:, 1], b[:, 0], b[:, 1])
  return f"{s.ratio:.3f}x [{s.lo:.3f}, {s.hi:.3f}]"


def entry(c: dict) -> str:
  return f"{c['ratio']:.3f}x [{c['lo']:.3f}, {c['hi']:.3f}]"


def fixed_row(path: str) -> str:
  report = json.load(open(path))
  cells = [entry(report[table][f"learned_default/{fixed}"])
           for fixed in ("priced_default", "learned_fixed")
           for table in ("intervals", "intervals_end_to_end")]
  return (f"| B{report['batch_size']} T = {report['temperature']:g} | " + " | ".join(cells)
          + " |")


def row(path: str) -> str:
  report = json.load(open(path))
  groups = report["repeats_per_group"]
  cells = []
  for column in (DECODE, WALL):
    fig = {m: fastest(groups[m], column) for m in ("learned_default", "ar", "ar_twin")}
    ar, twin = fig["ar"], fig["ar_twin"]
    both = np.stack([ar[:, 0], ar[:, 0] * (ar[:, 1] / ar[:, 0] + twin[:, 1] / twin[:, 0]) / 2], 1)
    cells += [speedup(fig["learned_default"], ar), speedup(fig["learned_default"], both),
              speedup(twin, ar)]
  temperature = report["temperature"]
  drafted = sum(r[2] for g in groups["learned_default"] for r in g)
  decodes = report["repeats"] * len(report["prompts"])
  return (f"| B{report['batch_size']} T = {temperature:g} | {len(groups['ar'])} | "
          + " | ".join(cells) + f" | {drafted} of {decodes} |")


def main(paths: list[str]) -> None:
  print("| row | groups | default / AR, decode | default / both ARs, decode | ar_twin / ar, decode "
        "| default / AR, e2e | default / both ARs, e2e | ar_twin / ar, e2e | decodes drafted |")
  print("|" + "---|" * 9)
  for path in paths:
    print(row(path))
  print()
  print("| row | default / b = 8 own engine, decode | e2e | default / b = 8 same engine, decode "
        "| e2e |")
  print("|" + "---|" * 5)
  for path in paths:
    print(fixed_row(path))


if __name__ == "__main__":
  main(sys.argv[1:])
