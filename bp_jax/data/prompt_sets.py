"""Prompt-set datasets: (id, text) examples from a `bp_jax.text.prompts` source, optionally one split."""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import tensorflow_datasets as tfds

from bp_jax.data import tfds_io
from bp_jax.errors import BadInputError
from bp_jax.text.prompts import Prompt, load_prompts


def select_prompts(source: str, ids: Sequence[str] | None = None,
                   num_prompts: int | None = None) -> list[Prompt]:
  """Loads the prompts of `source`, keeping those in `ids` (in source order) when given.

  Args:
    source: a `bp_jax.text.prompts.load_prompts` source (JSONL path, "humaneval", "pysrc:<dir>").
    ids: the ids to keep (e.g. one part of `split_ids`); None keeps every prompt.
    num_prompts: then keep only the first N; None, 0 or negative keeps all.

  Raises:
    BadInputError: a bad source, duplicate ids, or ids the source does not hold.
  """
  prompts = load_prompts(source)
  if ids is not None:
    if isinstance(ids, str):
      raise BadInputError(f"prompt ids for source {source!r}: give a list of ids, not a string")
    wanted = set(ids)
    if len(wanted) != len(ids):
      raise BadInputError(f"prompt ids for source {source!r} hold duplicates")
    missing = wanted - {p.id for p in prompts}
    if missing:
      shown = ", ".join(repr(i) for i in sorted(missing)[:5])
      raise BadInputError(
          f"prompt source {source!r} has no prompt with id {shown}"
          + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    prompts = [p for p in prompts if p.id in wanted]
  if num_prompts is not None and num_prompts > 0:
    prompts = prompts[:num_prompts]
  if not prompts:
    raise BadInputError(f"prompt source {source!r}: the selection holds no prompts")
  return prompts


class PromptSetBuilder(tfds_io.OrderedArrayRecordBuilder):
  """A named prompt set: features `id` (text) and `text` (text), in source order."""

  name = "prompt_set"

  def __init__(self, *, data_dir: str | os.PathLike, name: str, source: str,
               ids: Sequence[str] | None = None, num_prompts: int | None = None,
               overwrite: bool = False):
    self._prompts = select_prompts(source, ids, num_prompts)  # Fails before anything is deleted.
    what = "all prompts" if ids is None else "prompts selected by id"
    super().__init__(data_dir=data_dir, name=name, overwrite=overwrite,
                     description=f"{len(self._prompts)} {what} of source {source!r}")

  def _features(self) -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict({"id": tfds.features.Text(), "text": tfds.features.Text()})

  def _examples(self) -> Iterator[dict[str, Any]]:
    for prompt in self._prompts:
      yield {"id": prompt.id, "text": prompt.text}


def write_prompts(data_dir: str | os.PathLike, name: str, source: str,
                  ids: Sequence[str] | None = None, num_prompts: int | None = None,
                  overwrite: bool = False) -> tfds_io.Dataset:
  """Builds prompt set `name` in `data_dir` from `source` (see `select_prompts`) and opens it.

  Raises:
    BadInputError: a bad source or id list, or the dataset exists and `overwrite` is False.
  """
  tfds_io.check_name(name)
  if not overwrite and tfds_io.dataset_exists(data_dir, name):
    raise tfds_io.existing_error(data_dir, name)
  builder = PromptSetBuilder(data_dir=data_dir, name=name, source=source, ids=ids,
                             num_prompts=num_prompts, overwrite=overwrite)
  builder.build()
  return tfds_io.open_dataset(data_dir, name)


def read_prompts(data_dir: str | os.PathLike, name: str) -> list[Prompt]:
  """Reads prompt set `name` back as `Prompt`s, in stored order."""
  dataset = tfds_io.open_dataset(data_dir, name)
  if dataset.kind != PromptSetBuilder.name:
    raise BadInputError(
        f"dataset {name!r} in data_dir {os.fspath(data_dir)!r} is a {dataset.kind!r} dataset, "
        "not a prompt set")
  return [Prompt(id=r["id"], text=r["text"]) for r in dataset]
