"""TFDS plumbing: ordered single-split ArrayRecord builders, offline building, reading back.

Every dataset built here is a `tfds.core.GeneratorBasedBuilder` whose BuilderConfig name is the
dataset's name, written with `file_format="array_record"` into
`<data_dir>/<builder name>/<dataset name>/<version>/` as one split (`SPLIT`) that keeps the
order in which examples were generated. Reading uses `tfds.builder_from_directory(...)
.as_data_source()`: random access to numpy dicts, with no TensorFlow needed anywhere.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow_datasets as tfds

from bp_jax.errors import BadInputError

# The one split each dataset holds (datasets are already one part of a split: "..._train").
SPLIT = "train"

_log = logging.getLogger(__name__)
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")

# Builder classes by their TFDS name (the folder under data_dir), filled by subclassing.
_BUILDERS: dict[str, type["OrderedArrayRecordBuilder"]] = {}


def check_name(name: str) -> None:
  """Raises BadInputError unless `name` is a usable dataset name (letters, digits, _ and -)."""
  if not isinstance(name, str) or not _NAME_RE.match(name):
    raise BadInputError(
        f"dataset name {name!r}: use a letter followed by letters, digits, '_' or '-'")


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """DatasetInfo for datasets built here: nothing is looked up in TFDS's GCS bucket.

  TFDS calls `initialize_from_bucket` whenever a builder is made for a dataset not yet
  prepared; with GCS disabled (the default) its only effect is an empty `tempfile.mkdtemp("tfds")`
  folder that is never removed, one per dataset built.
  """

  def initialize_from_bucket(self) -> None:
    _log.debug("%s: built locally, no bucket lookup", self.full_name)


class OrderedArrayRecordBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base of this package's builders: one ordered split, ArrayRecord files, a named config.

  Subclasses define `_features()` and `_examples()`; the dataset name and description are
  given at construction, so one builder class makes any number of named datasets.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(skip_registration=True, **kwargs)
    _BUILDERS[cls.name] = cls

  def __init__(self, *, data_dir: str | os.PathLike, name: str, description: str = "",
               overwrite: bool = False):
    """Names the dataset; `overwrite` deletes an existing one of that name and kind first."""
    check_name(name)
    if overwrite:
      remove_dataset(data_dir, name)
    with quiet_tfds():
      super().__init__(
          data_dir=os.fspath(data_dir),
          config=tfds.core.BuilderConfig(name=name, description=description),
          file_format="array_record")

  @abc.abstractmethod
  def _features(self) -> tfds.features.FeaturesDict:
    """The features of one example."""

  @abc.abstractmethod
  def _examples(self) -> Iterator[dict[str, Any]]:
    """Yields the examples, in the order they are to be stored."""

  def _metadata(self) -> dict[str, Any] | None:
    """Entries saved with the data as metadata.json (none by default)."""
    return None

  def _info(self) -> tfds.core.DatasetInfo:
    meta = self._metadata()
    return _LocalDatasetInfo(
        builder=self, description=self.builder_config.description, features=self._features(),
        disable_shuffling=True, metadata=tfds.core.MetadataDict(meta) if meta else None)

  def _split_generators(self, dl_manager: Any) -> dict[str, Iterator[tuple[int, dict]]]:
    del dl_manager  # Nothing is downloaded.
    return {SPLIT: self._generate_examples()}

  def _generate_examples(self) -> Iterator[tuple[int, dict[str, Any]]]:
    # Integer keys in generation order: with disable_shuffling, TFDS stores examples by key.
    yield from enumerate(self._examples())

  def _log_download_bytes(self) -> None:
    _log.debug("building %s in %s", self.builder_config.name, self.data_dir)

  def _log_download_done(self) -> None:
    _log.debug("built %s in %s", self.builder_config.name, self.data_dir)

  def build(self) -> None:
    """Writes the dataset without any network access (a no-op when it is already prepared)."""
    config = tfds.download.DownloadConfig(
        try_download_gcs=False, download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS,
        compute_stats=tfds.download.ComputeStatsMode.SKIP)
    with quiet_tfds(), tempfile.TemporaryDirectory(prefix="bp_jax_tfds_") as scratch:
      self.download_and_prepare(download_dir=scratch, download_config=config)


@contextlib.contextmanager
def quiet_tfds() -> Iterator[None]:
  """Hides TFDS progress bars and absl info/warning lines (e.g. 'Using custom config')."""
  absl_logger = logging.getLogger("absl")
  old_level = absl_logger.level
  tqdm_utils = tfds.core.utils.tqdm_utils
  old_bar = getattr(tqdm_utils, "_active", True)
  absl_logger.setLevel(logging.ERROR)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(old_bar)
    absl_logger.setLevel(old_level)


def dataset_path(data_dir: str | os.PathLike, name: str,
                 builder: type[OrderedArrayRecordBuilder]) -> str:
  """Where `builder` writes dataset `name` under `data_dir`."""
  return os.path.join(os.fspath(data_dir), builder.name, name, str(builder.VERSION))


def _prepared_paths(data_dir: str | os.PathLike, name: str) -> list[str]:
  """The folders of prepared datasets called `name` in `data_dir`, one per builder kind."""
  return [path for path in (dataset_path(data_dir, name, b) for b in _BUILDERS.values())
          if os.path.isfile(os.path.join(path, "dataset_info.json"))]


def dataset_exists(data_dir: str | os.PathLike, name: str) -> bool:
  """Whether a prepared dataset called `name` exists in `data_dir`."""
  check_name(name)
  return bool(_prepared_paths(data_dir, name))


def remove_dataset(data_dir: str | os.PathLike, name: str) -> None:
  """Deletes every prepared version of dataset `name` (of any kind) in `data_dir`, if any."""
  check_name(name)
  for builder in _BUILDERS.values():
    shutil.rmtree(dataset_path(data_dir, name, builder), ignore_errors=True)


def existing_error(data_dir: str | os.PathLike, name: str) -> BadInputError:
  """The error for writing over a dataset that exists, without asking to overwrite."""
  return BadInputError(
      f"dataset {name!r} already exists in data_dir {os.fspath(data_dir)!r}; "
      "pass overwrite=True to rebuild it or choose another name")


class Dataset(Sequence[dict[str, Any]]):
  """A prepared dataset read back with random access: a sequence of python/numpy dicts.

  Text features come back as `str`, scalars as `int`, token sequences as int32 arrays.
  """

  def __init__(self, name: str, data_dir: str, path: str):
    self.name = name
    self.data_dir = data_dir
    self.path = path
    with quiet_tfds():
      builder = tfds.builder_from_directory(path)
      self.kind: str = builder.name
      self.info: tfds.core.DatasetInfo = builder.info
      self._source = builder.as_data_source(split=SPLIT)

  @property
  def description(self) -> str:
    """The description given when the dataset was built."""
    return self.info.description or ""

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int | slice) -> Any:
    if isinstance(index, slice):
      return self.__getitems__(range(len(self))[index])
    return _decode(self._source[self._check_index(index)])

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Reads several examples in one call (faster than one by one)."""
    keys = [self._check_index(i) for i in indices]
    if not keys:
      return []
    return [_decode(record) for record in self._source.__getitems__(keys)]

  def __iter__(self) -> Iterator[dict[str, Any]]:
    for start in range(0, len(self), 256):
      yield from self.__getitems__(range(start, min(start + 256, len(self))))

  def _check_index(self, index: int) -> int:
    n = len(self)
    index = int(index)
    if not -n <= index < n:
      raise IndexError(f"index {index} out of range for dataset {self.name!r} of {n} examples")
    return index % n

  def __repr__(self) -> str:
    return f"Dataset(name={self.name!r}, kind={self.kind!r}, n={len(self)}, path={self.path!r})"


