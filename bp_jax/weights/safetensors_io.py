"""Streaming reader and writer for Hugging Face safetensors checkpoints.

Written against the file format itself, with numpy and `ml_dtypes` only (no torch, no jax):

  [8 bytes: little-endian uint64 N] [N bytes: JSON header] [raw tensor bytes]

The header maps each tensor name to `{"dtype": "F32", "shape": [...], "data_offsets": [b, e]}`
(byte offsets relative to the start of the data section), plus an optional `"__metadata__"`
dict of strings. Tensor data is little-endian and C-ordered.

Reading memory-maps each file, so `HFCheckpoint.get(key)` touches only that tensor's bytes.
Every header is checked when the checkpoint is opened (a truncated or malformed file fails at
once, naming the file). A sharded checkpoint is a `model.safetensors.index.json` whose
`weight_map` maps each tensor name to its shard file, the layout `transformers` writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from typing import Any, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from bp_jax.errors import BadInputError

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' long-standing default, "5GB".

# safetensors dtype code -> numpy dtype (explicitly little-endian where it matters).
_CODE_TO_DTYPE: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
# numpy dtype (native byte order) -> safetensors dtype code.
_DTYPE_TO_CODE: dict[np.dtype, str] = {dt.newbyteorder("="): code
                                       for code, dt in _CODE_TO_DTYPE.items()}
_HEADER_LIMIT = 100 * 2**20  # the reference implementation refuses headers over 100 MB.
_SHARD_NAME_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class _TensorInfo:
  """Where one tensor lives: its file, dtype, shape and absolute byte range."""
  __slots__ = ("file", "dtype", "shape", "start", "end")

  def __init__(self, file: "_SafetensorsFile", dtype: np.dtype, shape: tuple[int, ...],
               start: int, end: int):
    self.file = file
    self.dtype = dtype
    self.shape = shape
    self.start = start
    self.end = end


class _SafetensorsFile:
  """One `.safetensors` file whose header was validated on open; tensors are read on demand."""

  def __init__(self, path: str):
    self.path = path
    self.metadata: dict[str, str] = {}
    self.tensors: dict[str, _TensorInfo] = {}
    try:
      self._fh = open(path, "rb")
    except OSError as e:
      raise BadInputError(f"cannot open safetensors file {path}: {e.strerror}") from None
    try:
      self._parse_header()
    except BaseException:
      self._fh.close()
      raise

  def _parse_header(self) -> None:
    """Reads and validates the header against the real file size."""
    path = self.path
    file_size = os.fstat(self._fh.fileno()).st_size
    if file_size < 8:
      raise BadInputError(
          f"{path}: truncated safetensors file ({file_size} bytes, shorter than the 8-byte "
          "header length)")
    n = int.from_bytes(self._fh.read(8), "little")
    if n > file_size - 8:
      raise BadInputError(
          f"{path}: truncated or corrupt safetensors file: header length {n} runs past the end "
          f"of the file ({file_size} bytes)")
    if n > _HEADER_LIMIT:
      raise BadInputError(f"{path}: safetensors header of {n} bytes is implausibly large")
    raw = self._fh.read(n)
    try:
      header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise BadInputError(f"{path}: malformed safetensors header JSON: {e}") from None
    if not isinstance(header, dict):
      raise BadInputError(f"{path}: malformed safetensors header: expected a JSON object, "
                          f"got {type(header).__name__}")
    data_start = 8 + n
    data_size = file_size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
      raise BadInputError(f"{path}: malformed safetensors header: '__metadata__' is not an "
                          "object")
    self.metadata = {str(k): str(v) for k, v in meta.items()}
    for key, entry in header.items():
      self.tensors[key] = self._parse_entry(key, entry, data_start, data_size)

  def _parse_entry(self, key: str, entry: Any, data_start: int,
                   data_size: int) -> _TensorInfo:
    """Validates one header entry and returns where its bytes are."""
    path = self.path
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
      raise BadInputError(f"{path}: malformed safetensors header entry for tensor '{key}': "
                          f"expected dtype, shape and data_offsets, got {entry!r}")
    code = entry["dtype"]
    if code not in _CODE_TO_DTYPE:
      raise BadInputError(f"{path}: tensor '{key}' has unsupported dtype {code!r} "
                          f"(supported: {', '.join(_CODE_TO_DTYPE)})")
    dtype = _CODE_TO_DTYPE[code]
    shape, offsets = entry["shape"], entry["data_offsets"]
    if (not isinstance(shape, list) or
        not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
      raise BadInputError(f"{path}: tensor '{key}' has a malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or
        not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets) or
        offsets[0] > offsets[1]):
      raise BadInputError(f"{path}: tensor '{key}' has malformed data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
      raise BadInputError(
          f"{path}: tensor '{key}' spans {end - begin} bytes but dtype {code} and shape "
          f"{shape} need {expected}")
    if end > data_size:
      raise BadInputError(
          f"{path}: truncated safetensors file: tensor '{key}' ends at data byte {end} but the "
          f"data section has only {data_size} bytes")
    return _TensorInfo(self, dtype, tuple(shape), data_start + begin, data_start + end)

  def read(self, info: _TensorInfo) -> np.ndarray:
    """Reads one tensor's bytes straight into a new array (no map of the whole file is kept,
    so converting holds one copy of the weights, not the file's pages as well)."""
    count = math.prod(info.shape)
    out = np.empty(info.shape, info.dtype)
    if count == 0:
      return out
    buf = memoryview(out.reshape(-1).view(np.uint8))
    done, total = 0, info.end - info.start
    while done < total:  # one read returns at most ~2 GiB on Linux
      got = os.preadv(self._fh.fileno(), [buf[done:]], info.start + done)
      if got <= 0:
        raise BadInputError(f"{self.path}: short read of a tensor ({done} of {total} bytes); "
                            "the file is truncated or changing")
      done += got
    return out

  def close(self) -> None:
    self._fh.close()


