"""The `policy` stage: train BlockPilot block-size policies on the labels (docs/design.md §5).

For every head in `cfg.blockpilot.heads`, feature type in `cfg.blockpilot.features` and label rule
in `cfg.blockpilot.rules`, an MLP (`bp_jax.policy.mlp.BlockPolicy`) maps the prompt's prefill
feature to a block size (class i = candidate size i):
  classify  the class of the prompt's label (argmax over sizes of the rule's value), trained by
            cross-entropy;
  value     each size's value relative to the prompt's value at the best static size
            (r_nk = V_nk / V_n,static, `relative_values`), trained by regression (Huber loss:
            quadratic for small errors, linear for the few prompts whose static-size run was
            very slow and whose ratios are far above 1, which would dominate a squared loss).
            Its decision shrinks rhat toward the training prompts' mean ratio (`value_prior`):
            scores = lam * rhat + (1 - lam) * prior; lam is chosen on the validation prompts
            (`choose_lam`), so without evidence the policy decodes with the static size.
  priced    each size's counts per new token, speculative cycles and AR fallback steps
            (`count_targets`: the same on every machine), trained by squared error weighted by
            the labelling machine's prices; its decision prices them with the costs of the
            machine it decodes on (`bp_jax.policy.mlp`), shrunk toward the training prompts'
            counts (`count_prior`) by a lam chosen as the value head's is. Trained under
            `max_throughput` only (what it decides is throughput).
Training data are `policy_labels` only (made by the labels stage);
its prompts are split by key into train and validation parts (`val_frac`). Training: AdamW
(`train.optim`, weight decay), label-smoothed cross-entropy, dropout, mini-batches reshuffled
each epoch, and early stopping: the validation cross-entropy is measured every `eval_every` steps
and the parameters of the best one are kept; training stops after `patience` measurements
without improvement. Input normalisation statistics come from the training part.

Outputs: `<workdir>/policies/<feature>-<rule>/` and `<feature>-<rule>-value/` ("policy"
checkpoints; named `<feature>:<rule>` and `<feature>:<rule>:value` in the summary) and
`<workdir>/policies/summary.json` (accuracies, the majority-class baseline, and the validation
τ / estimated tokens-per-second of each policy's choices against the best static size; for value
policies the prior, the lam grid and its bootstrap intervals). One
policy is copied to `<export_dir>/policy` (`ship`): `auto` picks the best validation estimated
tokens per second.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bp_jax.data import epoch_order
from bp_jax.errors import BadInputError
from bp_jax.parallel.mesh import make_mesh
from bp_jax.parallel.rules import shard_batch, shard_state
from bp_jax.eval.bootstrap import bootstrap_speedup
from bp_jax.policy.mlp import (BlockPolicy, PolicyArch, check_head, check_label_rule,
                               decision_class, priced_costs, save_policy, shrunk_scores)
from bp_jax.policy.features import parse_feature_types
from bp_jax.text.prompts import check_disjoint, split_ids
from bp_jax.data import label_sets
from bp_jax.train import labels as lab
from bp_jax.train import workdir as wd

POLICIES_DIR = "policies"
# The value head's Huber loss is quadratic for |rhat - r| below this and linear above (ratios).
HUBER_DELTA = 0.25
PRICED_RULE = "max_throughput"  # the only rule a priced head is trained under


@dataclasses.dataclass
class FitResult:
  policy: BlockPolicy
  best_step: int
  steps_run: int
  val_loss: float
  history: list[dict]


def _loss_fn(label_smoothing: float):
  def loss_fn(model: BlockPolicy, frozen: Any, batch: Mapping[str, jax.Array], rng: jax.Array):
    del frozen
    logits_BC = model(batch["x"], rng)
    target_BC = optax.smooth_labels(jax.nn.one_hot(batch["y"], logits_BC.shape[-1]),
                                    label_smoothing)
    loss = optax.softmax_cross_entropy(logits_BC, target_BC).mean()
    acc = (jnp.argmax(logits_BC, -1) == batch["y"]).astype(jnp.float32).mean()
    return loss, {"accuracy": acc}

  return loss_fn


def _value_loss_fn(model: BlockPolicy, frozen: Any, batch: Mapping[str, jax.Array],
                   rng: jax.Array):
  """Huber loss of the value head's rhat [B, C] against the relative values r [B, C]."""
  del frozen
  rhat_BC = model(batch["x"], rng)
  loss = optax.huber_loss(rhat_BC, batch["y"], delta=HUBER_DELTA).mean()
  acc = (jnp.argmax(rhat_BC, -1) == jnp.argmax(batch["y"], -1)).astype(jnp.float32).mean()
  return loss, {"accuracy": acc}


