"""The `draft` stage: train a DFlash drafter against the frozen target
(docs/design.md §6), then export it.

Inputs: `<workdir>/target` (stage lm) and the datasets `regen_train` / `regen_val` (stage
regenerate, made by that same target). The drafter takes its sizes from the target (hidden,
MLP, heads, RoPE, vocabulary) and `cfg.draft` (num_layers, block_size, target_layer_ids, gamma),
its mask token from the tokenizer (`<|mask|>`). Training uses `bp_jax.train.loop.train` with
`draft_objective.make_draft_loss_fn` (anchors re-sampled every step from the step's rng); the
validation metric is the expected acceptance length on the held-out sequences (fixed anchors).
The result is `<workdir>/drafter`, a converted "dflash" checkpoint that `loading.load_drafter`
and `decode.py --config.drafter` load; its metadata records the target's fingerprint, and
`check_drafter_target` refuses to pair it with any other target.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.models.config import DFlashConfig, Qwen3Config, default_target_layer_ids
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.errors import BadInputError
from bp_jax.parallel.mesh import make_mesh
from bp_jax.parallel.rules import shard_state
from bp_jax.eval.resources import peak_rss_mb
from bp_jax.train import draft_objective as obj
from bp_jax.train import workdir as wd
from bp_jax.models.dflash import refuse_last_layer_features
from bp_jax.train.regenerate import (REGEN_TRAIN, REGEN_VAL, model_fingerprint, read_stamp,
                                     regen_stamp_dir, write_stamp)

EXPORT_DTYPES = ("float32", "bfloat16")
RUN_STAMP = "bp_jax_stage.json"


# ---- configuration ---------------------------------------------------------------------------


def choose_target_layer_ids(num_target_layers: int, num_draft_layers: int,
                            given: Sequence[int] | None) -> tuple[int, ...]:
  """The target layers whose hidden states feed the drafter.

  `given` (non-empty) is used as is, after checks. Otherwise DFlash's default
  (`config.default_target_layer_ids`), unless it repeats a layer or leaves 0..L-2 (small
  targets: L=4, n=2 gives [1, 1]); then n distinct layers evenly spaced over 1..L-2. The last
  layer L-1 is never used (see `dflash.refuse_last_layer_features`).

  Raises:
    BadInputError: ids out of range, repeated or including layer L-1, or no n distinct layers
      below L-1 exist.
  """
  L, n = num_target_layers, num_draft_layers
  if given:
    ids = tuple(int(i) for i in given)
    flag = f"--config.draft.target_layer_ids={list(ids)}"
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
      raise BadInputError(f"{flag}: {bad} out of range for a target with {L} layers")
    if len(set(ids)) != len(ids):
      raise BadInputError(f"{flag} repeats a layer")
    refuse_last_layer_features(ids, L, flag)
    return ids
  ids = default_target_layer_ids(L, n)
  if len(set(ids)) == n and set(ids) <= set(range(L - 1)):
    return ids
  lo, hi = (1, L - 2) if L >= 3 else (0, L - 2)
  ids = tuple(int(round(x)) for x in np.linspace(lo, hi, n)) if hi >= lo else ()
  if len(set(ids)) != n:
    raise BadInputError(f"cannot choose {n} distinct target layers below the last of a {L}-layer "
                        "target by default; set --config.draft.target_layer_ids")
  return ids


def drafter_config(target_cfg: Qwen3Config, draft_cfg: Any, mask_token_id: int) -> DFlashConfig:
  """The drafter's config: the target's sizes with `draft_cfg.num_layers` layers."""
  num_layers, block_size = int(draft_cfg.num_layers), int(draft_cfg.block_size)
  if num_layers < 1:
    raise BadInputError(f"--config.draft.num_layers={num_layers} must be >= 1")
  if block_size < 2:
    raise BadInputError(f"--config.draft.block_size={block_size} must be >= 2")
  if not 0 <= mask_token_id < target_cfg.vocab_size:
    raise BadInputError(f"mask token id {mask_token_id} is outside the target's vocabulary "
                        f"(vocab_size={target_cfg.vocab_size})")
  t = target_cfg
  layers = Qwen3Config(
      vocab_size=t.vocab_size, hidden_size=t.hidden_size,
      intermediate_size=int(draft_cfg.get("intermediate_size", 0) or t.intermediate_size),
      num_hidden_layers=num_layers, num_attention_heads=t.num_attention_heads,
      num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
      rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, tie_word_embeddings=False,
      max_position_embeddings=t.max_position_embeddings)
  ids = choose_target_layer_ids(t.num_hidden_layers, num_layers,
                                draft_cfg.get("target_layer_ids", None))
  return DFlashConfig(layers=layers, block_size=block_size,
                      num_target_layers=t.num_hidden_layers, mask_token_id=int(mask_token_id),
                      target_layer_ids=ids)


def mask_token_id_of(tok: Any, draft_cfg: Any) -> int:
  """`cfg.draft.mask_token_id` when set (>= 0), else the tokenizer's mask token (`<|mask|>`)."""
  given = draft_cfg.get("mask_token_id", None)
  if given is not None and int(given) >= 0:
    return int(given)
  mask = getattr(tok, "mask_token_id", None)
  if mask is None:
    raise BadInputError("the tokenizer has no mask token (the DFlash block filler); set "
                        "--config.draft.mask_token_id")
  return int(mask)


