"""The demo's text corpus (Python source) and the `tokenizer` and `lm_data` stages.

The corpus is every non-empty `*.py` file under a folder (by default this interpreter's standard
library), minus test folders and installed packages, in sorted order of relative path.
Files are split into train/val by id (`bp_jax.text.prompts.split_ids`), so no file is in both.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sysconfig
import time
import uuid
from typing import Any, Iterator, Sequence

import numpy as np

from bp_jax.errors import BadInputError
from bp_jax.text.prompts import Prompt, _read_python_source, split_ids
from bp_jax.train import workdir as wd

# Folder names skipped anywhere under the corpus root.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__"})
STAMP_FILE = "bp_jax_stage.json"
LM_TRAIN, LM_VAL = "lm_train", "lm_val"


def corpus_root(cfg: Any) -> str:
  """`cfg.corpus`, or this interpreter's standard library when empty."""
  root = cfg.get("corpus") or sysconfig.get_paths()["stdlib"]
  if not os.path.isdir(root):
    raise BadInputError(f"--config.corpus={root!r} is not an existing folder")
  return root


def python_sources(root: str, exclude_dirs: Sequence[str] = tuple(EXCLUDED_DIRS)) -> list[Prompt]:
  """The non-empty `*.py` files under `root` (id = relative path), skipping `exclude_dirs`."""
  excluded = set(exclude_dirs)
  rel_paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in excluded]
    for name in filenames:
      if name.endswith(".py"):
        rel_paths.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
  out = []
  for rel in sorted(rel_paths):
    text = _read_python_source(pathlib.Path(root, rel))
    if text.strip():
      out.append(Prompt(id=rel, text=text))
  if not out:
    raise BadInputError(f"corpus folder {root!r} holds no non-empty .py files")
  return out


def _read_stamp(folder: str) -> dict | None:
  try:
    with open(os.path.join(folder, STAMP_FILE), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _write_stamp(folder: str, stamp: dict) -> None:
  with open(os.path.join(folder, STAMP_FILE), "w", encoding="utf-8") as f:
    json.dump(stamp, f, indent=2, sort_keys=True)


def _same(stamp: dict | None, want: dict) -> bool:
  return stamp is not None and all(stamp.get(k) == v for k, v in want.items())


# ------------------------------------------------------------------------------ tokenizer stage


def tokenizer_stage(cfg: Any) -> None:
  """Trains the byte-level BPE (`cfg.bpe.vocab_size`) on the corpus into the workdir.

  Skipped when a tokenizer trained with the same settings is already there.
  """
  from bp_jax.text.bpe import train_bpe

  root = corpus_root(cfg)
  out = wd.tokenizer_dir(cfg)
  want = {"stage": "tokenizer", "corpus": os.path.abspath(root),
          "vocab_size": int(cfg.bpe.vocab_size)}
  if _same(_read_stamp(out), want) and os.path.isfile(os.path.join(out, wd.TOKENIZER_FILE)):
    print(f"[tokenizer] up to date: {out}")
    return
  t0 = time.perf_counter()
  docs = python_sources(root)
  tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
  try:
    tok = train_bpe((d.text for d in docs), int(cfg.bpe.vocab_size), tmp)
    _write_stamp(tmp, {**want, "num_files": len(docs), "actual_vocab_size": len(tok)})
    if os.path.exists(out):
      shutil.rmtree(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.rename(tmp, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  print(f"[tokenizer] {len(tok)} tokens trained on {len(docs)} files of {root} in "
        f"{time.perf_counter() - t0:.1f} s -> {out}")


# -------------------------------------------------------------------------------- lm_data stage


def encode_docs(tok: Any, docs: Sequence[Prompt], batch: int = 64) -> Iterator[np.ndarray]:
  """Token ids of each document (no special tokens), in order."""
  for start in range(0, len(docs), batch):
    texts = [d.text for d in docs[start:start + batch]]
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
      yield np.asarray(ids, dtype=np.int32)


def lm_data_stage(cfg: Any) -> None:
  """Tokenizes the corpus, packs each split into chunks of `cfg.lm.seq_len + 1` tokens
  (documents separated by <|endoftext|>) and writes datasets lm_train and lm_val.

  Skipped when both exist and were made with the same settings and tokenizer.
  """
  from bp_jax.data import chunk_records, dataset_exists, packed_lm_chunks, write_sequences
  from bp_jax.text.tokenizer import load_tokenizer

  tok_dir = wd.require_tokenizer(cfg, "lm_data")
  root = corpus_root(cfg)
  data = wd.data_dir(cfg)
  chunk_len = int(cfg.lm.seq_len) + 1
  val_frac = float(cfg.lm_data.val_frac)
  if not 0.0 < val_frac < 1.0:
    raise BadInputError(f"--config.lm_data.val_frac={val_frac} must lie in (0, 1)")
  want = {"stage": "lm_data", "corpus": os.path.abspath(root), "chunk_len": chunk_len,
          "val_frac": val_frac, "seed": int(cfg.seed),
          "tokenizer": _read_stamp(tok_dir) or {}}
  stamp_dir = os.path.join(data, "lm_data")
  if (_same(_read_stamp(stamp_dir), want) and dataset_exists(data, LM_TRAIN)
      and dataset_exists(data, LM_VAL)):
    print(f"[lm_data] up to date: {data}")
    return
  t0 = time.perf_counter()
  tok = load_tokenizer(tok_dir)
  eos = tok.convert_tokens_to_ids(tok.eos_token)
  docs = python_sources(root)
  parts = split_ids([d.id for d in docs], {"train": 1.0 - val_frac, "val": val_frac},
                    int(cfg.seed))
  counts = {}
  for split, name in (("train", LM_TRAIN), ("val", LM_VAL)):
    chosen = set(parts[split])
    split_docs = [d for d in docs if d.id in chosen]
    n_tokens = [0]

    def counted(it):
      for ids in it:
        n_tokens[0] += ids.size + 1
        yield ids

    chunks = packed_lm_chunks(counted(encode_docs(tok, split_docs)), chunk_len, eot_id=eos)
    try:
      ds = write_sequences(data, name, chunk_records(chunks, f"{split}-"),
                           description=f"{split} chunks of {chunk_len} tokens of {root}",
                           overwrite=True)
    except BadInputError as e:
      raise BadInputError(f"[lm_data] {split} split ({len(split_docs)} files): {e}; lower "
                          "--config.lm.seq_len or raise --config.lm_data.val_frac") from None
    counts[split] = {"files": len(split_docs), "tokens": n_tokens[0], "chunks": len(ds)}
  os.makedirs(stamp_dir, exist_ok=True)
  _write_stamp(stamp_dir, {**want, "counts": counts})
  print(f"[lm_data] train: {counts['train']['files']} files, {counts['train']['tokens']:,} "
        f"tokens, {counts['train']['chunks']} chunks; val: {counts['val']['files']} files, "
        f"{counts['val']['tokens']:,} tokens, {counts['val']['chunks']} chunks "
        f"({time.perf_counter() - t0:.1f} s) -> {data}")