class HFCheckpoint:
  """Read-only view of a Hugging Face safetensors checkpoint folder (tensors read on demand).

  Open with `open_hf_checkpoint(folder)`. Usable as a context manager; `close()` releases
  the file handles and memory maps.
  """

  def __init__(self, folder: str, files: list[_SafetensorsFile],
               tensors: dict[str, _TensorInfo], index_path: str | None):
    self.folder = folder
    self.index_path = index_path
    self._files = files
    self._tensors = tensors

  def keys(self) -> list[str]:
    """All tensor names, in a stable (sorted) order."""
    return sorted(self._tensors)

  def __contains__(self, key: object) -> bool:
    return key in self._tensors

  def __len__(self) -> int:
    return len(self._tensors)

  def __iter__(self) -> Iterator[str]:
    return iter(self.keys())

  def _info(self, key: str) -> _TensorInfo:
    try:
      return self._tensors[key]
    except KeyError:
      raise BadInputError(f"tensor '{key}' not found in the checkpoint at {self.folder} "
                          f"({len(self._tensors)} tensors)") from None

  def shape(self, key: str) -> tuple[int, ...]:
    """The stored shape of tensor `key`."""
    return self._info(key).shape

  def dtype(self, key: str) -> np.dtype:
    """The stored dtype of tensor `key` (bfloat16 is `ml_dtypes.bfloat16`)."""
    return self._info(key).dtype

  def file_of(self, key: str) -> str:
    """Path of the file that holds tensor `key`."""
    return self._info(key).file.path

  def get(self, key: str) -> np.ndarray:
    """A copy of tensor `key` in its stored dtype; reads only that tensor's bytes."""
    info = self._info(key)
    return info.file.read(info)

  __getitem__ = get

  @property
  def nbytes_total(self) -> int:
    """Total size of all tensors' data, in bytes."""
    return sum(t.end - t.start for t in self._tensors.values())

  @property
  def metadata(self) -> dict[str, str]:
    """The `__metadata__` of the first file (e.g. `{"format": "pt"}`)."""
    return dict(self._files[0].metadata) if self._files else {}

  def close(self) -> None:
    for f in self._files:
      f.close()

  def __enter__(self) -> "HFCheckpoint":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"HFCheckpoint({self.folder!r}, {len(self._tensors)} tensors, "
            f"{len(self._files)} file(s), {self.nbytes_total} bytes)")


