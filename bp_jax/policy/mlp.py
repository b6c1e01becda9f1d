"""BlockPilot's block-size policy: a small MLP from one prefill feature vector to a bucket index.

  z = (x - mean) * inv_std                        (normalisation statistics stored with the model)
  h = dropout(relu(z @ w_in + b_in))
  h = h + dropout(relu(h @ w_hid[i] + b_hid[i]))   for i < depth - 1 (no `h +` when not residual)
  out = h @ w_out + b_out                          (one output per candidate block size)

Three heads read `out` (`PolicyArch.head`):
  classify  `out` are class logits, trained by cross-entropy on argmax labels; the decision is
            argmax softmax(out).
  value     `out` = rhat_k(x), the regressed value of size k relative to the prompt's value at
            the best static size (r_nk = V_nk / V_n,static); the decision shrinks it toward the
            labelling set's prior:  scores_k = lam * rhat_k + (1 - lam) * prior_k  and picks
            argmax scores (ties to the static class). prior, lam and the static class are stored
            with the weights (`DecisionStat`); prior is maximal at the static class, so lam = 0
            always picks the static size ("a policy that never loses" without evidence).
  priced    `out` = [a_k(x), s_k(x)] (2C outputs), the regressed counts of size k's decode per
            new token: speculative cycles a_k and plain (AR fallback) steps s_k, which
            depend on the prompt, the drafter and the loop but not on the machine. The decision
            prices them with the costs of the machine it runs on (`size_prices`: a size-k
            cycle p_k and a fallback step q_k, in AR steps, set by the engine from the costs it
            measures, `Engine.policy_prices`; until then the labelling machine's):
              cost_k = lam * (a_k p_k + s_k q_k) + (1 - lam) * (abar_k p_k + sbar_k q_k)
            (abar, sbar: the labelling set's counts per new token) and picks argmin cost
            (scores: 1 / cost_k, tokens per AR step's time), except that it leaves the best
            static size for those costs (argmin of abar_k p_k + sbar_k q_k) only for a size
            more than `PRICED_DEPART_MARGIN` cheaper. lam = 0 picks the best static size for
            those costs; on a machine where a long verify costs about an AR step (an
            accelerator) the choice moves to long verifies without retraining.

The published policy is depth 2 (two hidden layers of 2048, the second residual), ReLU, dropout
0.2, over the last prompt position's logits. Dropout takes an explicit PRNG key (training only),
so the module holds no RNG state and two policies of the same architecture have the same graph.

A trained policy is saved as a converted checkpoint of kind "policy" (`save_policy`):
config.json holds the architecture, the candidate block sizes (class i = `block_sizes[i]`), the
label rule and the target layers of `pooled_layers`; bp_jax.json holds the provenance, including
the SHA-256 of every labelling prompt, so that evaluating on a labelling prompt can be refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.errors import BadInputError
from bp_jax.policy.features import check_feature_type, mlp_param_count

POLICY_KIND = "policy"
LABEL_RULES = ("max_tau", "max_throughput")
HEADS = ("classify", "value", "priced")
# Added to the static class's score before the value head's argmax, so that a tie (e.g. lam = 0,
# or rhat constant across sizes) picks the static size; far below any real ratio difference.
STATIC_TIE_BONUS = 1e-5
# A priced head picks a size other than the best static one of the prices in effect (its prior's
# cheapest) only where that size's cost is predicted below the static one's by more than this
# share: a per-request argmin picks the size its prediction and the prices in effect put lowest,
# so the more alike the sizes' costs, the more its picks are made by their errors. The demo's
# policy at batch 1 on the 2-core Xeon (model 207), HumanEval's evaluation half: its moves off
# b = 8 to 9, 10 and 11 decoded 2%, 4% and 8% slower than b = 8 on those requests (seven runs,
# 23-31 requests each); repriced at each run's own measured prices, 9 of its 225 moves in ten
# runs were predicted 5% cheaper than b = 8, 56 cheaper at all, 45 of those in one run where 7
# and 8 cost about alike (and its 45 moves to 7 there ran 4% slower); held to b = 8 unless 5%
# cheaper, the ten runs' requests replay at 0.999x b = 8's speed against 0.991x as they ran
# (docs/cpu_amx/size_prices_2026-12-07). On a machine whose prices move the static size
# itself (an accelerator's long verifies) the static size moves with them; only a request's
# departure from it needs the margin.
PRICED_DEPART_MARGIN = 0.05


def prompt_hash(text: str) -> str:
  """A short SHA-256 of a prompt's text: the identity used to keep label and eval sets apart."""
  return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def check_head(head: str, flag: str = "--config.blockpilot.heads") -> str:
  if head not in HEADS:
    raise BadInputError(f"{flag}: unknown policy head {head!r}; use one of {list(HEADS)}")
  return head