def _priced_loss_fn(weights_2C: np.ndarray, relative_weight: float):
  """Squared error of a priced head's counts [B, 2C] against the measured ones, each weighted
  by its price on the labelling machine (an error in AR steps per token), plus
  `relative_weight` x the squared error of the sizes' priced costs relative to their prompt's
  mean cost (what the decision compares; `_priced_metrics`); "accuracy": the cheapest size at
  those prices agrees."""
  w_2C = jnp.asarray(weights_2C, jnp.float32)

  def loss_fn(model: BlockPolicy, frozen: Any, batch: Mapping[str, jax.Array], rng: jax.Array):
    del frozen
    return _priced_metrics(model(batch["x"], rng), batch["y"], w_2C, relative_weight)

  return loss_fn


def _priced_metrics(pred_B2C: jax.Array, y_B2C: jax.Array, w_2C: jax.Array,
                    relative_weight: float = 0.0) -> tuple[jax.Array, dict]:
  """(the loss of `_priced_loss_fn`, {"accuracy": the cheapest size agrees}). The counts'
  own error keeps cycles and steps apart (the decision reprices them on another machine); the
  relative term weighs what a decision at the labelling prices turns on: the demo's
  last_hidden head agreed with the cheapest size on 0.31 of its training prompts at weight 0,
  0.60 at 30 (docs/cpu_xeon167/priced_fit_2026-11-29)."""
  loss = jnp.square((pred_B2C - y_B2C) * w_2C[None, :]).sum(-1).mean()
  pred_BC, y_BC = priced_costs(pred_B2C, w_2C), priced_costs(y_B2C, w_2C)
  if relative_weight:
    centred = lambda c_BC: c_BC - c_BC.mean(-1, keepdims=True)
    gap_BC = centred(pred_BC) - centred(y_BC)
    loss = loss + relative_weight * jnp.square(gap_BC).sum(-1).mean()
  agree = (jnp.argmin(pred_BC, -1) == jnp.argmin(y_BC, -1)).astype(jnp.float32).mean()
  return loss, {"accuracy": agree}


@functools.partial(jax.jit, static_argnums=2)
def _val_metrics(params, rest, graphdef, x_NF, y_N):
  logits = nnx.merge(graphdef, params, rest)(x_NF)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y_N).mean()
  return ce, (jnp.argmax(logits, -1) == y_N).astype(jnp.float32).mean()


@functools.partial(jax.jit, static_argnums=2)
def _val_value_metrics(params, rest, graphdef, x_NF, r_NC):
  """(Huber loss, agreement of argmax rhat with argmax r) of a value head."""
  rhat_NC = nnx.merge(graphdef, params, rest)(x_NF)
  loss = optax.huber_loss(rhat_NC, r_NC, delta=HUBER_DELTA).mean()
  return loss, (jnp.argmax(rhat_NC, -1) == jnp.argmax(r_NC, -1)).astype(jnp.float32).mean()


@functools.partial(jax.jit, static_argnums=(2, 6))
def _val_priced_metrics(params, rest, graphdef, x_NF, y_N2C, w_2C, relative_weight):
  """(the priced loss, agreement of the cheapest size) of a priced head."""
  loss, m = _priced_metrics(nnx.merge(graphdef, params, rest)(x_NF), y_N2C, w_2C,
                            relative_weight)
  return loss, m["accuracy"]


def predict(policy: BlockPolicy, x_NF: np.ndarray) -> np.ndarray:
  """[N] the policy's decided classes of feature vectors (`BlockPolicy.decide`, no dropout):
  argmax class of a classifier, the shrunk decision of a value head."""
  return np.asarray(policy.decide(jnp.asarray(x_NF, jnp.float32))[1])


