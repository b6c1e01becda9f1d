"""The `lm` stage: train a small Qwen3 target from scratch on packed token chunks, then export it
as a converted target checkpoint (kind "qwen3") that decode.py loads.

Training forward: `model(tokens, model.init_cache(B, T))` — a fresh cache makes positions
0..T-1 with a causal mask, so no separate no-cache path is needed (measured equally fast).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import sys
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bp_jax.models.config import Qwen3Config
from bp_jax.errors import BadInputError
from bp_jax.models.qwen3 import Qwen3
from bp_jax.eval.resources import peak_rss_mb
from bp_jax.train import workdir as wd

EXPORT_DTYPES = ("float32", "bfloat16")
_MODEL_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings")


def qwen3_config(model_cfg: Any) -> Qwen3Config:
  """A Qwen3Config from the `model` sub-config of a training config."""
  try:
    return Qwen3Config(**{k: int(model_cfg[k]) for k in _MODEL_INT_FIELDS},
                       rms_norm_eps=float(model_cfg.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(model_cfg.get("rope_theta", 10000.0)),
                       tie_word_embeddings=bool(model_cfg.get("tie_word_embeddings", True)))
  except KeyError as e:
    raise BadInputError(f"--config.model lacks field {e.args[0]!r}") from None


def build_target(model_cfg: Any, seed: int) -> Qwen3:
  """A randomly initialised float32 Qwen3 of the configured sizes."""
  return Qwen3(qwen3_config(model_cfg), dtype=jnp.float32, rngs=nnx.Rngs(seed))


def forward_logits(model: Qwen3, tokens_BT: jax.Array) -> jax.Array:
  """Causal forward over positions 0..T-1: float32 logits [B, T, V]."""
  B, T = tokens_BT.shape
  return model(tokens_BT, model.init_cache(B, T)).logits


def _token_losses(model: Qwen3, batch: dict[str, jax.Array]
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-position next-token cross-entropy, correctness and weights, all [B, T-1]."""
  tokens_BT = batch["tokens"]
  inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
  weights_BT = batch["loss_mask"][:, 1:].astype(jnp.float32)
  logits_BTV = forward_logits(model, inputs_BT)
  ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT)
  correct_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT).astype(jnp.float32)
  return ce_BT, correct_BT, weights_BT