def check_label_rule(rule: str, flag: str = "--config.blockpilot.rules") -> str:
  if rule not in LABEL_RULES:
    raise BadInputError(f"{flag}: unknown label rule {rule!r}; use one of {list(LABEL_RULES)}")
  return rule


@dataclasses.dataclass(frozen=True)
class PolicyArch:
  """Everything that fixes the policy's graph: policies with equal archs share compiled code."""
  feature_type: str
  input_dim: int
  hidden_dim: int
  depth: int            # hidden layers (>= 1); layers after the first are residual if `residual`
  num_classes: int
  residual: bool = True
  dropout: float = 0.2
  head: str = "classify"  # HEADS: what the outputs mean and how the decision reads them

  def __post_init__(self):
    check_feature_type(self.feature_type, "policy feature_type")
    check_head(self.head, "policy head")
    for name in ("input_dim", "hidden_dim", "depth"):
      if getattr(self, name) < 1:
        raise BadInputError(f"policy {name}={getattr(self, name)} must be >= 1")
    if self.num_classes < 2:
      raise BadInputError(f"a policy needs at least 2 candidate block sizes, got "
                          f"{self.num_classes}")
    if not 0.0 <= self.dropout < 1.0:
      raise BadInputError(f"policy dropout={self.dropout} must lie in [0, 1)")

  @property
  def num_outputs(self) -> int:
    """Outputs of the last layer: one per class, two (cycles, steps) for a priced head."""
    return 2 * self.num_classes if self.head == "priced" else self.num_classes

  @property
  def signature(self) -> str:
    """Short name of the architecture, e.g. 'last_hidden-256:64x2r-5-d0.2' (classify head) or
    'last_hidden-256:64x2r-5-d0.2-value' (a compile-cache key: every field is in it, so equal
    signatures mean equal graphs)."""
    return (f"{self.feature_type}-{self.input_dim}:{self.hidden_dim}x{self.depth}"
            f"{'r' if self.residual else ''}-{self.num_classes}-d{self.dropout:g}"
            f"{'' if self.head == 'classify' else '-' + self.head}")

  def num_params(self) -> int:
    return mlp_param_count(self.input_dim, self.hidden_dim, self.depth, self.num_outputs)


class FeatureStat(nnx.Variable):
  """Input normalisation statistics: stored and loaded with the policy, never trained."""


class DecisionStat(nnx.Variable):
  """The value or priced head's decision rule (prior, lam, static class; a priced head's
  `size_prices`): stored and loaded with the policy, never trained (set by the policy stage's
  lam selection; the prices by the engine that runs it)."""


def shrunk_scores(rhat_BC: jax.Array, prior_C: jax.Array, lam: jax.Array) -> jax.Array:
  """[B, C] the value head's decision scores lam * rhat + (1 - lam) * prior."""
  return lam * rhat_BC + (1.0 - lam) * prior_C[None, :]