# ---- data ------------------------------------------------------------------------------------


class Subset(Sequence):
  """Random access to some examples of a dataset, by index."""

  def __init__(self, source: Sequence, indices: Sequence[int]):
    self._source, self._indices = source, list(indices)

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, i: int) -> Any:
    return self._source[self._indices[i]]

  def __getitems__(self, idx: Sequence[int]) -> list:
    getitems = getattr(self._source, "__getitems__", None)
    keys = [self._indices[int(i)] for i in idx]
    return list(getitems(keys)) if getitems else [self._source[k] for k in keys]


def check_sequences(source: Sequence, name: str, block_size: int, seq_len: int,
                    drop_short: bool = False) -> Sequence:
  """Checks that every sequence leaves room for at least one block after its prompt.

  A sequence (cut to `seq_len`) is usable when `max(prompt_len, 1) <= length - block_size`,
  i.e. its response holds at least `block_size` tokens past the first anchor position.

  Returns:
    `source`, or with `drop_short` the subset of usable sequences.

  Raises:
    BadInputError: naming the first short sequence (unless `drop_short`), or no usable sequence.
  """
  keep, short = [], []
  for i, rec in enumerate(source):
    n = min(len(rec["tokens"]), seq_len)
    if max(int(rec["prompt_len"]), 1) <= n - block_size:
      keep.append(i)
    else:
      short.append((i, rec["id"], int(rec["prompt_len"]), n))
  if short and not drop_short:
    i, sid, p, n = short[0]
    raise BadInputError(
        f"dataset {name!r}: sequence {sid!r} (record {i}) has {n} tokens after a prompt of {p}: "
        f"its response is shorter than a block of {block_size} tokens, so no block can be "
        f"trained on it ({len(short)} such sequence(s)); regenerate with a larger "
        "--config.regenerate.max_new_tokens, lower --config.draft.block_size, or set "
        "--config.draft.drop_short=True to skip them")
  if not keep:
    raise BadInputError(f"dataset {name!r}: no sequence leaves room for a block of {block_size}")
  return Subset(source, keep) if short else source


def draft_batches_fn(source: Sequence, batch_size: int, seq_len: int, seed: int,
                     pad_id: int) -> Callable[[int], Iterator[dict[str, np.ndarray]]]:
  """`batches_fn` for the loop: shuffled epochs of {tokens, loss_mask, lengths, prompt_lens}."""
  from bp_jax.data import batches

  if len(source) < batch_size:
    raise BadInputError(f"the drafter's training data hold {len(source)} sequences, fewer than "
                        f"one batch of --config.draft.batch={batch_size}")

  def batches_fn(epoch: int) -> Iterator[dict[str, np.ndarray]]:
    yield from batches(source, batch_size, seq_len, seed, epoch, pad_id)

  return batches_fn


