"""Converted bp_jax checkpoint folders: save atomically, load with clear errors.

Layout of a checkpoint folder:

  <dir>/config.json   the model config dict (Hugging Face style)
  <dir>/bp_jax.json   metadata: {"format": "bp_jax", "kind": "qwen3" | "dflash", "dtype": ...}
  <dir>/params/       an orbax checkpoint of a nested dict of arrays
  <dir>/...           extra files copied in by the caller (tokenizer files)
  <dir>/COMPLETE      written last; a folder without it is incomplete

`save_checkpoint` writes everything into a sibling temporary folder and renames it into place
only at the very end, so an interruption never leaves a folder that looks complete. Temporary
folders are named `<dir>.<role>-<pid>-<hex8>` and hold a `.bp_jax-partial` marker until they
are renamed into place; `remove_stale_partials` deletes those whose process is gone.
Parameters are stored as host numpy arrays (no sharding metadata), so a checkpoint written on
one platform restores on any other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import uuid
from typing import Any, Iterator, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from bp_jax.errors import BadInputError

FORMAT = "bp_jax"
CONFIG_FILE = "config.json"
META_FILE = "bp_jax.json"
PARAMS_DIR = "params"
COMPLETE_FILE = "COMPLETE"
PARTIAL_MARKER = ".bp_jax-partial"  # inside a temporary folder until it is renamed into place
KNOWN_KINDS = ("qwen3", "dflash", "policy")
_RESERVED = (CONFIG_FILE, META_FILE, PARAMS_DIR, COMPLETE_FILE, PARTIAL_MARKER)

KeyPath = tuple[str, ...]


# ------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
  """Hides orbax's INFO chatter (dozens of lines per save under absl's INFO verbosity).

  Orbax logs through absl, i.e. the Python logger "absl"; raise it to WARNING for the call.
  """
  logger = logging.getLogger("absl")
  old = logger.level
  if logger.getEffectiveLevel() < logging.WARNING:
    logger.setLevel(logging.WARNING)
  try:
    yield
  finally:
    logger.setLevel(old)


def _path_str(path: KeyPath) -> str:
  return "/".join(path) if path else "<root>"


def _flatten(tree: Any, what: str, path: KeyPath = ()) -> dict[KeyPath, Any]:
  """Flattens a nested dict into {key path: leaf}; empty sub-dicts map to an empty dict."""
  if isinstance(tree, Mapping):
    out: dict[KeyPath, Any] = {}
    for k, v in tree.items():
      if not isinstance(k, str):
        raise BadInputError(f"{what}: key {k!r} under '{_path_str(path)}' is not a string")
      out.update(_flatten(v, what, path + (k,)))
    if not tree and path:
      out[path] = {}
    return out
  if not (hasattr(tree, "shape") and hasattr(tree, "dtype")):
    raise BadInputError(f"{what}: leaf '{_path_str(path)}' is a {type(tree).__name__}, "
                        "not an array")
  return {path: tree}


def _leaf_items(tree: Any, what: str) -> dict[KeyPath, Any]:
  """Like `_flatten`, without the empty-dict placeholders."""
  return {p: v for p, v in _flatten(tree, what).items() if not isinstance(v, dict)}


def params_nbytes(params: Any) -> int:
  """Total bytes of all array leaves (numpy, jax or `jax.ShapeDtypeStruct`) of a pytree."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(params) if hasattr(x, "shape"))


def _to_host(params: Mapping[str, Any]) -> dict[str, Any]:
  """Copies a nested dict of arrays to host numpy arrays, checking what orbax cannot store."""
  flat = _flatten(params, "params")
  seen: dict[str, KeyPath] = {}
  for path, leaf in flat.items():
    # Orbax names each array by its '.'-joined key path; two paths with the same name would
    # silently overwrite each other.
    name = ".".join(path)
    if name in seen:
      raise BadInputError(f"params: key paths '{_path_str(seen[name])}' and "
                          f"'{_path_str(path)}' collide (both are stored as '{name}')")
    seen[name] = path
    if not isinstance(leaf, dict) and math.prod(leaf.shape) == 0:
      raise BadInputError(f"params: leaf '{_path_str(path)}' has zero size (shape "
                          f"{tuple(leaf.shape)}); orbax cannot store empty arrays")

  def convert(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: convert(v) if isinstance(v, Mapping) else np.asarray(v)
            for k, v in tree.items()}

  return convert(params)