def fit_policy(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray | None,
               y_val: np.ndarray | None, arch: PolicyArch, *, opt_cfg: Any, steps: int,
               batch: int, label_smoothing: float, eval_every: int, patience: int,
               seed: int, mesh=None, prices_2C: np.ndarray | None = None,
               priced_relative_weight: float = 0.0) -> FitResult:
  """Trains a policy; with a validation set, early-stops on its loss (see the module docstring)
  and returns the best parameters, else the last ones. `y_*`: [N] int classes for a classify
  head, [N, C] relative values (`relative_values`) for a value head (whose decision rule is left
  at lam = 0: see `choose_lam`), [N, 2C] counts (`count_targets`) for a priced head, whose
  squared errors `prices_2C` (the labelling machine's, `label_prices`) weigh and which it is
  left priced at, and `priced_relative_weight` the error of the sizes' priced costs relative
  to their prompt's mean (`_priced_loss_fn`). `mesh` (`--config.mesh`): params placed by the
  rule table
  (`bp_jax.parallel.rules`), each batch split over `data`."""
  from bp_jax.train.loop import make_train_step
  from bp_jax.train.optim import make_optimizer

  value, priced = arch.head == "value", arch.head == "priced"
  y_dtype = np.float32 if value or priced else np.int32
  x_train, y_train = np.asarray(x_train, np.float32), np.asarray(y_train, y_dtype)
  N = len(x_train)
  if N < 2 or len(y_train) != N:
    raise BadInputError(f"policy training needs at least 2 labelled prompts, got {N}")
  if (value or priced) and y_train.shape != (N, arch.num_outputs):
    raise BadInputError(f"{arch.head} policy targets of shape {y_train.shape}, expected "
                        f"({N}, {arch.num_outputs})")
  if priced and (prices_2C is None or np.shape(prices_2C) != (arch.num_outputs,)):
    raise BadInputError("a priced policy is trained with the labelling machine's prices "
                        f"({arch.num_outputs} of them, `label_prices`)")
  if steps < 1 or batch < 1 or eval_every < 1 or patience < 1:
    raise BadInputError("--config.blockpilot: steps, batch, eval_every and patience must be >= 1")
  if not 0.0 <= label_smoothing < 1.0:
    raise BadInputError(f"--config.blockpilot.label_smoothing={label_smoothing} must lie in "
                        "[0, 1)")
  policy = BlockPolicy(arch, rngs=nnx.Rngs(seed))
  policy.set_feature_stats(x_train.mean(axis=0), x_train.std(axis=0))
  if priced:  # counts start at the training prompts' mean, priced as labelled
    policy.b_out[...] = jnp.asarray(y_train.mean(axis=0))
    C = arch.num_classes
    policy.set_prices(prices_2C[:C], prices_2C[C:])
  graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
  tx, _ = make_optimizer(opt_cfg, steps)
  if priced:
    w_2C = jnp.asarray(prices_2C, jnp.float32)
    if not priced_relative_weight >= 0:
      raise BadInputError(f"--config.blockpilot.priced_relative_weight="
                          f"{priced_relative_weight} must be >= 0")
    rel = float(priced_relative_weight)
    loss_fn = _priced_loss_fn(prices_2C, rel)
    val_metrics = lambda p, r, g, x, y: _val_priced_metrics(p, r, g, x, y, w_2C, rel)
  else:
    loss_fn = _value_loss_fn if value else _loss_fn(float(label_smoothing))
    val_metrics = _val_value_metrics if value else _val_metrics
  step_fn = make_train_step(graphdef, loss_fn, tx)
  params = shard_state(jax.tree.map(jnp.array, params), mesh)
  rest = shard_state(rest, mesh)
  opt_state = tx.init(params)
  bs = min(batch, N)
  per_epoch = max(1, N // bs)
  has_val = x_val is not None and len(x_val) > 0
  if has_val:
    xv, yv = jnp.asarray(x_val, jnp.float32), jnp.asarray(np.asarray(y_val, y_dtype))
  rng = jax.random.PRNGKey(seed)
  best = (float("inf"), 0, jax.device_get(params))
  history, bad, done = [], 0, 0
  order = None
  for step in range(steps):
    epoch, j = divmod(step, per_epoch)
    if j == 0:
      order = epoch_order(N, seed, epoch)
    idx = order[j * bs:(j + 1) * bs]
    params, opt_state, loss, metrics = step_fn(
        params, opt_state, rest, None, shard_batch({"x": x_train[idx], "y": y_train[idx]}, mesh),
        jax.random.fold_in(rng, step))
    done = step + 1
    if has_val and (done % eval_every == 0 or done == steps):
      ce, acc = (float(v) for v in val_metrics(params, rest, graphdef, xv, yv))
      history.append({"step": done, "loss": float(loss), "val_loss": ce, "val_accuracy": acc})
      if ce < best[0] - 1e-6:
        best, bad = (ce, done, jax.device_get(params)), 0
      else:
        bad += 1
        if bad >= patience:
          break
  final = best[2] if has_val else jax.device_get(params)
  model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, final), rest)
  return FitResult(model, best[1] if has_val else done, done, best[0], history)


# ---- evaluation of choices -------------------------------------------------------------------