def _fixed_batches(source: Sequence, batch_size: int, seq_len: int, pad_id: int,
                   num_batches: int) -> list[dict[str, np.ndarray]]:
  """The validation batches, in stored order; the last is padded with empty rows (no anchors)."""
  from bp_jax.data import pad_batch

  n = len(source)
  if num_batches > 0:
    n = min(n, num_batches * batch_size)
  out = []
  for start in range(0, n, batch_size):
    records = [source[i] for i in range(start, min(start + batch_size, n))]
    batch = pad_batch(records, seq_len, pad_id)
    rows = len(records)
    if rows < batch_size:
      batch = {k: np.concatenate([v, np.zeros((batch_size - rows, *v.shape[1:]), v.dtype)])
               for k, v in batch.items()}
      batch["tokens"][rows:] = pad_id
    out.append(batch)
  return out


def make_draft_eval_fn(target_graphdef: Any, val_source: Sequence, *, batch_size: int,
                       seq_len: int, pad_id: int, block_size: int, num_anchors: int,
                       gamma: float, num_batches: int = 0, seed: int = 0,
                       loss: obj.DraftLoss = obj.DraftLoss()
                       ) -> Callable[[nnx.Module, Any], dict[str, float]]:
  """The loop's `eval_fn(drafter, frozen)` over held-out sequences.

  Anchors are drawn from a fixed key per batch, so successive evaluations score the same blocks.
  Returns loss (the weighted objective, `loss`), ce (the weighted CE), accuracy (top-1 at draft
  positions) and acceptance_length (the expected acceptance length,
  `draft_objective.expected_acceptance_length`), and with a soft objective kl and tv_acceptance
  (mean 1 - TV(p_t, q_t)), each aggregated over all evaluated blocks.
  """
  batches = _fixed_batches(val_source, batch_size, seq_len, pad_id, num_batches)

  def sums(d_graph, d_state, frozen, batch, rng):
    m = obj.draft_forward_metrics(nnx.merge(d_graph, d_state), nnx.merge(target_graphdef, frozen),
                                  batch, rng, block_size=block_size, num_anchors=num_anchors,
                                  gamma=gamma, loss=loss)
    return {k: m[k] for k in ("objective_sum", "ce_sum", "weight_sum", "correct_sum", "positions",
                              "acceptance_sum", "blocks", "kl_sum", "tv_acceptance_sum")
            if k in m}

  sums_jit = jax.jit(sums, static_argnums=0)

  def eval_fn(drafter: nnx.Module, frozen: Any) -> dict[str, float]:
    graph, state = nnx.split(drafter)
    total: dict[str, float] = {}
    for i, batch in enumerate(batches):
      rng = jax.random.fold_in(jax.random.PRNGKey(seed), i)
      out = jax.device_get(sums_jit(graph, state, frozen, batch, rng))
      for k, v in out.items():
        total[k] = total.get(k, 0.0) + float(v)
    w = max(total["weight_sum"], 1e-9)
    out = {"loss": total["objective_sum"] / w, "ce": total["ce_sum"] / w,
           "accuracy": total["correct_sum"] / max(total["positions"], 1.0),
           "acceptance_length": total["acceptance_sum"] / max(total["blocks"], 1.0),
           "blocks": total["blocks"]}
    if "kl_sum" in total:
      out["kl"] = total["kl_sum"] / w
      out["tv_acceptance"] = total["tv_acceptance_sum"] / max(total["positions"], 1.0)
    return out

  return eval_fn


# ---- export and checks -----------------------------------------------------------------------


