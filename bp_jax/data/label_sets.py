"""Block-size label sets: the per-prompt, per-size decode measurements written by train.py's
labels stage (TFDS array_record), and the label rules computed from them.

Reading a label set is not training: decode.py's `block_policy=oracle` and the report read them
here. Each label set records the decode settings it was measured with (`decode_settings`: new
tokens, temperature, chat template and the loops' form) in its TFDS metadata (metadata.json in
the dataset's folder), so an oracle run with other settings is refused
(`check_decode_settings`).

Per prompt and size a record holds (one meaning each, as `decoding.generation`): `tau`, the
committed tokens per speculative cycle (mean over the prompt's cycles, pooled over its label
seeds); `tokens_per_forward`, committed tokens per target forward (cycles and the AR fallback's
steps); `cycles` (speculative cycles), `forwards` (target forwards), `committed` (tokens the
loop committed: new tokens - 1 per seed), `new_tokens`, `decode_s` (loop seconds), and the loop's
schedule: `accept_lens` (every forward's committed tokens) with the parallel `forward_is_cycle`.

Label rules (ties go to the smaller size):
  max_tau         the size with the highest τ (per speculative cycle);
  max_throughput  the size with the most committed tokens per second. A label set made with a
                  cost table (`bp_jax.train.cost_table`, stored in its metadata under
                  `cost_table`) prices each run as its deterministic counts times the table:
                  cycles * seconds per cycle of its size + AR fallback steps * seconds per
                  step, so two labelling runs on one machine give the same labels. Older sets:
                  a cycle of size b costs the median over prompts of (loop time / cycles)
                  (`cycle_costs`), and with AR fallback steps each prompt's own measured loop
                  time is used (`decode_seconds`).
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
SETTINGS_KEY = "decode_settings"  # the label set's metadata entry holding `decode_settings`
COST_KEY = "cost_table"  # the metadata entry holding the cost table the labels are priced with

# Decode setting -> (decode.py's flag, the labels stage's flag).
SETTING_FLAGS: dict[str, tuple[str, str]] = {
    "max_new_tokens": ("--config.max_new_tokens", "--config.blockpilot.max_new_tokens"),
    "temperature": ("--config.temperature", "--config.blockpilot.temperature"),
    "chat": ("--config.chat", "--config.chat"),
    "scan_layers": ("--config.scan_layers", "--config.scan_layers"),
    "ar_fallback": ("--config.ar_fallback", "--config.ar_fallback"),
    "ar_fallback_accept": ("--config.ar_fallback_accept", "--config.ar_fallback_accept"),
    "verify": ("--config.verify", "--config.verify"),
    "top_k": ("--config.top_k", "--config.top_k"),
    "top_p": ("--config.top_p", "--config.top_p"),
    "min_p": ("--config.min_p", "--config.min_p"),
    "controller": ("--config.controller", "--config.controller"),
}
# Settings only sampling reads (ignored when both sides decode greedily), and the value a label
# set made before they were recorded was measured with.
SAMPLING_SETTINGS = {"verify": "exact", "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def decode_settings(max_new_tokens: int, temperature: float, chat: bool,
                    loop: Mapping[str, Any],
                    sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The settings a label set's measurements depend on; `loop` is `block_choice.loop_options`,
  `sampling` `block_choice.sampling_options` (top_k, top_p, min_p; None = off). The controller
  is the one label sets are measured under (`controller.labelled_as`: `priced` as backoff)."""
  from bp_jax.decoding.controller import labelled_as, loop_form

  sampling = {**SAMPLING_SETTINGS, **(sampling or {})}
  controller, _ = loop_form(labelled_as(loop.get("controller")), int(loop["ar_fallback"]))
  return {"controller": controller, "max_new_tokens": int(max_new_tokens),
          "temperature": float(temperature), "chat": bool(chat),
          "scan_layers": bool(loop["scan_layers"]),
          "ar_fallback": int(loop["ar_fallback"]),
          "ar_fallback_accept": int(loop["ar_fallback_accept"]),
          "verify": str(loop.get("verify", "exact")), "top_k": int(sampling["top_k"]),
          "top_p": float(sampling["top_p"]), "min_p": float(sampling["min_p"])}


# Per-size figures of a record (one [K] vector each) and their stored dtypes.
SIZE_FIGURES = {"tau": np.float32, "tokens_per_forward": np.float32, "committed": np.int32,
                "new_tokens": np.int32, "cycles": np.int32, "forwards": np.int32,
                "decode_s": np.float32}


# ---- datasets --------------------------------------------------------------------------------