def choice_metrics(records: Sequence[Mapping[str, Any]], choice_N: np.ndarray,
                   costs_K: Any) -> dict[str, float]:
  """Figures of the set when prompt i decodes with class `choice_N[i]`, named as decode.py's
  summary names them: `tau` (mean over prompts of each prompt's committed tokens per
  speculative cycle), `tau_pooled_over_cycles`, `tokens_per_forward` (mean over prompts of
  committed tokens per target forward, the AR fallback's steps included), and
  `est_tokens_per_s` (new tokens / `label_sets.decode_seconds`). Prompts without a cycle at
  their size count in no τ."""
  rows = np.arange(len(records))
  pick = lambda field: label_sets.stack(records, field)[rows, choice_N]
  tau, cycles, per_forward = pick("tau"), pick("cycles"), pick("tokens_per_forward")
  ran = cycles > 0
  mean = lambda v: float(np.mean(v[ran])) if ran.any() else 0.0
  new = pick("new_tokens").sum()
  seconds = label_sets.decode_seconds(records, costs_K)[rows, choice_N].sum()
  cycle_tokens = (tau.astype(np.float64) * cycles).sum()  # τ = a prompt's cycle tokens / cycles
  return {"tau": mean(tau), "tau_pooled_over_cycles": float(cycle_tokens / max(cycles.sum(), 1)),
          "tokens_per_forward": mean(per_forward),
          "est_tokens_per_s": float(new / max(seconds, 1e-12))}


def best_static(records: Sequence[Mapping[str, Any]], rule: str, costs_K: Any) -> int:
  """The class whose size is best for the whole set under `rule` (`choice_metrics`: mean τ
  per speculative cycle over the prompts, or estimated tokens per second)."""
  K = len(records[0]["block_sizes"])
  key = "tau" if rule == "max_tau" else "est_tokens_per_s"
  scores = [choice_metrics(records, np.full(len(records), k), costs_K)[key] for k in range(K)]
  return int(np.argmax(scores))


# ---- the value head's targets and decision rule -----------------------------------------------


def relative_values(values_NK: np.ndarray, static: int) -> np.ndarray:
  """[N, K] r_nk = V_nk / V_n,static: each size's value relative to the prompt's value at the
  static class; a prompt with no value at the static size (V <= 0) gets r = 1 everywhere (no
  evidence either way)."""
  v_NK = np.asarray(values_NK, np.float64)
  base_N1 = v_NK[:, static:static + 1]
  return np.where(base_N1 > 0, v_NK / np.where(base_N1 > 0, base_N1, 1.0), 1.0)


def value_prior(r_NK: np.ndarray, static: int) -> np.ndarray:
  """[K] the decision prior: the mean relative value of each size over the (training) prompts,
  capped at the static class's mean (1 when every prompt has a value there). The static class is
  the best on aggregate, so a size whose mean ratio beats it does so only through a few prompts;
  the cap keeps the prior maximal at the static class, so lam = 0 always picks it."""
  prior_K = np.asarray(r_NK, np.float64).mean(axis=0)
  return np.minimum(prior_K, prior_K[static])