def export_drafter(drafter: DFlashDrafter, out_dir: str, target: Any, dtype: str = "float32",
                   extra_meta: dict | None = None) -> str:
  """Saves the drafter as a converted "dflash" checkpoint at `out_dir` (replacing one there).

  The metadata records the target it was trained against (`target_fingerprint`, `target_config`).
  """
  from bp_jax.weights.checkpoint_io import save_checkpoint
  from bp_jax.models.nnx_utils import module_params

  if dtype not in EXPORT_DTYPES:
    raise BadInputError(f"--config.draft.export_dtype={dtype!r} is not one of "
                        f"{list(EXPORT_DTYPES)}")
  params = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype)), module_params(drafter))
  meta = {"kind": "dflash", "made_by": "train.py draft stage",
          "target_fingerprint": model_fingerprint(target),
          "target_config": target.cfg.to_hf_dict(), **(extra_meta or {})}
  return save_checkpoint(out_dir, params, drafter.cfg.to_hf_dict(), meta, overwrite=True)


def check_drafter_target(drafter_dir: str, target: Any, target_source: str = "the target"
                         ) -> None:
  """Raises BadInputError when the drafter at `drafter_dir` was not trained against `target`.

  Checks the sizes (`dflash.validate_drafter_for_target`), and, when the drafter's metadata
  records one (drafters written by this stage), the target's parameter fingerprint.
  """
  from bp_jax.weights.checkpoint_io import read_checkpoint_meta
  from bp_jax.models.dflash import validate_drafter_for_target

  config, meta = read_checkpoint_meta(drafter_dir, expected_kind="dflash")
  validate_drafter_for_target(DFlashConfig.from_hf_dict(config, f"{drafter_dir}/config.json"),
                              target.cfg, drafter_dir)
  want = meta.get("target_fingerprint")
  if want is not None:
    have = model_fingerprint(target)
    if want != have:
      raise BadInputError(
          f"{drafter_dir}: this drafter was trained against a target with fingerprint {want}, "
          f"but {target_source} has fingerprint {have} (different weights); retrain the drafter "
          "(train.py --config.stage=draft) or load the target it was trained with")


def _differences(old: Any, new: Any, name: str) -> list[str]:
  """'name.key: old -> new' for each differing leaf of two JSON-like values."""
  if isinstance(old, dict) and isinstance(new, dict):
    return [d for k in sorted(set(old) | set(new))
            for d in _differences(old.get(k), new.get(k), f"{name}.{k}")]
  return [] if old == new else [f"{name}: {old!r} -> {new!r}"]


def _check_run_dir(run_dir: str, want: dict) -> None:
  """Refuses to resume a drafter run made against another target or drafter config."""
  stamp = read_stamp(run_dir)
  if stamp is None:
    if os.path.isdir(os.path.join(run_dir, "checkpoints")):
      raise BadInputError(f"{run_dir} holds drafter checkpoints of unknown origin (no "
                          f"{RUN_STAMP}); delete the folder or use a fresh workdir")
    write_stamp(run_dir, want)
    return
  diffs = [d for key, value in want.items() for d in _differences(stamp.get(key), value, key)]
  if diffs:
    raise BadInputError(
        f"{run_dir} holds a drafter run made with other settings ({'; '.join(diffs[:4])}"
        f"{'; ...' if len(diffs) > 4 else ''}): the target or the drafter config changed; "
        f"delete {run_dir} or use a fresh workdir")


# ---- the stage -------------------------------------------------------------------------------


def start_from_drafter(drafter: DFlashDrafter, path: str, target: Any, target_path: str) -> None:
  """Loads the drafter checkpoint at `path` (`--config.draft.init_from`) into `drafter` (to
  fine-tune it, e.g. a greedy-trained drafter distilled for sampling). It must have the same
  config and have been made for this target.

  Raises:
    BadInputError: another config (naming the differing fields) or another target.
  """
  from bp_jax.weights.loading import load_drafter
  check_drafter_target(path, target, target_path)
  start = load_drafter(path, target.cfg, "float32")
  have, want = start.cfg.to_hf_dict(), drafter.cfg.to_hf_dict()
  diffs = _differences(have, want, "config")
  if diffs:
    raise BadInputError(f"--config.draft.init_from={path}: its config differs from the drafter "
                        f"being trained ({'; '.join(diffs[:4])}); set --config.draft sizes to "
                        "match it")
  nnx.update(drafter, nnx.state(start))


