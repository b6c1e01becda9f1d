"""Conversion between Hugging Face / z-lab checkpoints and bp_jax checkpoints (both ways)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from tqdm import tqdm

from bp_jax.weights import hf_mapping
from bp_jax.weights.checkpoint_io import (finish_partial_dir, load_checkpoint, make_partial_dir,
                                          move_into_place, read_checkpoint_meta,
                                          remove_stale_partials, save_checkpoint)
from bp_jax.models.config import DFlashConfig, Qwen3Config, is_dflash_dict, read_config_json
from bp_jax.models.dflash import refuse_last_layer_features, validate_drafter_for_target
from bp_jax.errors import BadInputError
from bp_jax.weights.loading import parse_dtype
from bp_jax.weights.safetensors_io import open_hf_checkpoint, write_hf_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model")


def _remove_leftovers(out_dir: str) -> None:
  """Removes temporary folders that interrupted earlier runs left beside `out_dir`."""
  removed = remove_stale_partials(out_dir)
  if removed:
    print(f"removed {len(removed)} leftover folder(s) of interrupted earlier runs beside "
          f"{out_dir}: {', '.join(removed)}")


def _tokenizer_files(folder: str) -> dict[str, str]:
  return {f: os.path.join(folder, f) for f in TOKENIZER_FILES
          if os.path.isfile(os.path.join(folder, f))}


def _prepare_tokenizer(tokenizer: str, hf_dir: str, scratch: str) -> dict[str, str]:
  """Files to copy: from `hf_dir` (default), a tokenizer folder, or the offline Qwen3 one."""
  if not tokenizer:
    return _tokenizer_files(hf_dir)
  if tokenizer == "qwen3-offline":
    from bp_jax.text.tokenizer import build_offline_qwen3_tokenizer
    build_offline_qwen3_tokenizer().save_pretrained(scratch)
    return _tokenizer_files(scratch)
  files = _tokenizer_files(tokenizer)
  if not files:
    raise BadInputError(f"--tokenizer={tokenizer}: no tokenizer files in that folder")
  return files


def convert_from_hf(hf_dir: str, out_dir: str, dtype: str | None = None, overwrite: bool = False,
                    tokenizer: str = "", target_dir: str | None = None,
                    show_progress: bool = True) -> str:
  """Converts a Qwen3 or z-lab DFlash checkpoint folder; returns the kind ('qwen3'/'dflash')."""
  if not os.path.isdir(hf_dir):
    raise BadInputError(f"--hf_dir={hf_dir}: no such directory")
  _remove_leftovers(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise BadInputError(f"--out_dir={out_dir} is not empty; pass --overwrite to replace it")
  cfg_path = os.path.join(hf_dir, "config.json")
  raw = read_config_json(cfg_path)
  dflash = is_dflash_dict(raw)
  cfg = DFlashConfig.from_hf_dict(raw, cfg_path) if dflash else Qwen3Config.from_hf_dict(raw, cfg_path)
  if dflash and target_dir:
    tcfg_raw, _ = read_checkpoint_meta(target_dir, expected_kind="qwen3")
    validate_drafter_for_target(cfg, Qwen3Config.from_hf_dict(tcfg_raw, target_dir), hf_dir)
  if dflash:  # num_target_layers equals the target's layer count once validated against it
    refuse_last_layer_features(cfg.target_layer_ids, cfg.num_target_layers,
                               f"{cfg_path}: target_layer_ids {list(cfg.target_layer_ids)}")
  with open_hf_checkpoint(hf_dir) as ckpt:
    np_dtype = np.dtype(parse_dtype(dtype, "--dtype") or ckpt.dtype(ckpt.keys()[0]))
    keys = set(ckpt.keys())
    build = hf_mapping.drafter_params_from_hf if dflash else hf_mapping.target_params_from_hf
    with tqdm(total=len(keys), desc=f"converting {os.path.basename(os.path.normpath(hf_dir))}",
              unit="tensor", disable=not show_progress) as bar:
      params = build(ckpt.get, ckpt.shape, keys, cfg, hf_dir, np_dtype,
                     progress=lambda key: bar.update(1))
      bar.update(len(keys) - bar.n)
  scratch = make_partial_dir(os.path.abspath(out_dir), "tok")
  try:
    extra = _prepare_tokenizer(tokenizer, hf_dir, scratch)
    kind = "dflash" if dflash else "qwen3"
    save_checkpoint(out_dir, params, cfg.to_hf_dict(),
                    {"kind": kind, "dtype": np_dtype.name, "source": os.path.abspath(hf_dir)},
                    extra_files=extra, overwrite=overwrite, compress=False)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  return kind


def export_to_hf(ckpt_dir: str, out_dir: str, overwrite: bool = False,
                 max_shard_bytes: int = 5 * 10**9, dtype: str | None = None) -> str:
  """Writes a bp_jax checkpoint in the Hugging Face / z-lab layout (atomically); `dtype`
  ('float32', 'bfloat16', 'float16'; None or 'auto' = as stored) casts every tensor."""
  _remove_leftovers(out_dir)
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise BadInputError(f"--out_dir={out_dir} is not empty; pass --overwrite to replace it")
  config, meta = read_checkpoint_meta(ckpt_dir)
  kind = meta.get("kind")
  if kind == "dflash":
    cfg = DFlashConfig.from_hf_dict(config, ckpt_dir)
    refuse_last_layer_features(cfg.target_layer_ids, cfg.num_target_layers,
                               f"{ckpt_dir}: target_layer_ids {list(cfg.target_layer_ids)}")
  elif kind == "qwen3":
    cfg = Qwen3Config.from_hf_dict(config, ckpt_dir)
  else:
    raise BadInputError(f"{ckpt_dir}: cannot export a checkpoint of kind {kind!r} to Hugging Face")
  params, _, _ = load_checkpoint(ckpt_dir, expected_kind=kind)
  to_hf = hf_mapping.drafter_params_to_hf if kind == "dflash" else hf_mapping.target_params_to_hf
  items = to_hf(params)
  cast = parse_dtype(dtype, "--dtype")
  stored = str(meta.get("dtype", "float32"))
  if cast is not None:
    np_dtype = np.dtype(cast)
    items = ((name, array.astype(np_dtype)) for name, array in items)
    stored = np_dtype.name
  out_abs = os.path.abspath(out_dir)
  tmp = make_partial_dir(out_abs, "tmp")
  try:
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = stored
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2)
    write_hf_checkpoint(tmp, items, max_shard_bytes=max_shard_bytes)
    for name, src in _tokenizer_files(ckpt_dir).items():
      shutil.copy2(src, os.path.join(tmp, name))
    finish_partial_dir(tmp)
    move_into_place(tmp, out_abs, replace_existing=os.path.exists(out_abs))
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return kind
