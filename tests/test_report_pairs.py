"""benchmarks/report_pairs.py: pairs a stored controllers report did not print, from the decodes
it kept, with the report's own selection (each group's fastest repeat) and bootstrap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.report_pairs import pair_speedups
from bp_jax.errors import BadInputError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = [os.path.join(REPO, "docs", "cpu_amx", row, "controllers.json")
           for row in ("b1_t0", "b8_t0", "b16_t1")]


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.split(os.sep)[-2])
def test_pairs_the_report_printed_read_the_same(path):
  with open(path) as f:
    report = json.load(f)
  printed = report["intervals"]
  got = pair_speedups(report, list(printed))
  for pair, want in printed.items():  # seconds stored to 10 µs: the ratios within 0.2%
    for key in ("ratio", "lo", "hi"):
      assert got[pair][key] == pytest.approx(want[key], rel=2e-3), (pair, key)


def test_bad_pairs_name_the_flag(tmp_path):
  with open(REPORTS[1]) as f:
    report = json.load(f)
  with pytest.raises(BadInputError, match="'nope' is not in the report"):
    pair_speedups(report, ["nope/ar"])
  with pytest.raises(BadInputError, match="not of the form a/b"):
    pair_speedups(report, ["priced_default"])
  (tmp_path / "old.json").write_text(json.dumps({"intervals": {}}))
  proc = subprocess.run([sys.executable, "-m", "benchmarks.report_pairs",
                         f"--report={tmp_path / 'old.json'}", "--pairs=a/b"],
                        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().startswith("report_pairs: error: --report=")
  assert "no repeats_per_group" in proc.stderr
