"""The suite's time limit (conftest.py, BP_JAX_SUITE_LIMIT_S): a run that stops making progress
fails with the controlling process's stacks instead of waiting for CI's own limit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pytest(tmp_path, test_body: str, limit: str, workers: int) -> subprocess.CompletedProcess:
  """pytest over one test file with `test_body`, under the suite's conftest.py and settings,
  started as from a shell (run here by an xdist worker, the environment says so)."""
  (tmp_path / "test_one.py").write_text(f"import time\n\ndef test_one():\n  {test_body}\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env.update(BP_JAX_SUITE_LIMIT_S=limit, PYTHONPATH=os.path.join(REPO, "tests"))
  args = [sys.executable, "-m", "pytest", "-q", "-n", str(workers), "-p", "conftest",
          "--rootdir", str(tmp_path), "-c", os.path.join(REPO, "pyproject.toml"),
          str(tmp_path / "test_one.py")]
  # Its output goes to files, not pipes: a worker the stopped run leaves behind holds its
  # copies of them open while it sleeps on; the run is over when the controlling process exits,
  # and its whole session (that worker too) is killed then.
  out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
  with open(out, "w") as fo, open(err, "w") as fe:
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=fo, stderr=fe,
                            start_new_session=True)
    try:
      proc.wait(timeout=120)
    finally:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text())


def test_a_stuck_run_fails_at_the_suite_limit(tmp_path):
  t0 = time.perf_counter()
  proc = _pytest(tmp_path, "time.sleep(60)", "3", workers=1)
  seconds = time.perf_counter() - t0
  assert proc.returncode != 0 and seconds < 50, (proc.returncode, seconds, proc.stdout)
  assert "Timeout (0:00:03)!" in proc.stderr, proc.stderr[-2000:]


def test_a_limit_that_is_no_number_is_refused(tmp_path):
  proc = _pytest(tmp_path, "pass", "ten", workers=0)
  assert proc.returncode != 0
  assert "BP_JAX_SUITE_LIMIT_S='ten': expected seconds (0: no limit)" in proc.stderr, proc.stderr