def _open_files(paths: list[str]) -> list[_SafetensorsFile]:
  """Opens several files; closes the already-opened ones if a later one fails."""
  files: list[_SafetensorsFile] = []
  try:
    for p in paths:
      files.append(_SafetensorsFile(p))
  except BaseException:
    for f in files:
      f.close()
    raise
  return files


def _read_index(index_path: str) -> dict[str, str]:
  """Parses `model.safetensors.index.json` and returns its weight_map."""
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


def open_hf_checkpoint(folder: str) -> HFCheckpoint:
  """Opens a safetensors checkpoint: a folder or a single `.safetensors` file.

  In a folder, `model.safetensors` is used when present (as transformers does), otherwise
  `model.safetensors.index.json` and the shards it names. All headers are validated now.

  Raises:
    BadInputError: missing folder or files, a shard named by the index that does not exist,
      a truncated file, malformed header JSON, an unsupported dtype, or an index entry whose
      shard lacks the tensor.
  """
  if os.path.isfile(folder) and folder.endswith(".safetensors"):
    files = _open_files([folder])
    return HFCheckpoint(folder, files, dict(files[0].tensors), None)
  if not os.path.isdir(folder):
    raise BadInputError(f"checkpoint folder {folder} does not exist or is not a directory")
  single = os.path.join(folder, SINGLE_FILE_NAME)
  index_path = os.path.join(folder, INDEX_FILE_NAME)
  if os.path.isfile(single):
    files = _open_files([single])
    return HFCheckpoint(folder, files, dict(files[0].tensors), None)
  if not os.path.isfile(index_path):
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    hint = (f"; found other safetensors files ({', '.join(others[:3])}) but no index naming "
            "them" if others else "")
    raise BadInputError(f"no safetensors checkpoint in {folder}: neither {SINGLE_FILE_NAME} "
                        f"nor {INDEX_FILE_NAME} exists{hint}")
  weight_map = _read_index(index_path)
  shard_names = sorted(set(weight_map.values()))
  for name in shard_names:
    if not os.path.isfile(os.path.join(folder, name)):
      raise BadInputError(f"shard file {name} named by {index_path} does not exist in {folder}")
  files = _open_files([os.path.join(folder, n) for n in shard_names])
  by_name = dict(zip(shard_names, files))
  tensors: dict[str, _TensorInfo] = {}
  try:
    for key, name in weight_map.items():
      info = by_name[name].tensors.get(key)
      if info is None:
        raise BadInputError(f"{index_path} maps tensor '{key}' to {name}, but that shard "
                            "does not contain it")
      tensors[key] = info
  except BaseException:
    for f in files:
      f.close()
    raise
  return HFCheckpoint(folder, files, tensors, index_path)


# ----------------------------------------------------------------------------------- writing


def _as_writable(key: str, array: Any) -> tuple[np.ndarray, str]:
  """Returns a little-endian C-contiguous numpy array and its safetensors dtype code."""
  arr = np.asarray(array)
  code = _DTYPE_TO_CODE.get(arr.dtype.newbyteorder("="))
  if code is None:
    raise BadInputError(f"tensor '{key}' has dtype {arr.dtype}, which safetensors files here "
                        f"do not support (supported: {', '.join(_CODE_TO_DTYPE)})")
  target = _CODE_TO_DTYPE[code]
  if arr.dtype != target:
    arr = arr.astype(target)
  if not arr.flags.c_contiguous:
    arr = arr.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d.)
  return arr, code


