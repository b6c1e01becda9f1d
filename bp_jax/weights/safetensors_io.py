"""Hugging Face safetensors checkpoints (single files and sharded folders), read and written
tensor by tensor on top of the `safetensors` package.

Added to the package: every header is checked when a checkpoint is opened, with errors naming
the file and tensor (truncated file, malformed header, unsupported dtype, offsets that disagree
with the shape, an index naming a missing shard or a tensor its shard lacks); bfloat16 reads
(numpy has no bfloat16 and the package's numpy framework finds one only if `ml_dtypes` has
registered the name, so those tensors are read from the validated offsets); streaming sharded
writing in the layout transformers writes; atomic writes (temporary name, then rename).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import uuid
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from bp_jax.errors import BadInputError

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' long-standing default, "5GB".
_HEADER_LIMIT = 100 * 2**20  # the package refuses headers over 100 MB.
_SHARD_NAME_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# The dtypes read and written here: safetensors code -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype(bool),
}
_WRITABLE = {dt.newbyteorder("=") for dt in DTYPES.values()}


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """Where one tensor lives: its file, safetensors dtype code, shape and first byte."""
  path: str
  code: str
  shape: tuple[int, ...]
  start: int


# ----------------------------------------------------------------------------------- reading


def _is_uint_list(value: Any, length: int | None = None) -> bool:
  return (isinstance(value, list) and (length is None or len(value) == length) and
          all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _check_entry(path: str, key: str, entry: Any, data_bytes: int) -> None:
  """Raises BadInputError naming `path` and `key` unless the header entry is consistent."""
  if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
    raise BadInputError(f"{path}: malformed safetensors header entry for tensor '{key}': "
                        f"expected dtype, shape and data_offsets, got {entry!r}")
  code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if code not in DTYPES:
    raise BadInputError(f"{path}: tensor '{key}' has unsupported dtype {code!r} "
                        f"(supported: {', '.join(DTYPES)})")
  if not _is_uint_list(shape):
    raise BadInputError(f"{path}: tensor '{key}' has a malformed shape {shape!r}")
  if not _is_uint_list(offsets, 2) or offsets[0] > offsets[1]:
    raise BadInputError(f"{path}: tensor '{key}' has malformed data_offsets {offsets!r}")
  need = math.prod(shape) * DTYPES[code].itemsize
  if offsets[1] - offsets[0] != need:
    raise BadInputError(f"{path}: tensor '{key}' spans {offsets[1] - offsets[0]} bytes but "
                        f"dtype {code} and shape {shape} need {need}")
  if offsets[1] > data_bytes:
    raise BadInputError(f"{path}: truncated safetensors file: tensor '{key}' ends at data byte "
                        f"{offsets[1]} but the data section has only {data_bytes} bytes")


def _read_header(path: str) -> tuple[dict[str, Any], int]:
  """The validated header of one file ({name: entry}, `__metadata__` included) and the byte
  where its data section starts."""
  try:
    file_bytes = os.path.getsize(path)
    with open(path, "rb") as f:
      header_bytes = int.from_bytes(f.read(8), "little")
      raw = f.read(min(header_bytes, _HEADER_LIMIT))
  except OSError as e:
    raise BadInputError(f"cannot read safetensors file {path}: {e.strerror}") from None
  if file_bytes < 8 or header_bytes > file_bytes - 8:
    raise BadInputError(f"{path}: truncated safetensors file ({file_bytes} bytes; the header "
                        "length runs past the end of the file)")
  if header_bytes > _HEADER_LIMIT:
    raise BadInputError(f"{path}: safetensors header of {header_bytes} bytes is implausibly "
                        "large")
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BadInputError(f"{path}: malformed safetensors header JSON: {e}") from None
  if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
    raise BadInputError(f"{path}: malformed safetensors header: expected a JSON object of "
                        "tensors and an optional '__metadata__' object")
  data_start = 8 + header_bytes
  for key, entry in header.items():
    if key != "__metadata__":
      _check_entry(path, key, entry, file_bytes - data_start)
  _check_with_package(path)
  return header, data_start


def _check_with_package(path: str) -> None:
  """The package's own checks (e.g. overlapping tensors), as a BadInputError naming the file."""
  try:
    with safetensors.safe_open(path, framework="numpy"):
      pass
  except safetensors.SafetensorError as e:
    raise BadInputError(f"{path}: not a valid safetensors file: {e}") from None