def _default_dtype(params: Mapping[str, Any]) -> str:
  """The floating dtype shared by all float leaves, else "mixed" (or "none")."""
  names = {np.dtype(x.dtype).name for x in _leaf_items(params, "params").values()
           if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)}  # (knows bfloat16)
  return names.pop() if len(names) == 1 else ("mixed" if names else "none")


def _json_text(obj: Any, what: str) -> str:
  try:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
  except (TypeError, ValueError) as e:
    raise BadInputError(f"{what} is not JSON-serialisable: {e}") from None


def _write_text(path: str, text: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def _check_extra_files(extra_files: Mapping[str, str]) -> None:
  for name, src in extra_files.items():
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm in (".", ""):
      raise BadInputError(f"extra file name {name!r} must be a relative path inside the "
                          "checkpoint folder")
    if norm.split(os.sep)[0] in _RESERVED:
      raise BadInputError(f"extra file name {name!r} clashes with a reserved checkpoint "
                          f"entry ({', '.join(_RESERVED)})")
    if not os.path.exists(src):
      raise BadInputError(f"extra file {src} (to be copied as {name!r}) does not exist")


def _save_params(params_dir: str, host_params: dict[str, Any], compress: bool = True) -> None:
  """Writes the params pytree as an orbax checkpoint at `params_dir` (must not exist).

  Memory: orbax's default numpy handler deep-copies every host array before writing (a guard
  against the caller changing them during an async save; this save is synchronous and nothing
  changes them), and its zstd stage buffers about another copy. Without the deep copy and with
  `compress=False` (convert_weights.py), a 0.48 GB tree was written with ~10 MB beyond the tree
  itself, instead of +0.93 GB. Restoring reads every form.
  """
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
      # Unused (the tree is numpy), but without it orbax warns on every save.
      (jax.Array, ocp.type_handlers.ArrayHandler()))
  with _quiet_orbax():
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress,
                                                         type_handler_registry=registry))
    args = ocp.args.PyTreeSave(host_params)
    try:
      ckptr.save(params_dir, args=args)
    finally:
      ckptr.close()


# ------------------------------------------------------------------ temporary (partial) folders


def _partial_name(out_abs: str, role: str) -> str:
  return f"{out_abs}.{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _mark_partial(path: str, out_abs: str) -> None:
  _write_text(os.path.join(path, PARTIAL_MARKER),
              _json_text({"pid": os.getpid(), "output": out_abs}, "marker"))


def make_partial_dir(out_abs: str, role: str) -> str:
  """Creates `<out_abs>.<role>-<pid>-<hex8>` (role: "tmp" or "tok") holding the marker file,
  so that a later run recognises it as this tool's leftover if this process dies."""
  path = _partial_name(out_abs, role)
  os.makedirs(os.path.dirname(out_abs), exist_ok=True)
  os.mkdir(path)
  _mark_partial(path, out_abs)
  return path


def finish_partial_dir(path: str) -> None:
  """Drops the marker of a finished temporary folder, just before it is renamed into place."""
  os.remove(os.path.join(path, PARTIAL_MARKER))


def remove_partial_dir(path: str) -> None:
  """Deletes a temporary folder, its marker last: a deletion cut short stays recognisable."""
  for entry in os.scandir(path):
    if entry.name == PARTIAL_MARKER:
      continue
    if entry.is_dir(follow_symlinks=False):
      shutil.rmtree(entry.path)
    else:
      os.remove(entry.path)
  if os.path.exists(os.path.join(path, PARTIAL_MARKER)):
    finish_partial_dir(path)
  os.rmdir(path)


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    pass
  return True