def _write_file(path: str, items: list[tuple[str, np.ndarray, str]],
                metadata: Mapping[str, str] | None) -> None:
  """Writes one safetensors file atomically (temporary name, then rename)."""
  header: dict[str, Any] = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  offset = 0
  for key, arr, code in items:
    header[key] = {"dtype": code, "shape": list(arr.shape),
                   "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # Pad so that the data section starts 8-byte aligned.
  tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  try:
    with open(tmp, "wb") as f:
      f.write(len(raw).to_bytes(8, "little"))
      f.write(raw)
      for _, arr, _ in items:
        if arr.nbytes:
          f.write(memoryview(arr.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_safetensors(path: str, tensors: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name -> numpy/jax array) as one safetensors file at `path`.

  Tensors are written in the mapping's order; supported dtypes are F64, F32, F16, BF16
  (`ml_dtypes.bfloat16`), I64, I32, I16, I8, U8 and BOOL.
  """
  items = []
  for key, value in tensors.items():
    if not isinstance(key, str):
      raise BadInputError(f"tensor name {key!r} is not a string")
    items.append((key, *_as_writable(key, value)))
  _write_file(path, items, metadata)


def _remove_stale_checkpoint_files(folder: str) -> None:
  """Removes a previous checkpoint's weight files so old shards cannot shadow new ones."""
  for name in os.listdir(folder):
    if name in (SINGLE_FILE_NAME, INDEX_FILE_NAME) or _SHARD_NAME_RE.match(name):
      os.remove(os.path.join(folder, name))


def write_hf_checkpoint(folder: str, tensors_iter: Iterable[tuple[str, Any]] | Mapping[str, Any],
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        metadata: Mapping[str, str] | None = None) -> list[str]:
  """Writes a Hugging Face weight folder, streaming tensors from `(name, array)` pairs.

  Tensors are grouped in arrival order into shards of at most `max_shard_bytes` (a single
  larger tensor gets a shard of its own), so peak memory is about one shard. One shard is
  written as `model.safetensors`; several as `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": ...}`),
  the layout `transformers` writes. Each file gets `metadata` (default `{"format": "pt"}`,
  which `from_pretrained` expects). Weight files of an earlier checkpoint in `folder` are
  replaced; other files (config, tokenizer) are left alone.

  Returns:
    The names of the weight files written, relative to `folder`.
  """
  if max_shard_bytes <= 0:
    raise BadInputError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
  if isinstance(tensors_iter, Mapping):
    tensors_iter = tensors_iter.items()
  metadata = {"format": "pt"} if metadata is None else metadata
  os.makedirs(folder, exist_ok=True)
  tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
  part_names: list[str] = []
  weight_map: dict[str, int] = {}  # tensor name -> shard number (0-based)
  total = 0
  current: list[tuple[str, np.ndarray, str]] = []
  current_bytes = 0

  def flush() -> None:
    nonlocal current, current_bytes
    name = f".bp_jax-part-{len(part_names):05d}-{tag}.safetensors"
    _write_file(os.path.join(folder, name), current, metadata)
    part_names.append(name)
    current, current_bytes = [], 0

  try:
    for key, value in tensors_iter:
      if not isinstance(key, str):
        raise BadInputError(f"tensor name {key!r} is not a string")
      if key in weight_map:
        raise BadInputError(f"tensor '{key}' was given twice while writing {folder}")
      arr, code = _as_writable(key, value)
      if current and current_bytes + arr.nbytes > max_shard_bytes:
        flush()
      current.append((key, arr, code))
      current_bytes += arr.nbytes
      total += arr.nbytes
      weight_map[key] = len(part_names)
    if current or not part_names:
      flush()
    _remove_stale_checkpoint_files(folder)
    n = len(part_names)
    if n == 1:
      os.replace(os.path.join(folder, part_names[0]), os.path.join(folder, SINGLE_FILE_NAME))
      return [SINGLE_FILE_NAME]
    final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for src, dst in zip(part_names, final):
      os.replace(os.path.join(folder, src), os.path.join(folder, dst))
    part_names = []
    index = {"metadata": {"total_size": total},
             "weight_map": {k: final[i] for k, i in sorted(weight_map.items())}}
    tmp_index = os.path.join(folder, f".{INDEX_FILE_NAME}.tmp-{tag}")
    with open(tmp_index, "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2, sort_keys=True)
      f.write("\n")
    os.replace(tmp_index, os.path.join(folder, INDEX_FILE_NAME))
    return final + [INDEX_FILE_NAME]
  finally:
    for name in part_names:
      p = os.path.join(folder, name)
      if os.path.exists(p):
        os.remove(p)