def _file_tensors(path: str) -> tuple[dict[str, _Tensor], dict[str, str]]:
  """({name: where its bytes are}, metadata) of one validated file."""
  header, data_start = _read_header(path)
  metadata = {str(k): str(v) for k, v in header.pop("__metadata__", {}).items()}
  tensors = {key: _Tensor(path, e["dtype"], tuple(e["shape"]), data_start + e["data_offsets"][0])
             for key, e in header.items()}
  return tensors, metadata


@dataclasses.dataclass
class HFCheckpoint:
  """A safetensors checkpoint whose headers were all validated on open (`open_hf_checkpoint`).

  `get(key)` opens the tensor's file for that one read and reads only its bytes, so converting
  holds one tensor at a time; nothing stays open between reads.
  """
  folder: str
  tensors: dict[str, _Tensor]
  metadata: dict[str, str]  # the first file's `__metadata__`, e.g. {"format": "pt"}
  index_path: str | None = None

  def keys(self) -> list[str]:
    return sorted(self.tensors)

  def __contains__(self, key: object) -> bool:
    return key in self.tensors

  def _tensor(self, key: str) -> _Tensor:
    if key not in self.tensors:
      raise BadInputError(f"tensor '{key}' not found in the checkpoint at {self.folder} "
                          f"({len(self.tensors)} tensors)")
    return self.tensors[key]

  def shape(self, key: str) -> tuple[int, ...]:
    return self._tensor(key).shape

  def dtype(self, key: str) -> np.dtype:
    return DTYPES[self._tensor(key).code]

  def get(self, key: str) -> np.ndarray:
    """A new array holding tensor `key` in its stored dtype (bfloat16: `ml_dtypes.bfloat16`)."""
    t = self._tensor(key)
    if t.code == "BF16":
      count = math.prod(t.shape)
      return np.fromfile(t.path, DTYPES["BF16"], count, offset=t.start).reshape(t.shape)
    with safetensors.safe_open(t.path, framework="numpy") as f:
      return f.get_tensor(key)

  @property
  def nbytes_total(self) -> int:
    return sum(math.prod(t.shape) * DTYPES[t.code].itemsize for t in self.tensors.values())

  def __enter__(self) -> "HFCheckpoint":
    return self

  def __exit__(self, *exc: Any) -> None:
    pass


def _read_index(index_path: str) -> dict[str, str]:
  """The `weight_map` (tensor name -> shard file name) of `model.safetensors.index.json`."""
  try:
    with open(index_path, "r", encoding="utf-8") as f:
      index = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BadInputError(f"{index_path}: malformed JSON: {e}") from None
  except OSError as e:
    raise BadInputError(f"cannot read {index_path}: {e.strerror}") from None
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise BadInputError(f"{index_path}: missing or malformed 'weight_map' (expected an object "
                        "mapping tensor names to shard file names)")
  return weight_map


def _open_sharded(folder: str, index_path: str) -> HFCheckpoint:
  weight_map = _read_index(index_path)
  by_shard: dict[str, dict[str, _Tensor]] = {}
  metadata: dict[str, str] = {}
  for name in sorted(set(weight_map.values())):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise BadInputError(f"shard file {name} named by {index_path} does not exist in {folder}")
    by_shard[name], shard_metadata = _file_tensors(path)
    metadata = metadata or shard_metadata
  tensors = {}
  for key, name in weight_map.items():
    if key not in by_shard[name]:
      raise BadInputError(f"{index_path} maps tensor '{key}' to {name}, but that shard does not "
                          "contain it")
    tensors[key] = by_shard[name][key]
  return HFCheckpoint(folder, tensors, metadata, index_path)


def open_hf_checkpoint(folder: str) -> HFCheckpoint:
  """Opens a single `.safetensors` file, or a folder holding `model.safetensors` (preferred, as
  in transformers) or `model.safetensors.index.json` and its shards. Validates every header.

  Raises:
    BadInputError: a missing folder or file, a shard the index names that does not exist, a
      truncated or malformed file, an unsupported dtype, or a tensor missing from its shard.
  """
  single = os.path.join(folder, SINGLE_FILE_NAME)
  if os.path.isfile(folder) and folder.endswith(".safetensors"):
    single = folder
  elif not os.path.isdir(folder):
    raise BadInputError(f"checkpoint folder {folder} does not exist or is not a directory")
  if os.path.isfile(single):
    return HFCheckpoint(folder, *_file_tensors(single))
  index_path = os.path.join(folder, INDEX_FILE_NAME)
  if os.path.isfile(index_path):
    return _open_sharded(folder, index_path)
  others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
  hint = (f"; found other safetensors files ({', '.join(others[:3])}) but no index naming them"
          if others else "")
  raise BadInputError(f"no safetensors checkpoint in {folder}: neither {SINGLE_FILE_NAME} nor "
                      f"{INDEX_FILE_NAME} exists{hint}")