def rule_totals(records: Sequence[Mapping[str, Any]], rule: str, costs_K: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
  """([N, K] numerator, [N, K] denominator) per prompt and size of the figure `rule` maximises
  over a prompt set, a ratio of sums: new tokens / estimated seconds (`max_throughput`, the
  `est_tokens_per_s` of `choice_metrics`) or tokens committed in cycles / cycles (`max_tau`, τ
  pooled over cycles)."""
  check_label_rule(rule)
  if rule == "max_throughput":
    return (label_sets.stack(records, "new_tokens").astype(np.float64),
            label_sets.decode_seconds(records, costs_K))
  cycles = label_sets.stack(records, "cycles").astype(np.float64)
  return label_sets.stack(records, "tau").astype(np.float64) * cycles, cycles


def parse_lams(text: str) -> tuple[float, ...]:
  """The lam grid of `--config.blockpilot.value_lams`: ascending values in [0, 1], 0 included
  (the static size, always a safe choice)."""
  try:
    lams = tuple(sorted({float(t) for t in str(text or "").split(",") if t.strip()}))
  except ValueError:
    raise BadInputError(f"--config.blockpilot.value_lams={text!r}: give comma-separated numbers "
                        "in [0, 1], e.g. 0,0.25,0.5,0.75,1") from None
  if not lams or lams[0] != 0.0 or lams[-1] > 1.0:
    raise BadInputError(f"--config.blockpilot.value_lams={text!r}: values must lie in [0, 1] "
                        "and include 0")
  return lams


def shrunk_choice(rhat_NK: np.ndarray, prior_K: np.ndarray, lam: float, static: int
                  ) -> np.ndarray:
  """[N] the value head's decisions for shrinkage `lam` (the rule `BlockPolicy.decide` runs)."""
  scores = shrunk_scores(jnp.asarray(rhat_NK, jnp.float32), jnp.asarray(prior_K, jnp.float32),
                         jnp.float32(lam))
  return np.asarray(decision_class(scores, jnp.int32(static)))


def choose_lam(rhat_NK: np.ndarray, prior_K: np.ndarray, static: int, num_NK: np.ndarray,
               den_NK: np.ndarray, lams: Sequence[float], *, reps: int, level: float,
               seed: int) -> tuple[float, list[dict]]:
  """(lam, grid table) for a value head from held-out prompts: for each lam its decisions'
  figure (sum num / sum den over the prompts at the chosen sizes, `rule_totals`) relative to the
  static size's, with a paired bootstrap interval over the prompts (`bootstrap_speedup`).

  Chosen: among the lams whose interval's lower bound is >= 1 (the data cannot show them losing
  to the static size), the best point estimate; ties (within 1e-9) go to the smaller lam. lam = 0
  decides the static size for every prompt (ratio 1, interval [1, 1]), so it always qualifies.
  """
  return choose_lam_by(lambda lam: shrunk_choice(rhat_NK, prior_K, lam, static), static,
                       num_NK, den_NK, lams, reps=reps, level=level, seed=seed)


def choose_lam_by(choice_of, static: int, num_NK: np.ndarray, den_NK: np.ndarray,
                  lams: Sequence[float], *, reps: int, level: float,
                  seed: int) -> tuple[float, list[dict]]:
  """`choose_lam` for any head: `choice_of(lam)` -> [N] its decisions on the held-out prompts
  (a priced head's lam = 0 picks the static size of its prices, not necessarily `static`: its
  interval then tells whether that size loses to `static`)."""
  rows = np.arange(len(num_NK))
  base_num, base_den = num_NK[rows, static], den_NK[rows, static]
  table, best = [], (1.0, 0.0)
  for lam in lams:
    choice_N = np.asarray(choice_of(lam))
    sp = bootstrap_speedup(num_NK[rows, choice_N], den_NK[rows, choice_N], base_num, base_den,
                           reps=reps, seed=seed, level=level)
    table.append({"lam": float(lam), "vs_static": sp.ratio, "lo": sp.lo, "hi": sp.hi,
                  "changed_frac": float((choice_N != static).mean())})
    if sp.lo >= 1.0 - 1e-12 and sp.ratio > best[0] + 1e-9:
      best = (sp.ratio, float(lam))
  return best[1], table


def crossfit_choice(rhat_NK: np.ndarray, prior_K: np.ndarray, static: int, num_NK: np.ndarray,
                    den_NK: np.ndarray, lams: Sequence[float], *, reps: int, level: float,
                    seed: int) -> np.ndarray:
  """[N] each held-out prompt's decision under the lam `choose_lam` picks on the *other* half of
  the prompts (two folds, alternate prompts): a figure of these decisions is not inflated by
  having chosen lam on the same prompts, as the figure at the lam chosen on all of them is."""
  return crossfit_by(lambda lam, rows: shrunk_choice(rhat_NK[rows], prior_K, lam, static),
                     static, num_NK, den_NK, lams, reps=reps, level=level, seed=seed)


def crossfit_by(choice_of, static: int, num_NK: np.ndarray, den_NK: np.ndarray,
                lams: Sequence[float], *, reps: int, level: float, seed: int) -> np.ndarray:
  """`crossfit_choice` for any head: `choice_of(lam, rows)` -> its decisions on those rows."""
  N = len(num_NK)
  fold_N = np.arange(N) % 2
  out = np.full(N, static, np.int64)
  if N < 4:
    return out
  for f in (0, 1):
    fit, use = np.flatnonzero(fold_N != f), np.flatnonzero(fold_N == f)
    lam, _ = choose_lam_by(lambda l: choice_of(l, fit), static, num_NK[fit], den_NK[fit], lams,
                           reps=reps, level=level, seed=seed)
    out[use] = choice_of(lam, use)
  return out


# ---- the priced head's targets and prices -----------------------------------------------------


def _counts(records: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[N, K] each prompt's speculative cycles, AR fallback steps (target forwards that were no
  cycle) and new tokens at each size."""
  cyc = label_sets.stack(records, "cycles").astype(np.float64)
  steps = label_sets.stack(records, "forwards").astype(np.float64) - cyc
  return cyc, steps, label_sets.stack(records, "new_tokens").astype(np.float64)


def count_targets(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """[N, 2K] each prompt's counts per new token at each size: speculative cycles, then AR
  fallback steps; what a priced head regresses."""
  cyc, steps, new = _counts(records)
  new = np.maximum(new, 1.0)
  return np.concatenate([cyc / new, steps / new], axis=1)


def count_prior(records: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """[2K] the prompts' pooled counts per new token (total cycles, steps / total new tokens):
  priced at any costs, the best static size of those costs for the whole set."""
  cyc, steps, new = _counts(records)
  new_K = np.maximum(new.sum(0), 1.0)
  return np.concatenate([cyc.sum(0) / new_K, steps.sum(0) / new_K])


def label_prices(table: Any, sizes: Sequence[int]) -> np.ndarray:
  """[2K] the labelling machine's prices in AR steps (a cycle of each size, then a fallback
  step in its loop) from the label set's cost table (`label_sets.seconds_per_size`); a label
  set priced without one is refused."""
  if not isinstance(table, Mapping):
    raise BadInputError("a priced policy needs labels priced by a cost table (label sets made "
                        "since cost tables: rerun train.py --config.stage=labels)")
  ar = float(table["ar_step_s"])
  cycle, step = [], []
  for b in (int(x) for x in sizes):
    cycle.append(1.0 if b == 1 else float(table["cycle_s"][str(b)]) / ar)
    step.append(1.0 if b == 1 else float(table.get("fallback_step_s", {}).get(str(b), ar)) / ar)
  return np.asarray(cycle + step, np.float64)


def priced_choice(policy: BlockPolicy, x_NF: np.ndarray, prior_2K: np.ndarray,
                  lam: float) -> np.ndarray:
  """[N] a priced head's decisions at shrinkage `lam` and the prices it holds."""
  policy.set_priced_decision(prior_2K, lam)
  return predict(policy, x_NF)


