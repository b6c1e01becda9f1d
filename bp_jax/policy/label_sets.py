"""Block-size label sets: the per-prompt, per-size decode measurements written by train.py's
labels stage (TFDS array_record), and the label rules computed from them.

Reading a label set is not training: decode.py's `block_policy=oracle` and the report read them
here. Label rules (ties go to the smaller size):
  max_tau         the size with the highest τ;
  max_throughput  the size with the most committed tokens per second, where a cycle of size b
                  costs the median over prompts of (loop time / cycles) at size b
                  (`cycle_costs`); for labels measured with AR fallback steps each prompt's own
                  measured loop time is used (`decode_seconds`).
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from bp_jax.data import tfds_io
from bp_jax.errors import BadInputError
from bp_jax.policy.mlp import check_label_rule

LABELS, EVAL_LABELS = "policy_labels", "policy_eval_labels"


# ---- datasets --------------------------------------------------------------------------------


class LabelSetBuilder(tfds_io.OrderedArrayRecordBuilder):
  """Per-prompt, per-size decode measurements and policy features (one example per prompt)."""

  name = "block_size_labels"

  def __init__(self, *, data_dir: str | os.PathLike, name: str,
               records: Iterator[Mapping[str, Any]], num_sizes: int,
               feature_dims: Mapping[str, int], description: str = "", overwrite: bool = False):
    self._records, self._K, self._dims = records, int(num_sizes), dict(feature_dims)
    super().__init__(data_dir=data_dir, name=name, description=description, overwrite=overwrite)

  def _features(self) -> tfds.features.FeaturesDict:
    K = self._K
    vec = lambda dtype: tfds.features.Tensor(shape=(K,), dtype=dtype)
    spec = {"key": tfds.features.Text(), "source": tfds.features.Text(),
            "text_hash": tfds.features.Text(), "split": tfds.features.Text(),
            "prompt_len": tfds.features.Scalar(dtype=np.int32),
            "prefill_s": tfds.features.Scalar(dtype=np.float32),
            "ar_fallback": tfds.features.Scalar(dtype=np.int32),
            "block_sizes": vec(np.int32), "tau": vec(np.float32), "committed": vec(np.int32),
            "new_tokens": vec(np.int32), "cycles": vec(np.int32), "decode_s": vec(np.float32),
            "accept_lens": tfds.features.Tensor(shape=(None,), dtype=np.int32)}
    for f, dim in self._dims.items():
      spec[f"feat_{f}"] = tfds.features.Tensor(shape=(dim,), dtype=np.float32)
    return tfds.features.FeaturesDict(spec)

  def _examples(self) -> Iterator[dict[str, Any]]:
    yield from self._records


def write_label_set(data_dir: str, name: str, records: Sequence[Mapping[str, Any]],
                    description: str) -> tfds_io.Dataset:
  """Writes (replacing) label dataset `name` from `label_record` dicts and opens it."""
  if not records:
    raise BadInputError(f"dataset {name!r}: no labelled prompts to write")
  dims = {k[len("feat_"):]: int(np.size(v)) for k, v in records[0].items()
          if k.startswith("feat_")}
  builder = LabelSetBuilder(data_dir=data_dir, name=name, records=iter(records),
                            num_sizes=len(records[0]["block_sizes"]), feature_dims=dims,
                            description=description, overwrite=True)
  builder.build()
  return tfds_io.open_dataset(data_dir, name)


def open_label_set(path: str) -> tfds_io.Dataset:
  """A label dataset from '<data_dir>/<name>' (e.g. runs/demo/data/policy_eval_labels)."""
  data_dir, name = os.path.split(os.path.normpath(path))
  if not name or not os.path.isdir(data_dir or "."):
    raise BadInputError(f"labels dataset {path!r}: give '<data dir>/<name>', e.g. "
                        f"runs/demo/data/{EVAL_LABELS}")
  ds = tfds_io.open_dataset(data_dir or ".", name)
  if ds.kind != LabelSetBuilder.name:
    raise BadInputError(f"dataset {path!r} is a {ds.kind!r} dataset, not block-size labels")
  return ds


# ---- label rules -----------------------------------------------------------------------------


def stack(records: Sequence[Mapping[str, Any]], field: str) -> np.ndarray:
  return np.stack([np.asarray(r[field]) for r in records])


def cycle_costs(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """[K] seconds per cycle of each size: the median over prompts of loop time / cycles."""
  cyc, sec = stack(records, "cycles"), stack(records, "decode_s")
  out = []
  for k in range(cyc.shape[1]):
    ok = cyc[:, k] > 0
    out.append(float(np.median(sec[ok, k] / cyc[ok, k])) if ok.any() else float("nan"))
  return np.asarray(out)


def decode_seconds(records: Sequence[Mapping[str, Any]],
                   costs: np.ndarray | None = None) -> np.ndarray:
  """[N, K] loop seconds per prompt and size for the throughput rule: cycles * the size's
  cycle cost (`costs`, default `cycle_costs`), or, for labels measured with AR fallback steps,
  the measured loop time itself (module docstring)."""
  if any(int(r.get("ar_fallback", 0)) > 0 for r in records):
    return stack(records, "decode_s").astype(np.float64)
  costs = cycle_costs(records) if costs is None else np.asarray(costs)
  return stack(records, "cycles").astype(np.float64) * costs[None, :]


def label_values(records: Sequence[Mapping[str, Any]], rule: str,
                 costs: np.ndarray | None = None) -> np.ndarray:
  """[N, K] what each rule maximises: τ (max_tau) or estimated committed tokens per second
  (max_throughput: new tokens / `decode_seconds`)."""
  check_label_rule(rule)
  if rule == "max_tau":
    return stack(records, "tau").astype(np.float64)
  cyc = stack(records, "cycles").astype(np.float64)
  new = stack(records, "new_tokens").astype(np.float64)
  return np.where(cyc > 0, new / np.maximum(decode_seconds(records, costs), 1e-12), 0.0)


def usable(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """[N] bool: prompts with at least one cycle at every size (others cannot be labelled)."""
  return (stack(records, "cycles") > 0).all(axis=1)


def labels_of(values_NK: np.ndarray) -> np.ndarray:
  """[N] class = argmax over sizes; ties go to the smaller size (the first maximum)."""
  return np.argmax(values_NK, axis=1).astype(np.int32)


def oracle_table(path: str, rule: str) -> tuple[dict[str, int], tuple[int, ...]]:
  """({prompt hash: best size under `rule`}, candidate sizes) from a label dataset."""
  check_label_rule(rule, "--config.label_rule")
  records = list(open_label_set(path))
  sizes = tuple(int(b) for b in records[0]["block_sizes"])
  values = label_values(records, rule)
  best = labels_of(values)
  return {r["text_hash"]: sizes[int(c)] for r, c in zip(records, best)}, sizes