class LabelSetBuilder(tfds_io.OrderedArrayRecordBuilder):
  """Per-prompt, per-size decode measurements and policy features (one example per prompt)."""

  name = "block_size_labels"

  def __init__(self, *, data_dir: str | os.PathLike, name: str,
               records: Iterator[Mapping[str, Any]], num_sizes: int,
               feature_dims: Mapping[str, int], settings: Mapping[str, Any],
               cost_table: Mapping[str, Any] | None = None,
               description: str = "", overwrite: bool = False):
    self._records, self._K, self._dims = records, int(num_sizes), dict(feature_dims)
    self._settings = dict(settings)
    self._cost_table = dict(cost_table) if cost_table else None
    super().__init__(data_dir=data_dir, name=name, description=description, overwrite=overwrite)

  def _metadata(self) -> dict[str, Any]:
    # The decode settings (and the cost table the labels are priced with), saved as
    # metadata.json with the data.
    meta: dict[str, Any] = {SETTINGS_KEY: self._settings}
    if self._cost_table:
      meta[COST_KEY] = self._cost_table
    return meta

  def _features(self) -> tfds.features.FeaturesDict:
    K = self._K
    vec = lambda dtype: tfds.features.Tensor(shape=(K,), dtype=dtype)
    spec = {"key": tfds.features.Text(), "source": tfds.features.Text(),
            "text_hash": tfds.features.Text(), "split": tfds.features.Text(),
            "prompt_len": tfds.features.Scalar(dtype=np.int32),
            "prefill_s": tfds.features.Scalar(dtype=np.float32),
            "ar_fallback": tfds.features.Scalar(dtype=np.int32),
            "block_sizes": vec(np.int32), **{f: vec(t) for f, t in SIZE_FIGURES.items()},
            "accept_lens": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "forward_is_cycle": tfds.features.Tensor(shape=(None,), dtype=np.bool_)}
    for f, dim in self._dims.items():
      spec[f"feat_{f}"] = tfds.features.Tensor(shape=(dim,), dtype=np.float32)
    return tfds.features.FeaturesDict(spec)

  def _examples(self) -> Iterator[dict[str, Any]]:
    yield from self._records


def write_label_set(data_dir: str, name: str, records: Sequence[Mapping[str, Any]],
                    description: str, settings: Mapping[str, Any],
                    cost_table: Mapping[str, Any] | None = None) -> tfds_io.Dataset:
  """Writes (replacing) label dataset `name` from `label_record` dicts, with the
  `decode_settings` they were measured with and the cost table that prices them, and opens
  it."""
  if not records:
    raise BadInputError(f"dataset {name!r}: no labelled prompts to write")
  dims = {k[len("feat_"):]: int(np.size(v)) for k, v in records[0].items()
          if k.startswith("feat_")}
  builder = LabelSetBuilder(data_dir=data_dir, name=name, records=iter(records),
                            num_sizes=len(records[0]["block_sizes"]), feature_dims=dims,
                            settings=settings, cost_table=cost_table, description=description,
                            overwrite=True)
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


def label_set_settings(ds: tfds_io.Dataset) -> dict[str, Any] | None:
  """The `decode_settings` a label set was made with, or None for a set made before they were
  recorded."""
  settings = dict(ds.info.metadata or {}).get(SETTINGS_KEY)
  return dict(settings) if settings else None


def label_set_costs(ds: tfds_io.Dataset) -> dict[str, Any] | None:
  """The cost table a label set's `max_throughput` labels are priced with (None: a set made
  before cost tables, priced from its own timings)."""
  table = dict(ds.info.metadata or {}).get(COST_KEY)
  return dict(table) if table else None


def _setting(d: Mapping[str, Any], name: str) -> Any:
  """A recorded setting; sets made before `controller` was recorded ran `backoff` with fallback
  steps and `none` without."""
  if name == "controller" and name not in d:
    return "backoff" if d.get("ar_fallback") else "none"
  return d.get(name, SAMPLING_SETTINGS.get(name))