# ---- the stage -------------------------------------------------------------------------------


def parse_rules(text: str) -> tuple[str, ...]:
  rules = tuple(s.strip() for s in str(text or "").split(",") if s.strip())
  if not rules:
    raise BadInputError("--config.blockpilot.rules is empty; give max_tau and/or max_throughput")
  return tuple(check_label_rule(r) for r in rules)


def parse_heads(text: str) -> tuple[str, ...]:
  heads = tuple(s.strip() for s in str(text or "").split(",") if s.strip())
  if not heads:
    raise BadInputError("--config.blockpilot.heads is empty; give classify, value and/or "
                        "priced")
  return tuple(check_head(h) for h in heads)


def trained_kinds(rules: Sequence[str], heads: Sequence[str]) -> list[tuple[str, str]]:
  """The (label rule, head) pairs the stage trains: every pair but a priced head under a rule
  other than `PRICED_RULE` (it decides throughput whatever the labels' rule)."""
  return [(r, h) for r in rules for h in heads if h != "priced" or r == PRICED_RULE]


def policy_name(feature: str, rule: str, head: str = "classify") -> str:
  """The summary's (and `ship`'s) name of a policy: `<feature>:<rule>[:value|:priced]`."""
  return f"{feature}:{rule}" + ("" if head == "classify" else f":{head}")


def policy_dir(cfg: Any, feature: str, rule: str, head: str = "classify") -> str:
  """`<workdir>/policies/<feature>-<rule>[-value|-priced]`."""
  return os.path.join(wd.run_dir(cfg, POLICIES_DIR),
                      f"{feature}-{rule}" + ("" if head == "classify" else f"-{head}"))


