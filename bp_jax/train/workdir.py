"""Where each training stage keeps its outputs under `cfg.workdir`, and clear errors when a
stage's input is missing (naming the stage that makes it).

  <workdir>/tokenizer/   BPE tokenizer files                       (stage tokenizer)
  <workdir>/data/        TFDS datasets lm_train, lm_val, ...       (stage lm_data, regenerate)
  <workdir>/lm/          LM training run: checkpoints, metrics     (stage lm)
  <workdir>/target/      the trained target, a converted checkpoint (stage lm)
  <workdir>/draft/       drafter training run                      (stage draft)
  <workdir>/drafter/     the trained drafter, a converted checkpoint (stage draft)

Final checkpoints are also copied to `<export_dir>/<name>` (the shipped demo) by
`ship_checkpoint`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from bp_jax.errors import BadInputError

TOKENIZER_FILE = "tokenizer.json"


def _root(cfg: Any) -> str:
  if not cfg.workdir:
    raise BadInputError("--config.workdir is empty: give a folder for the training outputs")
  return os.fspath(cfg.workdir)


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