def remove_stale_partials(out_dir: str) -> list[str]:
  """Removes the temporary folders that interrupted writes of `out_dir` left beside it.

  Only folders named `<out_dir>.{tmp,tok,old}-<pid>-<hex8>` that hold the marker and whose
  process no longer runs on this machine are removed (a write in progress is left alone).

  Returns:
    The names of the removed folders.
  """
  out_abs = os.path.abspath(out_dir)
  parent, base = os.path.split(out_abs)
  leftover = re.compile(re.escape(base) + r"\.(?:tmp|tok|old)-(\d+)-[0-9a-f]{8}")
  removed = []
  for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
    match = leftover.fullmatch(name)
    path = os.path.join(parent, name)
    if (match and os.path.isfile(os.path.join(path, PARTIAL_MARKER))
        and not _process_alive(int(match.group(1)))):
      remove_partial_dir(path)
      removed.append(name)
  return removed


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(out_dir: str, params: Mapping[str, Any], config: Mapping[str, Any],
                    meta: Mapping[str, Any], extra_files: Mapping[str, str] | None = None,
                    overwrite: bool = False, compress: bool = True) -> str:
  """Saves a converted checkpoint folder atomically.

  Args:
    out_dir: destination folder. It must not exist or be empty, unless `overwrite`; with
      `overwrite`, only a folder holding an earlier bp_jax checkpoint is replaced.
    params: nested dict (str keys) of numpy or jax arrays; copied to host memory.
    config: the model config dict, written to `config.json`.
    meta: metadata for `bp_jax.json`; must contain "kind" (e.g. "qwen3" or "dflash").
      "format" is set to "bp_jax"; "dtype" (the common float dtype of the params, or
      "mixed"), "params_nbytes" and "num_params" are filled in unless given.
    extra_files: {name inside the checkpoint: source path} of files or folders to copy in.
    overwrite: replace an existing non-empty checkpoint folder.

  Returns:
    The absolute path of the saved checkpoint.
  """
  extra_files = dict(extra_files or {})
  out_abs = os.path.abspath(out_dir)
  kind = meta.get("kind")
  if not isinstance(kind, str) or not kind:
    raise BadInputError(f"checkpoint metadata for {out_dir} needs a 'kind' "
                        f"(one of {', '.join(KNOWN_KINDS)}), got {kind!r}")
  full_meta = {"format": FORMAT, "dtype": _default_dtype(params),
               "params_nbytes": params_nbytes(params),
               "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(params))}
  full_meta.update(meta)
  full_meta["format"] = FORMAT
  config_text = _json_text(dict(config), f"config for {out_dir}")
  meta_text = _json_text(full_meta, f"metadata for {out_dir}")
  _check_extra_files(extra_files)

  replace_existing = False
  if os.path.lexists(out_abs):
    if not os.path.isdir(out_abs) or os.path.islink(out_abs):
      raise BadInputError(f"output path {out_dir} exists and is not a directory")
    if os.listdir(out_abs):
      if not overwrite:
        raise BadInputError(f"output directory {out_dir} is not empty; pass --overwrite to "
                            "replace it")
      if not os.path.exists(os.path.join(out_abs, META_FILE)):
        raise BadInputError(f"output directory {out_dir} is not empty and does not hold a "
                            f"bp_jax checkpoint (no {META_FILE}); refusing to replace it even "
                            "with --overwrite")
    replace_existing = True

  tmp = make_partial_dir(out_abs, "tmp")
  try:
    _write_text(os.path.join(tmp, CONFIG_FILE), config_text)
    _write_text(os.path.join(tmp, META_FILE), meta_text)
    for name, src in extra_files.items():
      dst = os.path.join(tmp, name)
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      if os.path.isdir(src):
        shutil.copytree(src, dst)
      else:
        shutil.copy2(src, dst)
    _save_params(os.path.join(tmp, PARAMS_DIR), _to_host(params), compress)
    _write_text(os.path.join(tmp, COMPLETE_FILE), _json_text({"format": FORMAT}, "marker"))
    finish_partial_dir(tmp)
    move_into_place(tmp, out_abs, replace_existing)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_abs


def move_into_place(tmp: str, out_abs: str, replace_existing: bool) -> None:
  """Renames the finished temporary folder to `out_abs`, replacing an existing folder."""
  if not replace_existing:
    os.rename(tmp, out_abs)
    return
  if not os.listdir(out_abs):
    os.rmdir(out_abs)
    os.rename(tmp, out_abs)
    return
  old = _partial_name(out_abs, "old")
  os.rename(out_abs, old)
  try:
    os.rename(tmp, out_abs)
  except BaseException:
    os.rename(old, out_abs)
    raise
  _mark_partial(old, out_abs)  # the replaced output is now a leftover until it is gone
  remove_partial_dir(old)


# --------------------------------------------------------------------------------- loading


def _read_json(path: str, ckpt_dir: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise BadInputError(f"checkpoint {ckpt_dir} has no {os.path.basename(path)}")
  try:
    with open(path, "r", encoding="utf-8") as f:
      obj = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BadInputError(f"{path}: malformed JSON: {e}") from None
  if not isinstance(obj, dict):
    raise BadInputError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def read_checkpoint_meta(ckpt_dir: str,
                         expected_kind: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
  """Validates a checkpoint folder and returns `(config, meta)` without reading params."""
  if not os.path.exists(ckpt_dir):
    raise BadInputError(f"checkpoint directory {ckpt_dir} does not exist")
  if not os.path.isdir(ckpt_dir):
    raise BadInputError(f"checkpoint path {ckpt_dir} is not a directory")
  has = lambda name: os.path.exists(os.path.join(ckpt_dir, name))
  if not has(COMPLETE_FILE):
    if not has(META_FILE) and (has("model.safetensors") or has("model.safetensors.index.json")):
      raise BadInputError(f"{ckpt_dir} looks like a Hugging Face checkpoint, not a converted "
                          "bp_jax checkpoint; convert it first")
    raise BadInputError(f"incomplete or interrupted checkpoint: {ckpt_dir} has no "
                        f"{COMPLETE_FILE} marker; write it again")
  config = _read_json(os.path.join(ckpt_dir, CONFIG_FILE), ckpt_dir)
  meta = _read_json(os.path.join(ckpt_dir, META_FILE), ckpt_dir)
  if meta.get("format") != FORMAT:
    raise BadInputError(f"{os.path.join(ckpt_dir, META_FILE)}: format is "
                        f"{meta.get('format')!r}, expected {FORMAT!r}")
  if expected_kind is not None and meta.get("kind") != expected_kind:
    raise BadInputError(f"checkpoint {ckpt_dir} is a {meta.get('kind')!r} checkpoint, but a "
                        f"{expected_kind!r} checkpoint is expected here")
  if not os.path.isdir(os.path.join(ckpt_dir, PARAMS_DIR)):
    raise BadInputError(f"checkpoint {ckpt_dir} has no {PARAMS_DIR}/ folder")
  return config, meta


def _check_abstract(stored: Any, abstract: Mapping[str, Any], ckpt_dir: str) -> Any:
  """Checks `abstract` against the stored tree; returns it with ShapeDtypeStruct leaves."""
  have = _flatten(stored, f"params of {ckpt_dir}")
  want = _flatten(abstract, "abstract params")
  missing = [p for p in want if p not in have]
  extra = [p for p in have if p not in want]
  if missing or extra:
    parts = []
    if missing:
      parts.append("missing from the checkpoint: " +
                   ", ".join(_path_str(p) for p in missing[:5]) +
                   (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    if extra:
      parts.append("not expected: " + ", ".join(_path_str(p) for p in extra[:5]) +
                   (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
    raise BadInputError(f"params of {ckpt_dir} do not match the expected structure; " +
                        "; ".join(parts))
  for path, w in want.items():
    if isinstance(w, dict):
      continue
    h = have[path]
    if tuple(h.shape) != tuple(w.shape):
      raise BadInputError(f"params of {ckpt_dir}: '{_path_str(path)}' has shape "
                          f"{tuple(h.shape)} in the checkpoint but {tuple(w.shape)} is expected")

  def to_struct(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=getattr(x, "sharding", None))

  return jax.tree.map(to_struct, abstract)


def load_checkpoint(ckpt_dir: str, expected_kind: str | None = None,
                    abstract: Mapping[str, Any] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Loads a checkpoint folder written by `save_checkpoint`.

  Args:
    ckpt_dir: the checkpoint folder.
    expected_kind: if given, the metadata's "kind" must equal it (e.g. "qwen3" for a target).
    abstract: optional nested dict of `jax.ShapeDtypeStruct` (or arrays) with the same
      structure as the stored params: each leaf is restored straight into its dtype (cast by
      orbax while reading), and onto its sharding when it has one. Shapes must match.

  Returns:
    `(params, config, meta)`. Params are numpy arrays, or `jax.Array`s for abstract leaves
    that carry a sharding.
  """
  config, meta = read_checkpoint_meta(ckpt_dir, expected_kind)
  params_dir = os.path.abspath(os.path.join(ckpt_dir, PARAMS_DIR))
  with _quiet_orbax():
    ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
      try:
        stored = ckptr.metadata(params_dir).item_metadata.tree
      except Exception as e:  # Orbax raises assorted types for a damaged folder.
        raise BadInputError(f"cannot read the params of checkpoint {ckpt_dir}: "
                            f"{type(e).__name__}: {e}") from e
      target = None if abstract is None else _check_abstract(stored, abstract, ckpt_dir)
      try:
        params = ckptr.restore(params_dir, args=ocp.args.StandardRestore(target))
      except Exception as e:
        raise BadInputError(f"cannot restore the params of checkpoint {ckpt_dir}: "
                            f"{type(e).__name__}: {e}") from e
    finally:
      ckptr.close()
  return params, config, meta