def priced_costs(counts_B2C: jax.Array, prices_2C: jax.Array) -> jax.Array:
  """[B, C] AR steps per new token of each size: cycles x its cycle's price + steps x
  its step's price (counts and prices laid out [cycles of every size, steps of every size])."""
  C = prices_2C.shape[-1] // 2
  return counts_B2C[:, :C] * prices_2C[None, :C] + counts_B2C[:, C:] * prices_2C[None, C:]


def decision_class(scores_BC: jax.Array, static_class: jax.Array,
                   margin: float = 0.0) -> jax.Array:
  """[B] int32 argmax of the scores, the static class's raised by `margin` (relative:
  another class wins only with a score above (1 + margin) times it) and ties (within
  `STATIC_TIE_BONUS`) to `static_class`."""
  static_C = jax.nn.one_hot(static_class, scores_BC.shape[-1])
  raised_BC = scores_BC * (1.0 + margin * static_C[None, :]) + STATIC_TIE_BONUS * static_C[None, :]
  return jnp.argmax(raised_BC, axis=-1).astype(jnp.int32)


def check_prices(cycle_C: Sequence[float], step_C: Sequence[float], C: int) -> np.ndarray:
  """[2C] float32 a priced head's costs [cycles, steps], refused unless C of each, > 0, finite."""
  cycle, step = (np.asarray(v, np.float64).reshape(-1) for v in (cycle_C, step_C))
  if cycle.shape != (C,) or step.shape != (C,):
    raise BadInputError(f"policy prices: {cycle.size} cycle and {step.size} step costs for a "
                        f"policy with {C} classes")
  both = np.concatenate([cycle, step])
  if not np.isfinite(both).all() or (both <= 0).any():
    raise BadInputError(f"policy prices must be finite and > 0, got cycles {cycle.tolist()}, "
                        f"steps {step.tolist()}")
  return both.astype(np.float32)


