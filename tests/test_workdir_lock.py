"""train.py locks its workdir: a second run on the same workdir fails at once, naming the holder
(pid, host, stages, start time, command); the lock goes away with the process that held it."""

import json
import os
import signal
import socket
import subprocess
import sys

import ml_collections
import pytest

from bp_jax.errors import BadInputError
from bp_jax.train import stages
from bp_jax.train import workdir as wd
from configs import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Holds the lock of the workdir given as argv[1] until killed.
_HOLDER = """
import sys, time, ml_collections
from bp_jax.train.workdir import workdir_lock
cfg = ml_collections.ConfigDict({"workdir": sys.argv[1]})
with workdir_lock(cfg, "lm,draft", "python train.py --config.stage=lm,draft"):
  print("locked", flush=True)
  time.sleep(300)
"""


def _cfg(workdir, stage="tokenizer") -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({"workdir": str(workdir), "stage": stage})


@pytest.fixture
def holder(tmp_path):
  """A second process holding the lock of `tmp_path / 'work'`."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "work")], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "locked"
    yield proc
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait(timeout=30)
    proc.stdout.close()


def test_second_run_fails_naming_the_holder_and_runs_nothing(holder, tmp_path):
  cfg = _cfg(tmp_path / "work")
  with pytest.raises(BadInputError) as e:
    stages.run_stages(cfg)
  msg = str(e.value)
  assert "is in use by another train.py run" in msg and "\n" not in msg
  assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
  assert "stages lm,draft" in msg and "command: python train.py --config.stage=lm,draft" in msg
  assert "started 20" in msg  # an ISO date
  assert not os.path.exists(wd.tokenizer_dir(cfg))  # the tokenizer stage did not run


def test_lock_is_released_when_its_process_dies(holder, tmp_path):
  cfg = _cfg(tmp_path / "work")
  with pytest.raises(BadInputError, match="in use"):
    with wd.workdir_lock(cfg, "lm"):
      pass
  holder.send_signal(signal.SIGKILL)  # no cleanup code runs
  holder.wait(timeout=30)
  with wd.workdir_lock(cfg, "lm", "second") as path:
    with open(path) as f:
      info = json.load(f)
    assert info["pid"] == os.getpid() and info["command"] == "second"


def test_lock_is_exclusive_and_released_after_the_run(tmp_path):
  cfg = _cfg(tmp_path / "new_work")  # the workdir is created for its lock
  with wd.workdir_lock(cfg, "lm"):
    with pytest.raises(BadInputError, match=f"pid {os.getpid()} on host"):
      with wd.workdir_lock(cfg, "draft"):
        pass
  with wd.workdir_lock(cfg, "draft"):
    pass
  # A failing run releases the lock too.
  failing = demo.get_config()
  failing.workdir, failing.stage = cfg.workdir, "lm"
  with pytest.raises(BadInputError, match="run the 'tokenizer' stage first"):
    stages.run_stages(failing)
  with wd.workdir_lock(cfg, "lm"):
    pass


def test_train_cli_refuses_a_locked_workdir(run_cli, tmp_path):
  cfg = _cfg(tmp_path)
  with wd.workdir_lock(cfg, "lm,draft", "the other run"):
    result = run_cli("train.py", "--config.stage=tokenizer", f"--config.workdir={tmp_path}")
  line = result.error_line("train.py")
  assert "is in use by another train.py run" in line and f"pid {os.getpid()}" in line
  assert "command: the other run" in line
  assert not os.path.exists(wd.tokenizer_dir(cfg))
