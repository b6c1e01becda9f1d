"""The suite's time limit (conftest.SUITE_LIMIT_S): a run that stops making progress fails with
every thread's stack instead of waiting for CI's own limit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_stuck_run_fails_at_the_suite_limit(tmp_path):
  (tmp_path / "test_stuck.py").write_text("import time\n\ndef test_stuck():\n  time.sleep(60)\n")
  # As a run started from a shell: run here by an xdist worker, the environment says so.
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env.update(BP_JAX_SUITE_LIMIT_S="6", PYTHONPATH=os.path.join(REPO, "tests"))
  t0 = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "conftest", "--rootdir",
       str(tmp_path), "-c", os.path.join(REPO, "pyproject.toml"), str(tmp_path / "test_stuck.py")],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  seconds = time.perf_counter() - t0
  assert proc.returncode != 0 and seconds < 50, (proc.returncode, seconds, proc.stdout)
  assert "Timeout (0:00:06)!" in proc.stderr, proc.stderr[-2000:]
