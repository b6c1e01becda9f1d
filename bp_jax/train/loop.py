"""The training loop shared by every stage: jitted AdamW steps, checkpoints, resume, logs.

  result = train(workdir=..., model=model, loss_fn=loss_fn, batches_fn=batches_fn,
                 num_steps=1000, opt_cfg=cfg.opt, checkpoint_every=200, seed=0, desc="lm")

* `loss_fn(model, frozen, batch, rng) -> (loss, metrics)`: `model` is the module being trained
  (merged inside the jitted step), `frozen` any pytree of arrays that is not trained (e.g. a frozen
  target's params; passed to the step as an argument, never baked in as a constant), `batch` a
  dict of arrays, `rng` a per-step PRNG key; `metrics` a dict of scalars to log (averaged).
* `batches_fn(epoch) -> iterator of dict[str, np.ndarray]`, deterministic for a given epoch; the
  loop moves to the next epoch when an iterator ends. On resume the loop calls
  `batches_fn(epoch)` again and skips the batches already trained on, so the data order is the
  same as in an uninterrupted run.
* `eval_fn(model, frozen) -> dict[str, float]`, run every `eval_every` steps and at the end;
  keys are logged with an "eval_" prefix (added when missing).

Only `nnx.Param` variables are trained; other variables are carried unchanged. Params and
optimiser state are donated to the step. Checkpoints (params, optimiser state, rng, data
position) go to `<workdir>/checkpoints` every `checkpoint_every` steps and at the end; a new
`train` call on the same workdir resumes from the latest one (and returns at once when it is
already at `num_steps`). The learning-rate schedule spans `num_steps`: raising `num_steps` on
resume stretches it. Metrics go to `<workdir>/metrics.jsonl` and `<workdir>/loss.png`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from bp_jax.errors import BadInputError
from bp_jax.parallel.rules import shard_batch, shard_state
from bp_jax.train.checkpointing import TrainCheckpointer
from bp_jax.train.optim import make_optimizer

Batch = Mapping[str, Any]
LossFn = Callable[[nnx.Module, Any, Batch, jax.Array], tuple[jax.Array, Mapping[str, jax.Array]]]
BatchesFn = Callable[[int], Iterator[Batch]]
EvalFn = Callable[[nnx.Module, Any], Mapping[str, float]]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass
class TrainResult:
  """What `train` returns."""
  model: nnx.Module              # the trained module (params of the final step)
  step: int                      # steps done in total (== num_steps)
  start_step: int                # step this call resumed from (0 for a fresh run)
  last_metrics: dict[str, float]  # the last logged training metrics
  eval_metrics: dict[str, float]  # the last evaluation ({} without eval_fn)
  tokens_per_s: float            # mean training throughput of this call (compilation excluded)
  history: list[dict]            # every record of metrics.jsonl


def count_tokens(batch: Batch) -> int:
  """Tokens in a batch: the sum of `loss_mask` when present, else the size of `tokens`."""
  if "loss_mask" in batch:
    return int(np.sum(batch["loss_mask"]))
  if "tokens" in batch:
    return int(np.size(batch["tokens"]))
  return 0


class DataCursor:
  """Walks `batches_fn` epoch after epoch; `position` is where the next batch comes from."""

  def __init__(self, batches_fn: BatchesFn, epoch: int = 0, batch: int = 0):
    self._fn = batches_fn
    self.epoch, self.batch = epoch, batch
    self._it = iter(batches_fn(epoch))
    skipped = sum(1 for _ in itertools.islice(self._it, batch))
    if skipped < batch:
      raise BadInputError(
          f"cannot resume: epoch {epoch} of the training data now has {skipped} batches, but the "
          f"checkpoint was taken after batch {batch}; the data changed since the checkpoint "
          "(rebuild it as before, or use a fresh workdir)")

  @property
  def position(self) -> dict[str, int]:
    return {"epoch": self.epoch, "batch": self.batch}

  def next(self) -> Batch:
    for attempt in range(2):
      item = next(self._it, None)
      if item is not None:
        self.batch += 1
        return item
      if attempt == 0 and self.batch == 0:
        break
      self.epoch, self.batch = self.epoch + 1, 0
      self._it = iter(self._fn(self.epoch))
    raise BadInputError(f"the training data yields no batches (epoch {self.epoch}); make the "
                        "dataset larger or the batch smaller")


def make_train_step(graphdef: nnx.GraphDef, loss_fn: LossFn, tx) -> Callable:
  """The jitted pure step (params, opt_state, rest, frozen, batch, rng) -> (params, opt_state,
  loss, metrics); params and opt_state are donated. Only `params` are differentiated."""

  def step(params, opt_state, rest, frozen, batch, rng):
    def loss_of(p):
      model = nnx.merge(graphdef, p, rest)
      loss, metrics = loss_fn(model, frozen, batch, rng)
      return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    metrics = dict(metrics)
    metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                        for g in jax.tree.leaves(grads)))
    return params, opt_state, loss, metrics

  return jax.jit(step, donate_argnums=(0, 1))


# (graphdef, loss_fn, optimiser settings, num_steps) -> (tx, schedule, jitted step): a second
# `train` call in the same process (e.g. resuming) reuses the compiled step.
_STEP_CACHE: dict[tuple, tuple] = {}


def _compiled_step(graphdef: nnx.GraphDef, loss_fn: LossFn, opt_cfg: Any, num_steps: int):
  opt_items = opt_cfg.to_dict() if hasattr(opt_cfg, "to_dict") else dict(opt_cfg)
  key = (graphdef, loss_fn, json.dumps(opt_items, sort_keys=True, default=str), num_steps)
  try:
    hash(key)
  except TypeError:  # an unhashable loss_fn (e.g. a functools.partial of arrays): no reuse
    tx, schedule = make_optimizer(opt_cfg, num_steps)
    return tx, schedule, make_train_step(graphdef, loss_fn, tx)
  if key not in _STEP_CACHE:
    if len(_STEP_CACHE) >= 8:
      _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
    tx, schedule = make_optimizer(opt_cfg, num_steps)
    _STEP_CACHE[key] = (tx, schedule, make_train_step(graphdef, loss_fn, tx))
  return _STEP_CACHE[key]


def _read_history(path: str, upto: int) -> list[dict]:
  """metrics.jsonl records with step <= upto (later ones belong to steps being redone)."""
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if record.get("step", 0) <= upto:
          records.append(record)
  return records


def _write_history(path: str, records: list[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
  os.replace(tmp, path)


def plot_history(records: list[dict], path: str, title: str = "") -> None:
  """PNG of training loss (and eval loss when logged) against step."""
  from bp_jax.eval.plots import line_plot  # matplotlib is only needed here

  series = {}
  for name, key in (("train", "loss"), ("eval", "eval_loss")):
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    if points:
      series[name] = ([p[0] for p in points], [p[1] for p in points])
  if series:
    line_plot(series, path, xlabel="step", ylabel="loss", title=title)


def _mean_metrics(pending: list[tuple[jax.Array, Mapping[str, jax.Array]]]) -> dict[str, float]:
  fetched = jax.device_get(pending)
  out = {"loss": float(np.mean([loss for loss, _ in fetched]))}
  for key in fetched[0][1]:
    out[key] = float(np.mean([m[key] for _, m in fetched]))
  return out


def _evaluate(eval_fn: EvalFn, model: nnx.Module, frozen: Any) -> dict[str, float]:
  raw = eval_fn(model, frozen)
  return {(k if k.startswith("eval_") else f"eval_{k}"): float(v) for k, v in raw.items()}


def _check_args(num_steps: int, checkpoint_every: int, eval_every: int, log_every: int) -> None:
  for name, value, minimum in (("num_steps", num_steps, 1), ("checkpoint_every", checkpoint_every, 1),
                               ("eval_every", eval_every, 0), ("log_every", log_every, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      raise BadInputError(f"{name} must be an integer >= {minimum}, got {value!r}")


def train(*, workdir: str, model: nnx.Module, loss_fn: LossFn, batches_fn: BatchesFn,
          num_steps: int, opt_cfg: Any, frozen: Any = None, eval_fn: EvalFn | None = None,
          eval_every: int = 0, checkpoint_every: int, seed: int, desc: str,
          log_every: int = 10, progress: bool = True, mesh=None) -> TrainResult:
  """Trains `model` for `num_steps` steps in total, resuming from `<workdir>/checkpoints`.

  Args:
    workdir: folder for checkpoints, metrics.jsonl and loss.png (created).
    model: the module to train; its current params are the starting point of a fresh run
      (ignored on resume). It is not modified: the trained module is returned.
    loss_fn, batches_fn, eval_fn: see the module docstring.
    num_steps: total optimiser steps (counting those done before a resume).
    opt_cfg: optimiser ConfigDict (`bp_jax.train.optim.DEFAULTS` fields).
    frozen: pytree of arrays passed to every step and eval untouched.
    eval_every: evaluate every N steps (0: only at the end); needs eval_fn.
    checkpoint_every: save every N steps (and always at the end).
    seed: the per-step rng is `fold_in(PRNGKey(seed), step)`; a resume must use the same seed.
    desc: progress-bar label and plot title.
    log_every: log averaged metrics every N steps (and at the end).
    progress: show a tqdm progress bar.
    mesh: a `jax.sharding.Mesh` (`--config.mesh`): params, the other variables and the
      optimiser state are placed by the rule table (`bp_jax.parallel.rules`), each batch is
      split over `data`; None = one device. `frozen` is the caller's to place.

  Raises:
    BadInputError: bad arguments, no data, or a checkpoint that does not fit this run.
  """
  _check_args(num_steps, checkpoint_every, eval_every, log_every)
  os.makedirs(workdir, exist_ok=True)
  metrics_path = os.path.join(workdir, METRICS_FILE)
  plot_path = os.path.join(workdir, PLOT_FILE)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, schedule, step_fn = _compiled_step(graphdef, loss_fn, opt_cfg, num_steps)
  params = jax.tree.map(jnp.array, params)  # own copies: the step donates them
  params, rest = shard_state(params, mesh), shard_state(rest, mesh)
  opt_state = tx.init(params)
  rng = jax.random.PRNGKey(seed)

  ckpt = TrainCheckpointer(os.path.join(workdir, CHECKPOINT_DIR))
  try:
    start, position, elapsed = 0, {"epoch": 0, "batch": 0}, 0.0
    latest = ckpt.latest_step()
    if latest is not None:
      state, meta = ckpt.restore(latest, {"params": params, "opt_state": opt_state, "rng": rng})
      if meta.get("seed") != seed:
        raise BadInputError(
            f"{ckpt.directory} was trained with seed {meta.get('seed')}, this run has seed {seed}; "
            "resume with the same seed or use a fresh workdir")
      if latest > num_steps:
        raise BadInputError(f"{ckpt.directory} holds a checkpoint at step {latest}, past "
                            f"num_steps={num_steps}; raise num_steps or use a fresh workdir")
      params, opt_state, rng = state["params"], state["opt_state"], state["rng"]
      start, position = latest, {"epoch": meta["epoch"], "batch": meta["batch"]}
      elapsed = float(meta.get("elapsed_s", 0.0))
    history = _read_history(metrics_path, start)
    _write_history(metrics_path, history)

    out = _RunOutput(params, _last_record(history, "loss"), _last_record(history, "eval_"), 0.0)
    if start < num_steps:
      out = _run(graphdef=graphdef, params=params, opt_state=opt_state, rest=rest, rng=rng,
                 frozen=frozen, step_fn=step_fn, schedule=schedule,
                 batches_fn=batches_fn, position=position, start=start, num_steps=num_steps,
                 eval_fn=eval_fn, eval_every=eval_every, checkpoint_every=checkpoint_every,
                 log_every=log_every, seed=seed, desc=desc, progress=progress, ckpt=ckpt,
                 history=history, metrics_path=metrics_path, plot_path=plot_path,
                 elapsed=elapsed, eval_metrics=out.eval_metrics, mesh=mesh)
    elif eval_fn is not None and not out.eval_metrics:
      out = out._replace(eval_metrics=_evaluate(eval_fn, nnx.merge(graphdef, params, rest),
                                                frozen))
    plot_history(history, plot_path, desc)
  finally:
    ckpt.close()
  return TrainResult(model=nnx.merge(graphdef, out.params, rest), step=num_steps,
                     start_step=start, last_metrics=out.last_metrics,
                     eval_metrics=out.eval_metrics, tokens_per_s=out.tokens_per_s,
                     history=history)


class _RunOutput(NamedTuple):
  params: Any
  last_metrics: dict[str, float]
  eval_metrics: dict[str, float]
  tokens_per_s: float


def _last_record(history: list[dict], prefix: str) -> dict[str, float]:
  """The newest record holding a key that starts with `prefix`, without its step."""
  for record in reversed(history):
    if any(k.startswith(prefix) for k in record):
      return {k: v for k, v in record.items() if k != "step"}
  return {}


def _run(*, graphdef, params, opt_state, rest, rng, frozen, step_fn, schedule, batches_fn,
         position, start, num_steps, eval_fn, eval_every, checkpoint_every, log_every, seed,
         desc, progress, ckpt, history, metrics_path, plot_path, elapsed,
         eval_metrics, mesh=None) -> _RunOutput:
  """The step loop of `train` from `start` to `num_steps`; appends its records to `history`."""
  data = DataCursor(batches_fn, position["epoch"], position["batch"])
  pending: list = []
  last_metrics: dict[str, float] = {}
  tokens_since, tokens_run, time_run = 0, 0, 0.0
  bar = tqdm(total=num_steps, initial=start, desc=desc, unit="step", dynamic_ncols=True,
             disable=not progress)
  t_start = t_mark = time.perf_counter()
  t_first: float | None = None  # end of the first (compiling) step of this call

  def log_record(record: dict) -> None:
    history.append(record)
    with open(metrics_path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")

  try:
    for step in range(start, num_steps):
      batch = data.next()
      params, opt_state, loss, metrics = step_fn(params, opt_state, rest, frozen,
                                                 shard_batch(batch, mesh),
                                                 jax.random.fold_in(rng, step))
      pending.append((loss, metrics))
      tokens_since += count_tokens(batch)
      done = step + 1
      # Wait for the step so the progress bar is truthful (a step takes far longer than
      # fetching the next batch, so little overlap is lost).
      jax.block_until_ready(loss)
      bar.update(1)
      if t_first is None:  # exclude compilation from throughput
        t_first = t_mark = time.perf_counter()
        tokens_since = 0
      if pending and (done % log_every == 0 or done == num_steps):
        last_metrics = _mean_metrics(pending)
        now = time.perf_counter()
        dt = now - t_mark
        tok_s = tokens_since / dt if dt > 0 and tokens_since else 0.0
        tokens_run, time_run = tokens_run + tokens_since, time_run + dt
        t_mark, tokens_since = now, 0
        pending.clear()
        last_metrics.update(lr=float(schedule(step)), tokens_per_s=round(tok_s, 1))
        log_record({"step": done, **last_metrics})
        bar.set_postfix(loss=f"{last_metrics['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
      if eval_fn is not None and ((eval_every and done % eval_every == 0) or done == num_steps):
        t0 = time.perf_counter()
        eval_metrics = _evaluate(eval_fn, nnx.merge(graphdef, params, rest), frozen)
        log_record({"step": done, **eval_metrics})
        bar.set_postfix(loss=f"{last_metrics.get('loss', float('nan')):.4f}",
                        eval=f"{eval_metrics.get('eval_loss', float('nan')):.4f}")
        t_mark += time.perf_counter() - t0  # evaluation time is not training time
      if done % checkpoint_every == 0 or done == num_steps:
        t0 = time.perf_counter()
        meta = {"step": done, **data.position, "seed": seed, "num_steps": num_steps,
                "elapsed_s": round(elapsed + t0 - t_start, 3)}
        ckpt.save(done, {"params": params, "opt_state": opt_state, "rng": rng}, meta)
        plot_history(history, plot_path, desc)
        t_mark += time.perf_counter() - t0
  finally:
    bar.close()
  tokens_per_s = tokens_run / time_run if time_run > 0 else 0.0
  return _RunOutput(params, last_metrics, eval_metrics, tokens_per_s)