def _decode(record: dict[str, Any]) -> dict[str, Any]:
  """Turns TFDS numpy values into str / int / arrays."""
  out: dict[str, Any] = {}
  for key, value in record.items():
    if isinstance(value, bytes):
      out[key] = value.decode("utf-8")
    elif np.ndim(value) == 0:
      out[key] = value.item() if isinstance(value, np.generic) else value
    else:
      out[key] = np.asarray(value)
  return out


def open_dataset(data_dir: str | os.PathLike, name: str) -> Dataset:
  """Opens the prepared dataset `name` in `data_dir` (any builder kind of this package).

  Raises:
    BadInputError: naming the dataset and data_dir when it is missing or not fully prepared.
  """
  check_name(name)
  data_dir = os.fspath(data_dir)
  paths = _prepared_paths(data_dir, name)
  if not paths:
    if not os.path.isdir(data_dir):
      why = "the data_dir does not exist"
    elif any(os.path.isdir(os.path.join(data_dir, b, name)) for b in _BUILDERS):
      why = "it was never completely prepared (an interrupted build?)"
    else:
      why = "no dataset of that name was prepared there"
    raise BadInputError(f"dataset {name!r} not found in data_dir {data_dir!r}: {why}")
  if len(paths) > 1:
    raise BadInputError(
        f"dataset {name!r} in data_dir {data_dir!r} is ambiguous: prepared as {paths}")
  return Dataset(name, data_dir, paths[0])
