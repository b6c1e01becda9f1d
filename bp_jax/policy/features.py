"""The block-size policy's input features, read from the prefill that ran
(docs/design.md §5).

Four feature types, all computed inside the prefill jit from the target's one forward over the
padded prompt (no extra target pass); each is a float32 vector per request:

  last_logits    [V]      the target's logits at the last prompt position (the published choice)
  last_hidden    [D]      the final hidden state (after the final norm) at the last position
  pooled_layers  [2*n*D]  for each of the drafter's n chosen target layers (in
                          `target_layer_ids` order): the mean of the layer's output over the n
                          valid prompt positions (padding excluded), then its output at the last
                          prompt position; concatenated layer by layer:
                          [mean_0, last_0, mean_1, last_1, ...]
  draft_confidence [2*b]  the drafter's first block, drafted in the prefill from the prompt's
                          context (one drafter pass, b = the drafter's training block size):
                          for each of its b-1 draft positions the max probability, then each
                          one's entropy (nats), then the max probability and entropy of the
                          target's own next-token distribution. How sure the drafter is of its
                          first block predicts how many drafts the target will accept.

Shape suffixes: n chosen layers, B batch, P padded prompt length, D hidden, V vocabulary, F feature.
"""

from __future__ import annotations

from typing import Collection, Sequence

import jax
import jax.numpy as jnp

from bp_jax.errors import BadInputError

LAST_LOGITS, LAST_HIDDEN, POOLED_LAYERS = "last_logits", "last_hidden", "pooled_layers"
DRAFT_CONFIDENCE = "draft_confidence"
FEATURE_TYPES = (LAST_LOGITS, LAST_HIDDEN, POOLED_LAYERS, DRAFT_CONFIDENCE)


def check_feature_type(name: str, flag: str = "--config.blockpilot.features") -> str:
  """`name` if it is a known feature type, else a BadInputError naming `flag`."""
  if name not in FEATURE_TYPES:
    raise BadInputError(f"{flag}: unknown feature type {name!r}; use one of {list(FEATURE_TYPES)}")
  return name


def parse_feature_types(text: str, flag: str = "--config.blockpilot.features") -> tuple[str, ...]:
  """'a,b' -> ('a', 'b'), each checked; empty or repeated entries are refused."""
  names = tuple(s.strip() for s in str(text or "").split(",") if s.strip())
  if not names:
    raise BadInputError(f"{flag} is empty; give some of {list(FEATURE_TYPES)}")
  if len(set(names)) != len(names):
    raise BadInputError(f"{flag}={text!r} repeats a feature type")
  return tuple(check_feature_type(n, flag) for n in names)


def feature_dims(vocab_size: int, hidden_size: int, num_layers: int,
                 draft_block_size: int = 0) -> dict[str, int]:
  """Length of each feature vector for a target of these sizes, n = `num_layers` chosen layers
  and a drafter of training block size `draft_block_size` (both 0 when there is no drafter:
  then `pooled_layers` and `draft_confidence` are not available)."""
  dims = {LAST_LOGITS: vocab_size, LAST_HIDDEN: hidden_size}
  if num_layers > 0:
    dims[POOLED_LAYERS] = 2 * num_layers * hidden_size
  if draft_block_size > 1:
    dims[DRAFT_CONFIDENCE] = 2 * draft_block_size
  return dims


def _max_prob_and_entropy(logits_BKV: jax.Array) -> tuple[jax.Array, jax.Array]:
  logp = jax.nn.log_softmax(logits_BKV.astype(jnp.float32), axis=-1)
  p = jnp.exp(logp)
  return jnp.max(p, axis=-1), -jnp.sum(p * logp, axis=-1)


def draft_confidence(draft_logits_BKV: jax.Array, target_logits_BV: jax.Array) -> jax.Array:
  """[B, 2*(K+1)]: max probability of each of the K draft positions, their entropies, then the
  target's next-token max probability and entropy."""
  dmax, dent = _max_prob_and_entropy(draft_logits_BKV)
  tmax, tent = _max_prob_and_entropy(target_logits_BV[:, None])
  return jnp.concatenate([dmax, dent, tmax, tent], axis=-1)


def pooled_layers(layer_hiddens_nBPD: jax.Array, n: jax.Array) -> jax.Array:
  """[B, 2*n_layers*D]: per chosen layer, the mean over positions < n, then the value at n - 1."""
  nl, B, P, D = layer_hiddens_nBPD.shape
  h = layer_hiddens_nBPD.astype(jnp.float32)
  valid_P = (jnp.arange(P) < n).astype(jnp.float32)
  mean_nBD = jnp.einsum("nbpd,p->nbd", h, valid_P) / jnp.maximum(n, 1).astype(jnp.float32)
  last_nBD = jax.lax.dynamic_index_in_dim(h, n - 1, axis=2, keepdims=False)
  both_BnkD = jnp.stack([mean_nBD, last_nBD], axis=1).transpose(2, 0, 1, 3)  # [B, n, 2, D]
  return both_BnkD.reshape(B, nl * 2 * D)


def prefill_features(logits_BV: jax.Array, final_hidden_BD: jax.Array,
                     layer_hiddens_nBPD: jax.Array | None, n: jax.Array,
                     draft_logits_BKV: jax.Array | None = None,
                     wanted: Collection[str] = FEATURE_TYPES) -> dict[str, jax.Array]:
  """The `wanted` features among those available, float32 [B, F], from one prefill's outputs.

  Args:
    logits_BV: logits at the last prompt position (the forward's `logits_at=n-1` output).
    final_hidden_BD: the final-normed hidden state there.
    layer_hiddens_nBPD: the chosen layers' outputs over the padded prompt, or None (no drafter).
    n: the true prompt length (positions >= n are padding).
    draft_logits_BKV: the drafter's logits at the b-1 draft positions of its first block, or
      None (no drafter).
    wanted: the feature types to compute (default: every one).
  """
  out = {LAST_LOGITS: logits_BV.astype(jnp.float32),
         LAST_HIDDEN: final_hidden_BD.astype(jnp.float32)}
  if (POOLED_LAYERS in wanted and layer_hiddens_nBPD is not None
      and layer_hiddens_nBPD.shape[0] > 0):
    out[POOLED_LAYERS] = pooled_layers(layer_hiddens_nBPD, n)
  if DRAFT_CONFIDENCE in wanted and draft_logits_BKV is not None:
    out[DRAFT_CONFIDENCE] = draft_confidence(draft_logits_BKV, logits_BV)
  return {k: v for k, v in out.items() if k in wanted}


def mlp_param_count(input_dim: int, hidden_dim: int, depth: int, num_classes: int) -> int:
  """Trainable parameters of the policy MLP (`bp_jax.policy.mlp.BlockPolicy`) of these sizes."""
  return (input_dim * hidden_dim + hidden_dim + (depth - 1) * (hidden_dim * hidden_dim + hidden_dim)
          + hidden_dim * num_classes + num_classes)


def policy_costs(vocab_size: int, hidden_size: int, num_layers: int, hidden_dim: int, depth: int,
                 num_classes: int, feature_types: Sequence[str] = FEATURE_TYPES,
                 draft_block_size: int = 0) -> dict[str, int]:
  """Policy parameter counts per feature type for a target of these sizes (no model needed)."""
  dims = feature_dims(vocab_size, hidden_size, num_layers, draft_block_size)
  return {f: mlp_param_count(dims[f], hidden_dim, depth, num_classes) for f in feature_types
          if f in dims}