def split_train_val(records: Sequence[Mapping[str, Any]], val_frac: float, seed: int
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Index arrays of the train and validation parts of the labelling prompts (split by key)."""
  if not 0.0 <= val_frac < 1.0:
    raise BadInputError(f"--config.blockpilot.val_frac={val_frac} must lie in [0, 1)")
  keys = [r["key"] for r in records]
  if val_frac == 0.0:
    return np.arange(len(keys)), np.arange(0)
  parts = split_ids(keys, {"train": 1.0 - val_frac, "val": val_frac}, seed)
  pos = {k: i for i, k in enumerate(keys)}
  return (np.asarray(sorted(pos[k] for k in parts["train"]), np.int64),
          np.asarray(sorted(pos[k] for k in parts["val"]), np.int64))


def policy_stage(cfg: Any) -> None:
  """Trains one policy per head, feature type and label rule (module docstring)."""
  bp = cfg.blockpilot
  features, rules = parse_feature_types(bp.features), parse_rules(bp.rules)
  heads, lams = parse_heads(bp.heads), parse_lams(bp.value_lams)
  records = lab.read_label_set(cfg, label_sets.LABELS, "policy")
  from bp_jax.data import dataset_exists
  if dataset_exists(wd.data_dir(cfg), label_sets.EVAL_LABELS):
    evals = lab.read_label_set(cfg, label_sets.EVAL_LABELS, "policy")
    check_disjoint({"labelling": [r["text_hash"] for r in records],
                    "evaluation": [r["text_hash"] for r in evals]})
  ok = label_sets.usable(records)
  if not ok.all():
    print(f"[policy] {int((~ok).sum())} labelling prompt(s) without a decode cycle at some "
          "size are left out")
  records = [r for r, u in zip(records, ok) if u]
  sizes = tuple(int(b) for b in records[0]["block_sizes"])
  costs = lab.read_label_costs(cfg, label_sets.LABELS, records)
  tr, va = split_train_val(records, float(bp.val_frac), int(cfg.seed))
  if len(tr) < 2:
    raise BadInputError(f"only {len(tr)} labelling prompts for training; label more prompts "
                        "(--config.blockpilot.label_sources / corpus_prompts)")
  layer_ids = _layer_ids(cfg)
  mesh = make_mesh(str(cfg.get("mesh", "") or ""))
  labelled = {r["text_hash"] for r in lab.read_label_set(cfg, label_sets.LABELS, "policy")}
  provenance = _provenance(cfg, records)
  rec_tr, rec_va = [records[i] for i in tr], [records[i] for i in va]
  summary = {"sizes": list(sizes), "train_prompts": len(tr), "val_prompts": len(va),
             "cycle_cost_ms": [round(1e3 * c, 4) for c in label_sets.cycle_costs(records)],
             "cost_table": costs if isinstance(costs, dict) else None, "policies": {}}
  for rule in rules:
    values_NK = label_sets.label_values(records, rule, costs)
    y = label_sets.labels_of(values_NK)
    static = best_static(rec_tr, rule, costs)
    majority = int(np.bincount(y[tr], minlength=len(sizes)).argmax())
    r_NK = relative_values(values_NK, static)
    prior_K = value_prior(r_NK[tr], static)
    num_NK, den_NK = rule_totals(records, rule, costs)
    for head in [h for r, h in trained_kinds((rule,), heads)]:
      for feature in features:
        name = policy_name(feature, rule, head)
        field = f"feat_{feature}"
        if field not in records[0]:
          raise BadInputError(f"dataset {label_sets.LABELS!r} holds no {feature!r} features; "
                              "rerun the labels stage with a drafter")
        x = label_sets.stack(records, field).astype(np.float32)
        arch = PolicyArch(feature, x.shape[1], int(bp.hidden_dim), int(bp.depth), len(sizes),
                          bool(bp.residual), float(bp.dropout), head)
        prices = label_prices(costs, sizes) if head == "priced" else None
        target = {"value": r_NK, "priced": count_targets(records)}.get(head, y)
        fit = fit_policy(x[tr], target[tr], x[va] if len(va) else None,
                         target[va] if len(va) else None,
                         arch, opt_cfg=bp.opt, steps=int(bp.steps), batch=int(bp.batch),
                         label_smoothing=float(bp.label_smoothing),
                         eval_every=int(bp.eval_every), patience=int(bp.patience),
                         seed=int(cfg.seed), mesh=mesh, prices_2C=prices,
                         priced_relative_weight=float(bp.priced_relative_weight))
        extra = {}
        if head in ("value", "priced"):
          x_va = x[va]
          if head == "value":
            prior = prior_K
            rhat_va = np.asarray(fit.policy(jnp.asarray(x_va)))
            choice_of = lambda l, rows=slice(None): shrunk_choice(rhat_va[rows], prior, l, static)
          else:
            prior = count_prior(rec_tr)
            choice_of = lambda l, rows=slice(None): priced_choice(fit.policy, x_va[rows], prior,
                                                                  l)
          lam, grid, extra = _lam_on_validation(choice_of, static, num_NK[va], den_NK[va], lams,
                                                rec_va, costs, bp, int(cfg.seed))
          if head == "value":
            fit.policy.set_decision(prior, lam, static)
          else:
            fit.policy.set_priced_decision(prior, lam)
          extra.update(lam=lam, prior=[round(float(p), 6) for p in prior], lam_grid=grid)
        entry = {"feature": feature, "rule": rule, "head": head,
                 "num_params": arch.num_params(),
                 "best_step": fit.best_step, "steps_run": fit.steps_run,
                 "train_accuracy": float((predict(fit.policy, x[tr]) == y[tr]).mean()),
                 "majority_class_size": sizes[majority], "static_size": sizes[static], **extra}
        if len(va):
          pred = predict(fit.policy, x[va])
          entry.update(
              val_loss=fit.val_loss, val_accuracy=float((pred == y[va]).mean()),
              val_majority_accuracy=float((y[va] == majority).mean()),
              val_policy=choice_metrics(rec_va, pred, costs),
              val_static=choice_metrics(rec_va, np.full(len(va), static), costs),
              val_oracle=choice_metrics(rec_va, y[va], costs),
              val_chosen={str(b): int((pred == k).sum()) for k, b in enumerate(sizes)})
        out = save_policy(policy_dir(cfg, feature, rule, head), fit.policy, block_sizes=sizes,
                          label_rule=rule, target_layer_ids=layer_ids,
                          labelled_hashes=labelled, meta={
                              "made_by": "train.py policy stage", **provenance,
                              "history": fit.history[-50:], **extra,
                              **{k: v for k, v in entry.items() if k.startswith("val_")}})
        entry["checkpoint"] = out
        summary["policies"][name] = entry
        print(_line(name, entry), flush=True)
  shipped = _ship(cfg, summary)
  summary["shipped"] = shipped
  os.makedirs(wd.run_dir(cfg, POLICIES_DIR), exist_ok=True)
  with open(os.path.join(wd.run_dir(cfg, POLICIES_DIR), "summary.json"), "w",
            encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  if shipped:
    print(f"[policy] shipped {shipped[0]} to {shipped[1]}")


def _lam_on_validation(choice_of, static: int, num_NK: np.ndarray, den_NK: np.ndarray,
                       lams: Sequence[float], rec_va: Sequence[Mapping[str, Any]], costs: Any,
                       bp: Any, seed: int) -> tuple[float, list[dict], dict]:
  """(lam, its grid, {"val_policy_crossfit": figures}) of a value or priced head from the
  validation prompts (`choose_lam_by`, `crossfit_by`; `choice_of(lam, rows)` its decisions on
  them, at the labelling machine's prices); lam 0 without validation prompts."""
  if not len(rec_va):
    return 0.0, [], {}
  lam_args = dict(reps=int(bp.value_reps), level=float(bp.value_level), seed=seed)
  lam, grid = choose_lam_by(choice_of, static, num_NK, den_NK, lams, **lam_args)
  cf = crossfit_by(choice_of, static, num_NK, den_NK, lams, **lam_args)
  return lam, grid, {"val_policy_crossfit": choice_metrics(rec_va, cf, costs)}


def _layer_ids(cfg: Any) -> tuple[int, ...]:
  from bp_jax.weights.checkpoint_io import read_checkpoint_meta
  config, _ = read_checkpoint_meta(wd.drafter_dir(cfg), expected_kind="dflash")
  return tuple(int(i) for i in (config.get("dflash_config") or {}).get("target_layer_ids", ()))


def _provenance(cfg: Any, records: Sequence[Mapping[str, Any]]) -> dict:
  """What the checkpoint records about its labels (their settings and prompt keys)."""
  from bp_jax.train.regenerate import read_stamp
  stamp = read_stamp(os.path.join(wd.data_dir(cfg), lab.STAMP_DIR)) or {}
  return {"labelled_prompt_keys": [r["key"] for r in records][:2000],
          "labels": {k: stamp.get(k) for k in ("sizes", "max_new_tokens", "temperature",
                                               "target_fingerprint", "label_seeds", "chat")},
          "labelled_prompts": len(records)}


def _line(name: str, e: dict) -> str:
  s = (f"[policy] {name}: {e['num_params']:,} params, stopped at {e['steps_run']} (best "
       f"{e['best_step']}); train acc {e['train_accuracy']:.3f}")
  if "val_accuracy" in e:
    s += (f", val acc {e['val_accuracy']:.3f} (majority {e['val_majority_accuracy']:.3f}); "
          f"val tau (per spec. cycle) {e['val_policy']['tau']:.3f} vs static "
          f"b={e['static_size']} {e['val_static']['tau']:.3f} (oracle "
          f"{e['val_oracle']['tau']:.3f}); tokens per target forward "
          f"{e['val_policy']['tokens_per_forward']:.3f}; est tok/s "
          f"{e['val_policy']['est_tokens_per_s']:.1f} vs "
          f"{e['val_static']['est_tokens_per_s']:.1f}")
  if "lam" in e:
    s += f"; lam {e['lam']:g} (prior {e['prior']})"
  if "val_policy_crossfit" in e:
    s += (f"; cross-fitted est tok/s {e['val_policy_crossfit']['est_tokens_per_s']:.1f} (lam "
          "chosen on the other half of the validation prompts)")
  return s


def _ship(cfg: Any, summary: dict) -> tuple[str, str] | None:
  """Copies the chosen policy to `<export_dir>/policy`; returns (name, destination) or None."""
  choice = str(cfg.blockpilot.get("ship", "auto") or "")
  pols = summary["policies"]
  if not choice or not cfg.get("export_dir"):
    return None
  if choice == "auto":  # a value policy by its cross-fitted figure (lam chosen on other prompts)
    scored = [(e.get("val_policy_crossfit", e.get("val_policy", {})).get("est_tokens_per_s", 0.0),
               n) for n, e in pols.items()]
    choice = max(scored)[1]
  if choice not in pols:
    raise BadInputError(f"--config.blockpilot.ship={choice!r} is not a trained policy; trained: "
                        f"{sorted(pols)} (or 'auto', or '' for none)")
  dst = wd.ship_checkpoint(cfg, pols[choice]["checkpoint"], "policy")
  return (choice, dst) if dst else None