def _he(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
  return jax.random.normal(key, shape, jnp.float32) * np.sqrt(2.0 / fan_in)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  if key is None or rate <= 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


class BlockPolicy(nnx.Module):
  """The MLP of the module docstring; parameters float32."""

  def __init__(self, arch: PolicyArch, *, rngs: nnx.Rngs):
    self.arch = arch
    F, H, C, n_hid = arch.input_dim, arch.hidden_dim, arch.num_classes, arch.depth - 1
    self.feat_mean = FeatureStat(jnp.zeros((F,), jnp.float32))
    self.feat_inv_std = FeatureStat(jnp.ones((F,), jnp.float32))
    self.w_in = nnx.Param(_he(rngs.params(), (F, H), F))
    self.b_in = nnx.Param(jnp.zeros((H,), jnp.float32))
    if n_hid:
      # Residual branches start small so the initial network is close to one hidden layer.
      scale = 0.5 if arch.residual else 1.0
      self.w_hid = nnx.Param(scale * _he(rngs.params(), (n_hid, H, H), H))
      self.b_hid = nnx.Param(jnp.zeros((n_hid, H), jnp.float32))
    self.w_out = nnx.Param(0.1 * _he(rngs.params(), (H, arch.num_outputs), H))
    if arch.head == "priced":
      # Counts start at one cycle and no step per token; the decision starts at lam = 0 and
      # at every size's cycle and step costing one AR step (the engine or training sets them).
      one_cycle_2C = jnp.concatenate([jnp.ones((C,)), jnp.zeros((C,))])
      self.b_out = nnx.Param(one_cycle_2C)
      self.value_prior = DecisionStat(one_cycle_2C)
      self.value_lam = DecisionStat(jnp.zeros((), jnp.float32))
      self.size_prices = DecisionStat(jnp.ones((2 * C,), jnp.float32))
    elif arch.head == "value":
      # Ratios start at 1 (no size better than the static one); the decision starts at lam = 0.
      self.b_out = nnx.Param(jnp.ones((C,), jnp.float32))
      self.value_prior = DecisionStat(jnp.ones((C,), jnp.float32))
      self.value_lam = DecisionStat(jnp.zeros((), jnp.float32))
      self.static_class = DecisionStat(jnp.zeros((), jnp.int32))
    else:
      self.b_out = nnx.Param(jnp.zeros((C,), jnp.float32))

  def set_feature_stats(self, mean_F: np.ndarray, std_F: np.ndarray, floor: float = 1e-3) -> None:
    """Sets the normalisation to (x - mean) / max(std, floor * median positive std)."""
    mean_F = np.asarray(mean_F, np.float32)
    std_F = np.asarray(std_F, np.float32)
    if mean_F.shape != (self.arch.input_dim,) or std_F.shape != (self.arch.input_dim,):
      raise BadInputError(f"feature statistics of shape {mean_F.shape}/{std_F.shape} do not fit "
                          f"a policy over {self.arch.input_dim} features")
    positive = std_F[std_F > 0]
    ref = float(np.median(positive)) if positive.size else 1.0
    self.feat_mean[...] = jnp.asarray(mean_F)
    self.feat_inv_std[...] = jnp.asarray(1.0 / np.maximum(std_F, floor * ref))

  def set_decision(self, prior_C: np.ndarray, lam: float, static_class: int) -> None:
    """Sets the value head's decision rule (module docstring). The prior must be maximal at
    `static_class` (so that lam = 0 picks it) and lam must lie in [0, 1]."""
    if self.arch.head != "value":
      raise BadInputError(f"set_decision: a {self.arch.head!r} policy has no decision rule to "
                          "set (only head='value')")
    prior_C = np.asarray(prior_C, np.float32)
    C = self.arch.num_classes
    if prior_C.shape != (C,) or not np.isfinite(prior_C).all():
      raise BadInputError(f"decision prior of shape {prior_C.shape} (or not finite) for a policy "
                          f"with {C} classes")
    if not 0 <= int(static_class) < C:
      raise BadInputError(f"static class {static_class} outside [0, {C})")
    if prior_C.max() > prior_C[int(static_class)]:
      raise BadInputError(f"decision prior {prior_C.tolist()} is not maximal at the static class "
                          f"{static_class}")
    self._set_prior_and_lam(prior_C, lam)
    self.static_class[...] = jnp.asarray(int(static_class), jnp.int32)

  def set_priced_decision(self, prior_2C: np.ndarray, lam: float) -> None:
    """Sets a priced head's decision rule (module docstring): the labelling set's counts per
    new token [cycles of every size, steps of every size] and lam in [0, 1]."""
    if self.arch.head != "priced":
      raise BadInputError(f"set_priced_decision: a {self.arch.head!r} policy has no priced "
                          "decision (only head='priced')")
    prior_2C = np.asarray(prior_2C, np.float32)
    C = self.arch.num_classes
    if prior_2C.shape != (2 * C,) or not np.isfinite(prior_2C).all() or (prior_2C < 0).any():
      raise BadInputError(f"priced decision prior of shape {prior_2C.shape} (or negative, or not "
                          f"finite) for a policy with {C} classes: give {2 * C} counts >= 0")
    self._set_prior_and_lam(prior_2C, lam)

  def _set_prior_and_lam(self, prior: np.ndarray, lam: float) -> None:
    """The decision's prior (checked by the caller) and lam, refused outside [0, 1]."""
    if not 0.0 <= float(lam) <= 1.0:
      raise BadInputError(f"decision lam={lam} must lie in [0, 1]")
    self.value_prior[...] = jnp.asarray(prior)
    self.value_lam[...] = jnp.asarray(float(lam), jnp.float32)

  def set_prices(self, cycle_C: Sequence[float], step_C: Sequence[float]) -> None:
    """Sets a priced head's costs: a cycle of each size and a plain step in its loop, in AR
    steps (> 0, finite)."""
    if self.arch.head != "priced":
      raise BadInputError(f"set_prices: a {self.arch.head!r} policy prices nothing (only "
                          "head='priced')")
    self.size_prices[...] = jnp.asarray(check_prices(cycle_C, step_C, self.arch.num_classes))

  def prices(self) -> dict[str, list[float]]:
    """A priced head's costs in effect ({} for another head)."""
    if self.arch.head != "priced":
      return {}
    p = np.asarray(self.size_prices[...], np.float64)
    C = self.arch.num_classes
    return {"cycle": [round(float(v), 4) for v in p[:C]],
            "step": [round(float(v), 4) for v in p[C:]]}

  def decision(self) -> dict[str, Any]:
    """The stored decision rule as plain values ({} for a classify head)."""
    if self.arch.head == "priced":
      return {"prior": [float(p) for p in np.asarray(self.value_prior[...])],
              "lam": float(self.value_lam[...]), "prices": self.prices()}
    if self.arch.head != "value":
      return {}
    return {"prior": [float(p) for p in np.asarray(self.value_prior[...])],
            "lam": float(self.value_lam[...]), "static_class": int(self.static_class[...])}

  def decide(self, x_BF: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(scores [B, C] float32, chosen class [B] int32) of feature vectors [B, F], no dropout.

    classify: scores = softmax(logits), the class probabilities, and class = their argmax.
    value: scores = `shrunk_scores` (expected value relative to the static size, shrunk toward
    the prior: not probabilities) and class = `decision_class` (ties to the static class).
    priced: scores = 1 / cost (estimated committed tokens per AR step's time at `size_prices`,
    module docstring) and class = their argmax (ties to the best size of the prior).
    """
    out_BC = self(x_BF)
    if self.arch.head == "priced":
      prices_2C, lam = self.size_prices[...], self.value_lam[...]
      counts_B2C = lam * jnp.maximum(out_BC, 0.0) + (1.0 - lam) * self.value_prior[...][None, :]
      scores_BC = 1.0 / jnp.maximum(priced_costs(counts_B2C, prices_2C), 1e-6)
      prior_C = priced_costs(self.value_prior[...][None, :], prices_2C)[0]
      return scores_BC, decision_class(scores_BC, jnp.argmin(prior_C).astype(jnp.int32),
                                       PRICED_DEPART_MARGIN)
    if self.arch.head == "classify":
      probs_BC = jax.nn.softmax(out_BC, axis=-1)
      return probs_BC, jnp.argmax(probs_BC, axis=-1).astype(jnp.int32)
    scores_BC = shrunk_scores(out_BC, self.value_prior[...], self.value_lam[...])
    return scores_BC, decision_class(scores_BC, self.static_class[...])

  def __call__(self, x_BF: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
    """Outputs [B, C] of feature vectors [B, F] (class logits, or rhat for a value head; [B, 2C]
    counts for a priced head); dropout only when a key is given."""
    a = self.arch
    keys = [None] * a.depth if dropout_key is None else list(jax.random.split(dropout_key, a.depth))
    z = (x_BF.astype(jnp.float32) - self.feat_mean[...]) * self.feat_inv_std[...]
    h = _dropout(jax.nn.relu(z @ self.w_in[...] + self.b_in[...]), a.dropout, keys[0])
    for i in range(a.depth - 1):
      u = _dropout(jax.nn.relu(h @ self.w_hid[i] + self.b_hid[i]), a.dropout, keys[i + 1])
      h = h + u if a.residual else u
    return h @ self.w_out[...] + self.b_out[...]


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
  """What a policy checkpoint says besides its weights."""
  block_sizes: tuple[int, ...]          # class i decodes with block_sizes[i]
  label_rule: str
  target_layer_ids: tuple[int, ...]     # the drafter layers `pooled_layers` was computed from
  labelled_hashes: frozenset[str]       # `prompt_hash` of every labelling prompt
  meta: dict                            # the whole bp_jax.json

  def overlap(self, texts: Iterable[str]) -> list[int]:
    """Indices of the given prompt texts that the policy was labelled on."""
    return [i for i, t in enumerate(texts) if prompt_hash(t) in self.labelled_hashes]


def _config_dict(policy: BlockPolicy, block_sizes: Sequence[int], label_rule: str,
                 target_layer_ids: Sequence[int]) -> dict[str, Any]:
  return {"architectures": ["BlockPilotPolicy"], **dataclasses.asdict(policy.arch),
          "block_sizes": [int(b) for b in block_sizes], "label_rule": label_rule,
          "target_layer_ids": [int(i) for i in target_layer_ids]}


def save_policy(out_dir: str, policy: BlockPolicy, *, block_sizes: Sequence[int],
                label_rule: str, target_layer_ids: Sequence[int],
                labelled_hashes: Iterable[str], meta: dict | None = None) -> str:
  """Saves a trained policy (weights and normalisation statistics) as a "policy" checkpoint.

  `labelled_hashes`: `prompt_hash` of every prompt used to label (train or validate) it.
  """
  from bp_jax.weights.checkpoint_io import save_checkpoint

  if len(block_sizes) != policy.arch.num_classes:
    raise BadInputError(f"{len(block_sizes)} block sizes for a policy with "
                        f"{policy.arch.num_classes} classes")
  check_label_rule(label_rule, "label_rule")
  state = jax.tree.map(np.asarray, nnx.state(policy).to_pure_dict())
  decision = policy.decision()
  full_meta = {"kind": POLICY_KIND, **(meta or {}),
               "labelled_prompt_hashes": sorted(set(labelled_hashes)),
               "num_trainable_params": policy.arch.num_params(),
               **({"decision": decision} if decision else {})}
  return save_checkpoint(out_dir, state, _config_dict(policy, block_sizes, label_rule,
                                                      target_layer_ids), full_meta,
                         overwrite=True)


def load_policy(ckpt_dir: str) -> tuple[BlockPolicy, PolicyInfo]:
  """Loads a "policy" checkpoint written by `save_policy`."""
  from bp_jax.weights.checkpoint_io import load_checkpoint
  from bp_jax.models.nnx_utils import module_from_params

  params, config, meta = load_checkpoint(ckpt_dir, expected_kind=POLICY_KIND)
  where = f"{ckpt_dir}/config.json"
  try:
    # A checkpoint written before `head` existed holds a classifier.
    arch = PolicyArch(**{f.name: config[f.name] for f in dataclasses.fields(PolicyArch)
                         if f.name in config or f.name != "head"})
    sizes = tuple(int(b) for b in config["block_sizes"])
    rule = str(config["label_rule"])
    layer_ids = tuple(int(i) for i in config.get("target_layer_ids", ()))
  except KeyError as e:
    raise BadInputError(f"{where}: missing key {e.args[0]!r}") from None
  except BadInputError as e:
    raise BadInputError(f"{where}: {e}") from None
  if len(sizes) != arch.num_classes:
    raise BadInputError(f"{where}: {len(sizes)} block_sizes for num_classes={arch.num_classes}")
  try:
    policy = module_from_params(lambda: BlockPolicy(arch, rngs=nnx.Rngs(0)), params)
  except ValueError as e:
    raise BadInputError(f"policy checkpoint {ckpt_dir}: parameters do not match its "
                        f"config.json ({e})") from None
  info = PolicyInfo(sizes, rule, layer_ids, frozenset(meta.get("labelled_prompt_hashes", ())),
                    meta)
  return policy, info


def random_block_size(block_sizes: Sequence[int], seed: int, index: int) -> int:
  """The `random` control: a uniform draw over the candidates, fixed by (seed, request index)."""
  rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index), 0x5EED])
  return int(block_sizes[int(rng.integers(len(block_sizes)))])