def lm_loss_fn(model: Qwen3, frozen: Any, batch: dict[str, jax.Array], rng: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross-entropy over positions whose target has `loss_mask` 1."""
  del frozen, rng
  ce_BT, correct_BT, weights_BT = _token_losses(model, batch)
  n = jnp.maximum(weights_BT.sum(), 1.0)
  return (ce_BT * weights_BT).sum() / n, {"accuracy": (correct_BT * weights_BT).sum() / n}


@functools.partial(jax.jit, static_argnums=0)
def _eval_sums(graphdef: nnx.GraphDef, state: nnx.State, batch: dict[str, jax.Array]
               ) -> jax.Array:
  ce_BT, correct_BT, weights_BT = _token_losses(nnx.merge(graphdef, state), batch)
  return jnp.stack([(ce_BT * weights_BT).sum(), (correct_BT * weights_BT).sum(), weights_BT.sum()])


def make_eval_fn(val_source: Any, batch_size: int, chunk_len: int, num_batches: int,
                 pad_id: int) -> Callable[[nnx.Module, Any], dict[str, float]]:
  """Held-out loss, perplexity and top-1 accuracy over the first `num_batches` batches of
  `val_source` (fixed order), as an `eval_fn` for `loop.train`."""
  from bp_jax.data import batches

  batch_size = max(1, min(batch_size, len(val_source)))
  fixed = list(itertools.islice(batches(val_source, batch_size, chunk_len, seed=0, epoch=0,
                                        pad_id=pad_id), max(1, num_batches)))
  fixed = [{"tokens": b["tokens"], "loss_mask": b["loss_mask"]} for b in fixed]

  def eval_fn(model: nnx.Module, frozen: Any) -> dict[str, float]:
    del frozen
    graphdef, state = nnx.split(model)
    total = sum(np.asarray(_eval_sums(graphdef, state, b), np.float64) for b in fixed)
    loss = total[0] / max(total[2], 1.0)
    return {"loss": float(loss), "ppl": float(math.exp(min(loss, 50.0))),
            "accuracy": float(total[1] / max(total[2], 1.0))}

  return eval_fn


def lm_batches_fn(train_source: Any, batch_size: int, chunk_len: int, seed: int,
                  pad_id: int) -> Callable[[int], Iterator[dict[str, np.ndarray]]]:
  """`batches_fn` for `loop.train`: one shuffled epoch of `tokens`/`loss_mask` batches."""
  from bp_jax.data import batches

  def batches_fn(epoch: int) -> Iterator[dict[str, np.ndarray]]:
    for b in batches(train_source, batch_size, chunk_len, seed, epoch, pad_id):
      yield {"tokens": b["tokens"], "loss_mask": b["loss_mask"]}

  return batches_fn


def export_target(model: Qwen3, out_dir: str, tokenizer_dir: str | None,
                  dtype: str = "float32") -> str:
  """Saves `model` as a converted target checkpoint (kind "qwen3") at `out_dir`, replacing an
  earlier checkpoint there, with the tokenizer files of `tokenizer_dir` copied in.

  `dtype` ("float32" or "bfloat16") is the stored dtype of floating params.
  """
  from bp_jax.weights.checkpoint_io import save_checkpoint
  from bp_jax.models.nnx_utils import module_params

  if dtype not in EXPORT_DTYPES:
    raise BadInputError(f"export dtype {dtype!r} is not one of {list(EXPORT_DTYPES)}")
  params = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype)), module_params(model))
  extra = {}
  if tokenizer_dir:
    for name in sorted(os.listdir(tokenizer_dir)):
      path = os.path.join(tokenizer_dir, name)
      if os.path.isfile(path) and not name.startswith("bp_jax"):
        extra[name] = path
  return save_checkpoint(out_dir, params, model.cfg.to_hf_dict(),
                         {"kind": "qwen3", "made_by": "train.py lm stage"}, extra_files=extra,
                         overwrite=True)


def _check_chunks(source: Any, chunk_len: int, name: str) -> None:
  got = len(source[0]["tokens"])
  if got != chunk_len:
    raise BadInputError(
        f"dataset {name!r} holds chunks of {got} tokens but --config.lm.seq_len="
        f"{chunk_len - 1} needs {chunk_len}: rerun the 'lm_data' stage")


def tokenizer_size(tok: Any) -> int:
  """How many ids the tokenizer decodes: 1 + its largest id (added tokens included)."""
  return max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)


def check_vocab_sizes(tokenizer_ids: int, vocab_size: int, tok_dir: str) -> None:
  """Refuses a tokenizer with ids beyond the model's vocabulary; warns (on stderr) when the model
  can emit ids the tokenizer cannot decode (they would vanish from decoded text)."""
  if tokenizer_ids > vocab_size:
    raise BadInputError(f"the tokenizer in {tok_dir} has {tokenizer_ids} ids but "
                        f"--config.model.vocab_size={vocab_size}: its ids past "
                        f"{vocab_size - 1} are out of the model's range; set "
                        f"--config.model.vocab_size={tokenizer_ids}")
  if tokenizer_ids < vocab_size:
    print(f"[lm] warning: --config.model.vocab_size={vocab_size} but the tokenizer in {tok_dir} "
          f"has {tokenizer_ids} ids: the model can emit {vocab_size - tokenizer_ids} ids "
          f"({tokenizer_ids}..{vocab_size - 1}) that the tokenizer cannot decode; set "
          f"--config.model.vocab_size={tokenizer_ids} to match", file=sys.stderr, flush=True)


RUN_STAMP = "run_settings.json"


def check_run_settings(run_dir: str, want: dict[str, Any]) -> None:
  """Refuses to resume an LM run whose data, model or batch shape differ from `want`; records
  `want` for a new run."""
  path = os.path.join(run_dir, RUN_STAMP)
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      have = json.load(f)
    diffs = [k for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k)]
    if diffs:
      raise BadInputError(
          f"{run_dir} holds an LM run made with other settings ({', '.join(diffs)} changed): "
          f"it cannot be resumed; delete {run_dir} or use a fresh workdir")
    return
  if os.path.isdir(os.path.join(run_dir, "checkpoints")):
    raise BadInputError(f"{run_dir} holds checkpoints of unknown origin (no {RUN_STAMP}); "
                        "delete the folder or use a fresh workdir")
  os.makedirs(run_dir, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(want, f, indent=2, sort_keys=True)


def lm_stage(cfg: Any) -> None:
  """Trains the target (`cfg.model`, `cfg.lm`) on lm_train, evaluates on lm_val, and exports it
  to `<workdir>/target` (and `<export_dir>/target`)."""
  from bp_jax.text.tokenizer import load_tokenizer
  from bp_jax.train.corpus import LM_TRAIN, LM_VAL
  from bp_jax.train.loop import train

  lm = cfg.lm
  tok_dir = wd.require_tokenizer(cfg, "lm")
  train_ds = wd.require_dataset(cfg, LM_TRAIN, "lm", "lm_data")
  val_ds = wd.require_dataset(cfg, LM_VAL, "lm", "lm_data")
  chunk_len = int(lm.seq_len) + 1
  _check_chunks(train_ds, chunk_len, LM_TRAIN)
  _check_chunks(val_ds, chunk_len, LM_VAL)
  tok = load_tokenizer(tok_dir)
  model = build_target(cfg.model, int(cfg.seed))
  check_vocab_sizes(tokenizer_size(tok), model.cfg.vocab_size, tok_dir)
  if chunk_len - 1 > model.cfg.max_position_embeddings:
    raise BadInputError(f"--config.lm.seq_len={chunk_len - 1} exceeds "
                        f"--config.model.max_position_embeddings")
  pad_id = int(tok.pad_token_id)
  run_dir = wd.run_dir(cfg, "lm")
  check_run_settings(run_dir, {
      "model": model.cfg.to_hf_dict(), "seq_len": chunk_len - 1, "batch": int(lm.batch),
      "seed": int(cfg.seed), "train_chunks": len(train_ds),
      "train_data": train_ds.description, "pad_id": pad_id})
  result = train(
      workdir=run_dir, model=model, loss_fn=lm_loss_fn,
      batches_fn=lm_batches_fn(train_ds, int(lm.batch), chunk_len, int(cfg.seed), pad_id),
      num_steps=int(lm.steps), opt_cfg=lm.opt,
      eval_fn=make_eval_fn(val_ds, int(lm.batch), chunk_len, int(lm.eval_batches), pad_id),
      eval_every=int(lm.eval_every), checkpoint_every=int(lm.checkpoint_every),
      seed=int(cfg.seed), desc="lm", log_every=int(lm.log_every))
  out = export_target(result.model, wd.target_dir(cfg), tok_dir, str(lm.export_dtype))
  shipped = wd.ship_checkpoint(cfg, out, "target")
  summary = {"steps": result.step, "resumed_from": result.start_step,
             "train_loss": result.last_metrics.get("loss"),
             **{k: v for k, v in result.eval_metrics.items()},
             "tokens_per_s": round(result.tokens_per_s, 1), "peak_rss_mb": peak_rss_mb(),
             "num_params": sum(x.size for x in jax.tree.leaves(nnx.state(result.model))),
             "checkpoint": out, "checkpoint_mb": round(wd.folder_nbytes(out) / 2**20, 2),
             "shipped": shipped}
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  trained = (f"trained steps {result.start_step}..{result.step} at "
             f"{summary['tokens_per_s']:,.0f} tokens/s" if result.start_step < result.step
             else f"already trained ({result.step} steps)")
  eval_loss = summary.get("eval_loss")
  print(f"[lm] {trained}; train loss {_fmt(summary['train_loss'])}, eval loss {_fmt(eval_loss)}, "
        f"eval ppl {_fmt(summary.get('eval_ppl'), 2)}; exported {out} "
        f"({summary['checkpoint_mb']} MB)" + (f", shipped to {shipped}" if shipped else ""))


def _fmt(value: Any, digits: int = 4) -> str:
  return "n/a" if value is None else f"{value:.{digits}f}"
