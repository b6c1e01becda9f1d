"""Token-sequence datasets: (id, tokens, prompt_len) examples streamed from the caller.

Used for LM pretraining chunks (prompt_len 0: every position is trained) and for prompts with
target-regenerated responses (loss only on positions >= prompt_len).
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import tensorflow_datasets as tfds

from bp_jax.data import tfds_io
from bp_jax.errors import BadInputError

_INT32 = np.iinfo(np.int32)


def check_record(record: Mapping[str, Any], where: str) -> dict[str, Any]:
  """Validates one {"id", "tokens", "prompt_len"?} record; returns it normalised.

  Raises:
    BadInputError: naming `where` (dataset and record index) and the fault.
  """
  if not isinstance(record, Mapping):
    raise BadInputError(f"{where}: expected a dict with keys 'id', 'tokens', 'prompt_len'")
  unknown = set(record) - {"id", "tokens", "prompt_len"}
  if unknown:
    raise BadInputError(f"{where}: unknown keys {sorted(unknown)}")
  record_id = record.get("id")
  if not isinstance(record_id, str) or not record_id:
    raise BadInputError(f"{where}: 'id' must be a non-empty string, got {record_id!r}")
  tokens = np.asarray(record.get("tokens", []))
  if tokens.ndim != 1 or tokens.size == 0:
    raise BadInputError(f"{where} (id {record_id!r}): 'tokens' must be a non-empty 1-D sequence")
  if tokens.dtype.kind not in "iu":
    raise BadInputError(f"{where} (id {record_id!r}): 'tokens' must hold integers, "
                        f"got dtype {tokens.dtype}")
  if tokens.min() < 0 or tokens.max() > _INT32.max:
    raise BadInputError(f"{where} (id {record_id!r}): token ids must lie in [0, 2**31)")
  prompt_len = record.get("prompt_len", 0)
  if isinstance(prompt_len, (bool, np.bool_)) or not isinstance(prompt_len, (int, np.integer)):
    raise BadInputError(f"{where} (id {record_id!r}): 'prompt_len' must be an integer")
  if not 0 <= prompt_len <= tokens.size:
    raise BadInputError(f"{where} (id {record_id!r}): 'prompt_len' {prompt_len} is outside "
                        f"[0, {tokens.size}] (the number of tokens)")
  return {"id": record_id, "tokens": tokens.astype(np.int32), "prompt_len": int(prompt_len)}


class TokenSequenceBuilder(tfds_io.OrderedArrayRecordBuilder):
  """Named token sequences: `id` (text), `tokens` (int32, variable length), `prompt_len` (int32).

  The records are an iterable given at construction; it is consumed once, while building,
  so a generator can stream into the dataset.
  """

  name = "token_sequences"

  def __init__(self, *, data_dir: str | os.PathLike, name: str,
               records: Iterable[Mapping[str, Any]], description: str = "",
               overwrite: bool = False):
    self._records = records
    self._dataset_name = name
    super().__init__(data_dir=data_dir, name=name, description=description, overwrite=overwrite)

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({
        "id": tfds.features.Text(),
        "tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        "prompt_len": tfds.features.Scalar(dtype=np.int32),
    })

  def _examples(self) -> Iterator[dict[str, Any]]:
    seen: set[str] = set()
    for index, record in enumerate(self._records):
      where = f"dataset {self._dataset_name!r} record {index}"
      checked = check_record(record, where)
      if checked["id"] in seen:
        raise BadInputError(f"{where}: id {checked['id']!r} appears more than once")
      seen.add(checked["id"])
      yield checked


def write_sequences(data_dir: str | os.PathLike, name: str,
                    records_iter: Iterable[Mapping[str, Any]], description: str = "",
                    overwrite: bool = False) -> tfds_io.Dataset:
  """Builds token-sequence dataset `name` in `data_dir` from streamed records and opens it.

  Args:
    data_dir: the folder holding datasets.
    name: the dataset's name.
    records_iter: dicts {"id": str, "tokens": ints, "prompt_len": int (default 0)}, consumed
      once, in order; ids must be distinct, 0 <= prompt_len <= len(tokens).
    description: stored with the dataset.
    overwrite: replace an existing dataset of that name (deleted before the new one is built).

  Raises:
    BadInputError: a bad record (naming dataset, record index and id), no records, or the
      dataset exists and `overwrite` is False. Nothing is left behind on failure.
  """
  tfds_io.check_name(name)
  if not overwrite and tfds_io.dataset_exists(data_dir, name):
    raise tfds_io.existing_error(data_dir, name)
  records = iter(records_iter)
  first = next(records, None)
  if first is None:
    raise BadInputError(f"dataset {name!r}: no records to write (data_dir "
                        f"{os.fspath(data_dir)!r})")
  builder = TokenSequenceBuilder(data_dir=data_dir, name=name, description=description,
                                 records=itertools.chain([first], records),
                                 overwrite=overwrite)
  builder.build()
  return tfds_io.open_dataset(data_dir, name)