def _differences(have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
  """The settings in which `have` and `want` differ (the accept threshold only matters with AR
  fallback steps)."""
  get = _setting
  names = [k for k in SETTING_FLAGS if get(have, k) != get(want, k)]
  if not have.get("ar_fallback") and not want.get("ar_fallback"):
    names = [k for k in names if k != "ar_fallback_accept"]
  if not have.get("temperature") and not want.get("temperature"):
    names = [k for k in names if k not in SAMPLING_SETTINGS]
  return names


def check_decode_settings(path: str, ds: tfds_io.Dataset, want: Mapping[str, Any]) -> None:
  """Refuses the label set at `path` unless it was measured with the decode settings `want`.

  Raises:
    BadInputError: a label set without recorded settings, or one made with other settings
      (naming them, the label set's values and the flags to change).
  """
  have = label_set_settings(ds)
  if have is None:
    raise BadInputError(f"labels dataset {path!r} does not record the decode settings it was "
                        "made with (an older label set): relabel it with train.py "
                        "--config.stage=labels")
  diffs = _differences(have, want)
  if diffs:
    made = ", ".join(f"{k}={have.get(k)}" for k in diffs)
    ours = ", ".join(f"{k}={want.get(k)}" for k in diffs)
    flags = " ".join(f"{SETTING_FLAGS[k][0]}={have.get(k)}" for k in diffs)
    relabel = ", ".join(sorted({SETTING_FLAGS[k][1] for k in diffs}))
    raise BadInputError(f"labels dataset {path!r} was made with {made} but this decode uses "
                        f"{ours}: decode with {flags}, or relabel with train.py "
                        f"--config.stage=labels and {relabel} set to this decode's values")


# ---- label rules -----------------------------------------------------------------------------


def stack(records: Sequence[Mapping[str, Any]], field: str) -> np.ndarray:
  """[N, ...] `field` of every record; a label set made before the field was recorded (e.g.
  `forwards`, `tokens_per_forward`) is refused."""
  if any(field not in r for r in records):
    raise BadInputError(f"label records without {field!r}: a label set made by an older labels "
                        "stage; relabel it with train.py --config.stage=labels")
  return np.stack([np.asarray(r[field]) for r in records])


def ar_step_seconds(records: Sequence[Mapping[str, Any]]) -> float | None:
  """Seconds per step of plain AR decoding: the median over prompts of the size-1 runs' loop
  time / target forwards; None when size 1 is not a candidate (or never ran a step)."""
  sizes = [int(b) for b in records[0]["block_sizes"]]
  if 1 not in sizes:
    return None
  k = sizes.index(1)
  fwd, sec = stack(records, "forwards")[:, k], stack(records, "decode_s")[:, k]
  ok = fwd > 0
  return float(np.median(sec[ok] / fwd[ok])) if ok.any() else None


def cycle_costs(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """[K] seconds per speculative cycle of each size: the median over prompts of the loop time
  spent in cycles / cycles. A run with AR fallback steps also spent loop time in them: they are
  charged at `ar_step_seconds` and subtracted; without a size-1 candidate to price them, only
  runs that took no AR step count. NaN where no run qualifies."""
  cyc, sec = stack(records, "cycles"), stack(records, "decode_s").astype(np.float64)
  steps = stack(records, "forwards") - cyc
  ar_step = ar_step_seconds(records)
  priced = (steps == 0) if ar_step is None else np.ones_like(steps, bool)
  in_cycles = sec - steps * (ar_step or 0.0)
  out = []
  for k in range(cyc.shape[1]):
    ok = (cyc[:, k] > 0) & priced[:, k]
    out.append(float(np.median(in_cycles[ok, k] / cyc[ok, k])) if ok.any() else float("nan"))
  return np.asarray(out)


def seconds_per_size(table: Mapping[str, Any], cycles_NK: np.ndarray, steps_NK: np.ndarray,
                     sizes: Sequence[int]) -> np.ndarray:
  """[N, K] loop seconds priced by the table: size 1 = its forwards' AR steps; size b > 1 =
  cycles * cycle_s[b] + fallback steps * fallback_step_s[b]."""
  out = np.zeros(np.shape(cycles_NK), np.float64)
  for k, b in enumerate(int(s) for s in sizes):
    if b == 1:
      out[:, k] = (cycles_NK[:, k] + steps_NK[:, k]) * float(table["ar_step_s"])
    else:
      step = float(table.get("fallback_step_s", {}).get(str(b), table["ar_step_s"]))
      out[:, k] = cycles_NK[:, k] * float(table["cycle_s"][str(b)]) + steps_NK[:, k] * step
  return out


def decode_seconds(records: Sequence[Mapping[str, Any]],
                   costs: np.ndarray | Mapping[str, Any] | None = None) -> np.ndarray:
  """[N, K] loop seconds per prompt and size for the throughput rule. `costs` a cost table
  (`label_set_costs`): the runs' counts priced by it (`seconds_per_size`).
  Otherwise cycles * the size's cycle cost (`costs` [K], default `cycle_costs`; without the
  fallback every target forward is a cycle), or, for labels measured with AR fallback steps,
  the measured loop time itself (module docstring)."""
  if isinstance(costs, Mapping):
    cyc = stack(records, "cycles")
    return seconds_per_size(costs, cyc, stack(records, "forwards") - cyc,
                            [int(b) for b in records[0]["block_sizes"]])
  if any(int(r.get("ar_fallback", 0)) > 0 for r in records):
    return stack(records, "decode_s").astype(np.float64)
  costs = cycle_costs(records) if costs is None else np.asarray(costs)
  return stack(records, "cycles").astype(np.float64) * costs[None, :]


def label_values(records: Sequence[Mapping[str, Any]], rule: str,
                 costs: np.ndarray | Mapping[str, Any] | None = None) -> np.ndarray:
  """[N, K] what each rule maximises: τ, committed tokens per speculative cycle (max_tau), or
  estimated committed tokens per second (max_throughput: new tokens / `decode_seconds`)."""
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


def oracle_table(path: str, rule: str, settings: Mapping[str, Any]
                 ) -> tuple[dict[str, int], tuple[int, ...]]:
  """({prompt hash: best size under `rule`}, candidate sizes) from a label dataset measured with
  the decode settings `settings` (`decode_settings`; any other label set is refused)."""
  check_label_rule(rule, "--config.label_rule")
  ds = open_label_set(path)
  check_decode_settings(path, ds, settings)
  records = list(ds)
  sizes = tuple(int(b) for b in records[0]["block_sizes"])
  values = label_values(records, rule, label_set_costs(ds))
  best = labels_of(values)
  return {r["text_hash"]: sizes[int(c)] for r, c in zip(records, best)}, sizes