# ----------------------------------------------------------------------------------- writing


def _writable(key: Any, value: Any) -> np.ndarray:
  """`value` as a C-contiguous numpy array of a supported dtype (the package writes raw memory,
  so a strided view would be written wrong)."""
  if not isinstance(key, str):
    raise BadInputError(f"tensor name {key!r} is not a string")
  arr = np.asarray(value)
  if arr.dtype.newbyteorder("=") not in _WRITABLE:
    raise BadInputError(f"tensor '{key}' has dtype {arr.dtype}, which safetensors files here do "
                        f"not support (supported: {', '.join(DTYPES)})")
  return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (0-d stays 0-d)


def _save_atomically(path: str, arrays: dict[str, np.ndarray],
                     metadata: Mapping[str, str] | None) -> None:
  tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    safetensors.numpy.save_file(arrays, tmp, metadata=dict(metadata) if metadata else None)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_safetensors(path: str, tensors: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name -> numpy/jax array) as one safetensors file, atomically."""
  _save_atomically(path, {k: _writable(k, v) for k, v in tensors.items()}, metadata)


def _remove_stale_checkpoint_files(folder: str) -> None:
  """Removes an earlier checkpoint's weight files so old shards cannot shadow new ones."""
  for name in os.listdir(folder):
    if name in (SINGLE_FILE_NAME, INDEX_FILE_NAME) or _SHARD_NAME_RE.match(name):
      os.remove(os.path.join(folder, name))


def _write_index(folder: str, shard_of: dict[str, str], total_bytes: int) -> None:
  tmp = os.path.join(folder, f".{INDEX_FILE_NAME}.tmp-{uuid.uuid4().hex[:8]}")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total_bytes}, "weight_map": shard_of}, f, indent=2,
              sort_keys=True)
    f.write("\n")
  os.replace(tmp, os.path.join(folder, INDEX_FILE_NAME))


def write_hf_checkpoint(folder: str, tensors_iter: Iterable[tuple[str, Any]] | Mapping[str, Any],
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        metadata: Mapping[str, str] | None = None) -> list[str]:
  """Writes a Hugging Face weight folder, streaming `(name, array)` pairs.

  Tensors are grouped in arrival order into shards of at most `max_shard_bytes` (a larger
  tensor gets a shard of its own), so peak memory is about one shard. One shard is written as
  `model.safetensors`; several as `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json`, the layout transformers writes. Each file gets `metadata`
  (default `{"format": "pt"}`, which `from_pretrained` expects). An earlier checkpoint's weight
  files in `folder` are replaced; other files (config, tokenizer) are left alone.

  Returns:
    The names of the weight files written, relative to `folder`.
  """
  if max_shard_bytes <= 0:
    raise BadInputError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
  items = tensors_iter.items() if isinstance(tensors_iter, Mapping) else tensors_iter
  metadata = {"format": "pt"} if metadata is None else metadata
  os.makedirs(folder, exist_ok=True)
  tag = uuid.uuid4().hex[:8]
  parts: list[str] = []               # temporary shard files written so far
  part_of: dict[str, int] = {}        # tensor name -> shard number
  shard: dict[str, np.ndarray] = {}   # the shard being filled
  total_bytes = 0

  def flush() -> None:
    parts.append(os.path.join(folder, f".bp_jax-part-{len(parts):05d}-{tag}.safetensors"))
    _save_atomically(parts[-1], shard, metadata)
    shard.clear()

  try:
    for key, value in items:
      arr = _writable(key, value)
      if key in part_of:
        raise BadInputError(f"tensor '{key}' was given twice while writing {folder}")
      if shard and sum(a.nbytes for a in shard.values()) + arr.nbytes > max_shard_bytes:
        flush()
      shard[key] = arr
      part_of[key] = len(parts)
      total_bytes += arr.nbytes
    if shard or not parts:
      flush()
    _remove_stale_checkpoint_files(folder)
    if len(parts) == 1:
      os.replace(parts.pop(), os.path.join(folder, SINGLE_FILE_NAME))
      return [SINGLE_FILE_NAME]
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for part, name in zip(parts, names):
      os.replace(part, os.path.join(folder, name))
    parts.clear()
    _write_index(folder, {k: names[i] for k, i in sorted(part_of.items())}, total_bytes)
    return names + [INDEX_FILE_NAME]
  finally:
    for part in parts:
      if os.path.exists(part):
        os.remove(part)