def draft_loss_of(d: Any) -> obj.DraftLoss:
  """`cfg.draft`'s objective (loss, distill_temperature, mix_weight, ce_label), checked by
  `DraftLoss` (errors name the flag)."""
  return obj.DraftLoss(str(d.get("loss", "ce")), float(d.get("distill_temperature", 1.0)),
                       float(d.get("mix_weight", 0.5)), str(d.get("ce_label", "data")))


def draft_stage(cfg: Any) -> None:
  """Trains the drafter on regen_train, validates on regen_val, exports `<workdir>/drafter`.

  Fields of `cfg.draft`: num_layers, block_size, gamma (0 = docs/design.md §6 default for the block
  size), anchors_per_seq, batch, steps, opt, target_layer_ids (empty = default), export_dtype;
  optional: seq_len (default: the longest sequence), eval_every (default steps // 4),
  eval_batches (0 = all of regen_val), checkpoint_every (default 100), log_every (default 10),
  drop_short (False), mask_token_id (-1 = the tokenizer's), intermediate_size (0 = target's),
  loss (ce | kl | tvd | mix, `draft_objective.DraftLoss`), distill_temperature (1.0),
  mix_weight (0.5), ce_label (data | argmax), ship_name (the folder under export_dir, default
  `drafter`), init_from (a drafter checkpoint to start from instead of a random init, e.g. to
  distil it for sampling).
  """
  from bp_jax.weights.loading import load_drafter, load_target
  from bp_jax.text.tokenizer import load_tokenizer
  from bp_jax.train.loop import train

  d = cfg.draft
  target_path = wd.require_checkpoint(wd.target_dir(cfg), "qwen3", "draft", "lm")
  mesh = make_mesh(str(cfg.get("mesh", "") or ""))
  target = load_target(target_path, cfg.get("dtype") or None, mesh=mesh)
  fingerprint = model_fingerprint(target)
  tok = load_tokenizer(target_path)
  train_src = wd.require_dataset(cfg, REGEN_TRAIN, "draft", "regenerate")
  val_src = wd.require_dataset(cfg, REGEN_VAL, "draft", "regenerate")
  regen = read_stamp(regen_stamp_dir(cfg)) or {}
  if regen.get("target_fingerprint") not in (None, fingerprint):
    raise BadInputError(
        f"datasets {REGEN_TRAIN}/{REGEN_VAL} in {wd.data_dir(cfg)} were regenerated by a target "
        f"with fingerprint {regen['target_fingerprint']}, but {target_path} has {fingerprint}: "
        "rerun the 'regenerate' stage (--config.stage=regenerate)")

  dcfg = drafter_config(target.cfg, d, mask_token_id_of(tok, d))
  b = dcfg.block_size
  gamma = float(d.get("gamma", 0) or 0) or obj.default_gamma(b)
  loss = draft_loss_of(d)
  init_from = str(d.get("init_from", "") or "")
  num_anchors, batch_size, steps = int(d.anchors_per_seq), int(d.batch), int(d.steps)
  if num_anchors < 1 or batch_size < 1:
    raise BadInputError("--config.draft.anchors_per_seq and --config.draft.batch must be >= 1")
  seq_len = int(d.get("seq_len", 0) or max(len(r["tokens"]) for r in train_src))
  if seq_len > target.cfg.max_position_embeddings:
    raise BadInputError(f"drafter training sequences of {seq_len} tokens exceed the target's "
                        f"max_position_embeddings={target.cfg.max_position_embeddings}")
  drop_short = bool(d.get("drop_short", False))
  train_src = check_sequences(train_src, REGEN_TRAIN, b, seq_len, drop_short)
  val_src = check_sequences(val_src, REGEN_VAL, b, seq_len, drop_short)

  run_dir = wd.run_dir(cfg, "draft")
  _check_run_dir(run_dir, {"stage": "draft", "target_fingerprint": fingerprint,
                           "drafter_config": dcfg.to_hf_dict(), "seq_len": seq_len,
                           "gamma": gamma, "anchors_per_seq": num_anchors,
                           "loss": dataclasses.asdict(loss),
                           **({"init_from": init_from} if init_from else {})})
  seed = int(cfg.seed)
  drafter = DFlashDrafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
  if init_from:
    start_from_drafter(drafter, init_from, target, target_path)
  t_graph, t_state = nnx.split(target)
  pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
  eval_fn = make_draft_eval_fn(t_graph, val_src, batch_size=batch_size, seq_len=seq_len,
                               pad_id=pad_id, block_size=b, num_anchors=num_anchors, gamma=gamma,
                               num_batches=int(d.get("eval_batches", 0) or 0), seed=seed,
                               loss=loss)
  result = train(
      workdir=run_dir, model=drafter,
      loss_fn=obj.make_draft_loss_fn(t_graph, block_size=b, num_anchors=num_anchors,
                                     gamma=gamma, loss=loss),
      batches_fn=draft_batches_fn(train_src, batch_size, seq_len, seed, pad_id),
      num_steps=steps, opt_cfg=d.opt, frozen=shard_state(t_state, mesh), eval_fn=eval_fn,
      eval_every=int(d.get("eval_every", 0) or max(1, steps // 4)),
      checkpoint_every=int(d.get("checkpoint_every", 0) or 100), seed=seed, desc="draft",
      log_every=int(d.get("log_every", 0) or 10), mesh=mesh)

  out = export_drafter(result.model, wd.drafter_dir(cfg), target,
                       str(d.get("export_dtype", "float32")),
                       {"train_steps": result.step, "loss": dataclasses.asdict(loss),
                        "regenerate": {k: regen.get(k) for k in ("temperature", "also_greedy")},
                        "eval_acceptance_length": result.eval_metrics.get(
                            "eval_acceptance_length")})
  load_drafter(out, target.cfg)  # loads as decode.py will
  check_drafter_target(out, target, target_path)
  shipped = wd.ship_checkpoint(cfg, out, str(d.get("ship_name", "drafter") or "drafter"))
  summary_path = os.path.join(run_dir, "summary.json")
  tokens_per_s = round(result.tokens_per_s, 1)
  if result.start_step >= result.step and os.path.exists(summary_path):  # nothing trained now
    with open(summary_path, encoding="utf-8") as f:
      tokens_per_s = json.load(f).get("response_tokens_per_s", tokens_per_s)
  summary = {"steps": result.step, "resumed_from": result.start_step,
             "block_size": b, "gamma": gamma, "loss": dataclasses.asdict(loss), "anchors_per_seq": num_anchors, "seq_len": seq_len,
             "target_layer_ids": list(dcfg.target_layer_ids),
             "train_loss": result.last_metrics.get("loss"),
             "train_acceptance_length": result.last_metrics.get("acceptance_length"),
             **result.eval_metrics,
             "response_tokens_per_s": tokens_per_s, "peak_rss_mb": peak_rss_mb(),
             "num_params": int(sum(x.size for x in jax.tree.leaves(nnx.state(result.model)))),
             "checkpoint": out, "shipped": shipped}
  with open(summary_path, "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  print(f"[draft] {result.step} steps; train loss {summary['train_loss']}, eval loss "
        f"{summary.get('eval_loss')}, expected acceptance length (b={b}) "
        f"{summary.get('eval_acceptance_length')}; {summary['response_tokens_per_s']:,} "
        f"response tokens/s; exported {out}" + (f", shipped to {shipped}" if shipped else ""))
