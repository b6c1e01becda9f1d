r"""Speedups of method pairs a stored `benchmarks.controllers` report did not print, from the
decodes it kept: each group's fastest repeat (`repeats_per_group`: new tokens and seconds per
group and repeat), with the same 95% paired bootstrap over the groups (over the requests at
batch 1) as the report's own intervals. Example (the default against an identical AR engine
and against the back-off loop, issue 19's rows on a second CPU):

  python -m benchmarks.report_pairs --report docs/cpu_amx/b8_t0/controllers.json \
    --pairs priced_default/ar_twin,priced_default/backoff

The report's seconds are rounded to 10 µs, so a pair it printed reads here within ~0.1%.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import flags

from bp_jax import cli
from bp_jax.errors import BadInputError
from bp_jax.eval.bootstrap import speedup_entry

flags.DEFINE_string("report", "", "controllers.json written by benchmarks.controllers --out")
flags.DEFINE_list("pairs", [], "a/b method pairs, each a's speedup over b")
flags.DEFINE_integer("bootstrap_reps", 2000, "bootstrap resamples of the intervals")
FLAGS = flags.FLAGS


def fastest_per_group(report: dict, method: str) -> tuple[np.ndarray, np.ndarray]:
  """(new tokens, seconds) of each group's fastest repeat of `method`."""
  groups = report["repeats_per_group"].get(method)
  if groups is None:
    raise BadInputError(f"--pairs: method {method!r} is not in the report (it ran "
                        f"{sorted(report['repeats_per_group'])})")
  best = [min(reps, key=lambda rep: rep[1]) for reps in groups]
  return (np.array([rep[0] for rep in best], np.float64),
          np.array([rep[1] for rep in best], np.float64))


def pair_speedups(report: dict, pairs: list[str], reps: int = 2000) -> dict[str, dict]:
  """{"a/b": {"ratio", "lo", "hi"}} for each pair (no interval from one group)."""
  out = {}
  for pair in pairs:
    names = pair.split("/")
    if len(names) != 2 or not all(names):
      raise BadInputError(f"--pairs: {pair!r} is not of the form a/b")
    a, b = (fastest_per_group(report, m) for m in names)
    out[pair] = speedup_entry(*a, *b, reps=reps)
  return out


def main(_):
  try:
    report_pairs()
  except BadInputError as e:
    sys.exit(f"report_pairs: error: {e}")


def report_pairs() -> None:
  """Reads --report and prints --pairs (module doc)."""
  if not FLAGS.report or not FLAGS.pairs:
    raise BadInputError("give --report (a controllers.json) and --pairs (a/b,...)")
  try:
    with open(FLAGS.report) as f:
      report = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise BadInputError(f"--report={FLAGS.report!r}: cannot read it as JSON ({e})") from None
  if "repeats_per_group" not in report:
    raise BadInputError(f"--report={FLAGS.report!r}: no repeats_per_group (not a report of "
                        "benchmarks.controllers, or one older than that field)")
  speedups = pair_speedups(report, FLAGS.pairs, FLAGS.bootstrap_reps)
  print(f"  {report.get('intervals_over', '')}, fastest repeat of each group")
  for pair, s in speedups.items():
    band = "" if s["lo"] is None else f" [{s['lo']:.3f}, {s['hi']:.3f}]"
    print(f"    {pair:32s} {s['ratio']:.3f}x{band}")


if __name__ == "__main__":
  cli.run(main, __doc__)
