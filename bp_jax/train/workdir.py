"""Where each training stage keeps its outputs under `cfg.workdir`, and clear errors when a
stage's input is missing (naming the stage that makes it).

  <workdir>/tokenizer/   BPE tokenizer files                       (stage tokenizer)
  <workdir>/data/        TFDS datasets lm_train, lm_val, ...       (stage lm_data, regenerate)
  <workdir>/lm/          LM training run: checkpoints, metrics     (stage lm)
  <workdir>/target/      the trained target, a converted checkpoint (stage lm)
  <workdir>/draft/       drafter training run                      (stage draft)
  <workdir>/drafter/     the trained drafter, a converted checkpoint (stage draft)

Final checkpoints are also copied to `<export_dir>/<name>` (the shipped demo) by
`ship_checkpoint`. A train.py run holds `<workdir>/.lock` (`workdir_lock`): a second run on the
same workdir fails at once, naming the run that holds it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import shutil
import socket
import uuid
from typing import Any, Iterator

from bp_jax.errors import BadInputError

TOKENIZER_FILE = "tokenizer.json"


def _root(cfg: Any) -> str:
  if not cfg.workdir:
    raise BadInputError("--config.workdir is empty: give a folder for the training outputs")
  return os.fspath(cfg.workdir)


LOCK_FILE = ".lock"


def _lock_holder(fd: int) -> str:
  """What the lock file open at `fd` says about the run holding it."""
  os.lseek(fd, 0, os.SEEK_SET)
  try:
    info = json.loads(os.read(fd, 1 << 16).decode("utf-8"))
    return (f"pid {info['pid']} on host {info['host']}, stages {info['stages']}, started "
            f"{info['started']}; command: {info['command']}")
  except (ValueError, KeyError, TypeError):
    return "a run that has not written its details yet"


def _write_holder(fd: int, what: str, command: str) -> None:
  started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  info = {"pid": os.getpid(), "host": socket.gethostname(), "stages": what,
          "started": started, "command": command}
  os.ftruncate(fd, 0)
  os.lseek(fd, 0, os.SEEK_SET)
  os.write(fd, (json.dumps(info) + "\n").encode("utf-8"))


@contextlib.contextmanager
def workdir_lock(cfg: Any, what: str, command: str = "") -> Iterator[str]:
  """Holds an exclusive lock on the workdir (`flock` on `<workdir>/.lock`, released when the
  process ends, however it ends) and records who holds it; yields the lock file's path.

  Raises:
    BadInputError: another process holds the lock (naming its pid, host, stages, start time
      and command).
  """
  root = _root(cfg)
  os.makedirs(root, exist_ok=True)
  path = os.path.join(root, LOCK_FILE)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise BadInputError(f"--config.workdir={root} is in use by another train.py run "
                          f"({_lock_holder(fd)}): wait for it to finish or give another "
                          f"--config.workdir") from None
    _write_holder(fd, what, command)
    yield path
  finally:
    os.close(fd)  # closing the only descriptor releases the lock


def tokenizer_dir(cfg: Any) -> str:
  return os.path.join(_root(cfg), "tokenizer")


def data_dir(cfg: Any) -> str:
  return os.path.join(_root(cfg), "data")


def run_dir(cfg: Any, stage: str) -> str:
  """The training-run folder of a stage (checkpoints, metrics.jsonl, loss.png)."""
  return os.path.join(_root(cfg), stage)


def target_dir(cfg: Any) -> str:
  return os.path.join(_root(cfg), "target")


def drafter_dir(cfg: Any) -> str:
  return os.path.join(_root(cfg), "drafter")


def require_tokenizer(cfg: Any, stage: str) -> str:
  """The tokenizer folder, or an error telling `stage` to run the tokenizer stage first."""
  path = tokenizer_dir(cfg)
  if not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
    raise BadInputError(f"stage {stage!r} needs the tokenizer in {path}, which does not exist: "
                        "run the 'tokenizer' stage first (--config.stage=tokenizer)")
  return path


def require_dataset(cfg: Any, name: str, stage: str, made_by: str):
  """Opens dataset `name` of the workdir, or errors naming the stage `made_by` that writes it."""
  from bp_jax.data import dataset_exists, open_dataset

  path = data_dir(cfg)
  if not os.path.isdir(path) or not dataset_exists(path, name):
    raise BadInputError(f"stage {stage!r} needs dataset {name!r} in {path}, which does not "
                        f"exist: run the {made_by!r} stage first (--config.stage={made_by})")
  return open_dataset(path, name)


def require_checkpoint(path: str, kind: str, stage: str, made_by: str) -> str:
  """Checks that a complete converted checkpoint of `kind` is at `path`."""
  from bp_jax.weights.checkpoint_io import COMPLETE_FILE, read_checkpoint_meta

  if not os.path.isfile(os.path.join(path, COMPLETE_FILE)):
    raise BadInputError(f"stage {stage!r} needs the {kind} checkpoint {path}, which does not "
                        f"exist or is incomplete: run the {made_by!r} stage first "
                        f"(--config.stage={made_by})")
  read_checkpoint_meta(path, expected_kind=kind)
  return path


def ship_checkpoint(cfg: Any, ckpt_dir: str, name: str) -> str | None:
  """Copies a converted checkpoint folder to `<cfg.export_dir>/<name>` atomically.

  An existing folder there is replaced only when it holds a bp_jax checkpoint. Returns the
  destination, or None when `cfg.export_dir` is empty.
  """
  if not cfg.get("export_dir"):
    return None
  dst = os.path.abspath(os.path.join(os.fspath(cfg.export_dir), name))
  if os.path.abspath(ckpt_dir) == dst:
    return dst
  if os.path.exists(dst) and os.listdir(dst) and not os.path.exists(
      os.path.join(dst, "bp_jax.json")):
    raise BadInputError(f"--config.export_dir: {dst} exists and does not hold a bp_jax "
                        "checkpoint; refusing to replace it")
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  tag = uuid.uuid4().hex[:8]
  tmp, old = f"{dst}.tmp-{tag}", f"{dst}.old-{tag}"
  shutil.copytree(ckpt_dir, tmp)
  try:
    if os.path.exists(dst):
      os.rename(dst, old)
    os.rename(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.exists(old) and not os.path.exists(dst):
      os.rename(old, dst)
    raise
  shutil.rmtree(old, ignore_errors=True)
  return dst


def folder_nbytes(path: str) -> int:
  """Total size of the files under `path`."""
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
