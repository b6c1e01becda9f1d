"""benchmarks/controllers.py on the demo at a tiny size: the comparison issue 19's figures come
from cannot rot. At T = 1 (the sampling drafter, verify exact) every method gives AR's tokens
for each prompt's seed, here 3 prompts streamed through 2 slots (prompt i sampled with seed i,
whichever slot and batch-mates it gets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sampled_comparison_gives_ar_tokens_for_each_seed(tmp_path):
  out = tmp_path / "bench"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.controllers", "--num_prompts=3", "--repeats=2",
       "--max_new_tokens=12", "--methods=priced_online", "--half=eval",
       "--temperature=1", "--top_k=20", "--drafter=demo/drafter_sampling",
       "--batch_size=2", f"--cost_cache={tmp_path / 'costs'}", "--bootstrap_reps=50",
       f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "3 HumanEval eval-half prompts, T=1, top_k 20, verify exact" in proc.stdout
  report = json.loads((out / "controllers.json").read_text())
  assert (report["temperature"], report["top_k"], report["verify"]) == (1.0, 20, "exact")
  assert report["drafter"] == "demo/drafter_sampling" and report["batch_size"] == 2
  assert report["group_size"] == 8 and "batch 2 (groups of 8 streamed)" in proc.stdout
  assert set(report["methods"]) == {"ar", "priced_online"}
  for name, row in report["methods"].items():
    assert row["identical_to_ar"] == 3, name  # AR's tokens for each prompt's seed
    assert row["new_tokens"] > 2
  assert report["methods"]["priced_online"]["drafter_passes"] > 0
  assert set(report["intervals"]) == {"priced_online/ar"}
  # A batch's requests share their group's loop calls: the interval resamples groups, and one
  # group gives a ratio without one.
  assert report["intervals_over"] == "1 group of up to 8 requests"
  assert report["intervals"]["priced_online/ar"]["lo"] is None
  assert "(one unit: no interval)" in proc.stdout
  # and the mean of the repeats beside the fastest of each
  assert set(report["intervals_mean_of_repeats"]) == {"priced_online/ar"}
  assert "(mean of the repeats)" in proc.stdout
  assert report["cost_estimates"]["priced_online"]["by_batch_size"]["2"]["calls"] >= 1
  # priced_online has no start rule: every request of every repeat drafted
  assert report["drafted_every_repeat"] == {"priced_online": 3 * report["repeats"]}
