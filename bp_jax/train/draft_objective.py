"""The DFlash drafter training objective (docs/design.md §6): pure, jit-friendly pieces.

One training example is a sequence `tokens[0:length]` whose positions `prompt_len..length-1` are
the target's own (regenerated) response. For every sequence we sample up to A anchor positions;
anchor `p` starts a block of b positions at absolute positions `p .. p+b-1`:

  block tokens  [tokens[p], MASK, ..., MASK]      (what the decoder feeds the drafter)
  labels        [tokens[p], tokens[p+1], ..., tokens[p+b-1]]   (position k predicts p+k)
  context       the target's chosen-layer features of positions 0 .. p-1 (strictly before p)

which is exactly one draft step of the decoder (docs/design.md §3) with the bonus token
`tokens[p]` at position p and the committed prefix `tokens[:p]` as context. All A blocks of a
sequence are trained in one drafter pass: the queries are the A*b block positions, the keys/values are
[context of every position ; all blocks], and a mask makes every block see only the context before
its own anchor and its own block (bidirectionally), never another block.

Shape suffixes: B batch, T sequence positions, A anchors, b block size, k draft positions (b-1),
n chosen target layers, L draft layers, N/K/G/H query heads, kv heads, heads per kv head, head_dim,
D hidden, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bp_jax.errors import BadInputError
from bp_jax.models import layers as L
from bp_jax.models.dflash import DFlashDrafter

DRAFT_LOSSES = ("ce", "kl", "tvd", "mix")
CE_LABELS = ("data", "argmax")

# Published decay constants: gamma 7 for b = 16, 5 for b = 10, 4 for b = 8 (docs/design.md §6).
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


# ---- anchors and blocks ----------------------------------------------------------------------


def anchor_bounds(prompt_len_B: jax.Array, length_B: jax.Array,
                  block_size: int) -> tuple[jax.Array, jax.Array]:
  """The inclusive range [lo, hi] of admissible anchors of each sequence.

  lo = max(prompt_len, 1): the anchor token is a response token (never a prompt token) and at
  least one context position precedes it, as in decoding, where the first block starts at the
  first generated token after a non-empty prompt.
  hi = length - block_size: the block's last label `anchor + b - 1` is a real token (< length).
  A sequence has no admissible anchor when hi < lo.
  """
  lo_B = jnp.maximum(jnp.asarray(prompt_len_B, jnp.int32), 1)
  hi_B = jnp.asarray(length_B, jnp.int32) - block_size
  return lo_B, hi_B


def sample_anchors(rng: jax.Array, prompt_len_B: jax.Array, length_B: jax.Array, seq_len: int,
                   num_anchors: int, block_size: int) -> tuple[jax.Array, jax.Array]:
  """Up to `num_anchors` distinct anchors per sequence, uniformly among the admissible ones.

  Admissible (see `anchor_bounds`): `max(prompt_len, 1) <= anchor <= length - block_size`, so an
  anchor is never in the prompt and always leaves room for a full block of real labels. `length`
  is clipped to `seq_len`. The subset is uniform without replacement (the positions with the
  A smallest i.i.d. uniform keys); a sequence with fewer admissible positions than A gets all of
  them and invalid slots for the rest. Draw a fresh `rng` every step to re-sample.

  Returns:
    anchors_BA int32, ascending among the valid slots (invalid slots hold 0), and valid_BA bool
    (the valid slots come first).
  """
  B = prompt_len_B.shape[0]
  A, T = num_anchors, seq_len
  lo_B, hi_B = anchor_bounds(prompt_len_B, jnp.minimum(length_B, T), block_size)
  pos_T = jnp.arange(T, dtype=jnp.int32)
  ok_BT = (pos_T[None, :] >= lo_B[:, None]) & (pos_T[None, :] <= hi_B[:, None])
  keys_BT = jnp.where(ok_BT, jax.random.uniform(rng, (B, T)), 2.0)  # inadmissible: never first
  k = min(A, T)
  _, idx_Bk = jax.lax.top_k(-keys_BT, k)  # the k smallest keys
  idx_Bk = idx_Bk.astype(jnp.int32)
  chosen_ok_Bk = jnp.take_along_axis(ok_BT, idx_Bk, axis=1)
  anchors_Bk = jnp.sort(jnp.where(chosen_ok_Bk, idx_Bk, T), axis=1)  # valid ones first
  valid_Bk = anchors_Bk < T
  anchors_Bk = jnp.where(valid_Bk, anchors_Bk, 0)
  if k < A:
    anchors_Bk = jnp.pad(anchors_Bk, ((0, 0), (0, A - k)))
    valid_Bk = jnp.pad(valid_Bk, ((0, 0), (0, A - k)))
  return anchors_Bk, valid_Bk


def build_blocks(tokens_BT: jax.Array, anchors_BA: jax.Array, block_size: int,
                 mask_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Drafter inputs and labels of every block.

  Returns:
    block_tokens_BAb: [tokens[anchor], MASK, ..., MASK];
    block_pos_BAb: absolute positions anchor + k;
    labels_BAb: tokens[anchor + k] (position 0's label is the anchor token itself and is never
      trained; positions past the sequence are clipped, only possible for invalid anchors).
  """
  T = tokens_BT.shape[1]
  b = block_size
  block_pos_BAb = anchors_BA[..., None] + jnp.arange(b, dtype=jnp.int32)
  B, A = anchors_BA.shape
  labels_BAb = jnp.take_along_axis(
      tokens_BT, jnp.minimum(block_pos_BAb, T - 1).reshape(B, A * b), axis=1).reshape(B, A, b)
  block_tokens_BAb = jnp.full((B, A, b), mask_id, tokens_BT.dtype)
  block_tokens_BAb = block_tokens_BAb.at[..., 0].set(labels_BAb[..., 0])
  return block_tokens_BAb, block_pos_BAb, labels_BAb


def training_mask(anchors_BA: jax.Array, valid_BA: jax.Array, block_size: int,
                  seq_len: int) -> jax.Array:
  """The dense training visibility mask [B, A*b, T + A*b] (queries x [context ; blocks]).

  Query (a, k) (block a, position k) sees context column t iff t < anchor[a], and block column
  (a', k') iff a' == a (its own block, bidirectionally); an invalid anchor sees nothing.
  `drafter_train_forward` uses the factored form of the same rule (context part [B, A, T] and a
  per-block diagonal part), which never builds the A*b x A*b cross-block zeros.
  """
  B, A = anchors_BA.shape
  b, T = block_size, seq_len
  ctx_BAT = jnp.arange(T)[None, None, :] < anchors_BA[..., None]
  ctx_BAbT = jnp.broadcast_to(ctx_BAT[:, :, None, :], (B, A, b, T))
  own_AA = jnp.eye(A, dtype=bool)
  blk_BAbAb = jnp.broadcast_to(own_AA[None, :, None, :, None], (B, A, b, A, b))
  mask_BAbS = jnp.concatenate([ctx_BAbT, blk_BAbAb.reshape(B, A, b, A * b)], axis=-1)
  mask_BAbS = mask_BAbS & valid_BA[:, :, None, None]
  return mask_BAbS.reshape(B, A * b, T + A * b)


# ---- loss weights and metrics ----------------------------------------------------------------


def default_gamma(block_size: int) -> float:
  """The loss decay constant: the published 4 / 5 / 7 for b = 8 / 10 / 16, interpolated
  linearly in between and held constant outside [8, 16]."""
  xs, ys = zip(*_GAMMA_POINTS)
  return float(np.interp(block_size, xs, ys))


def loss_weights(block_size: int, gamma: float) -> jax.Array:
  """Per-block-position weights [b]: w_0 = 0 (the anchor is given), w_k = exp(-(k-1)/gamma)."""
  if gamma <= 0:
    raise ValueError(f"loss decay gamma must be > 0, got {gamma}")
  k = np.arange(block_size, dtype=np.float64)
  w = np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0)
  return jnp.asarray(w, jnp.float32)


def acceptance_lengths(draft_BAk: jax.Array, labels_BAk: jax.Array) -> jax.Array:
  """Per block: 1 + the number of leading draft positions equal to their label; [B, A] int32.

  `draft_BAk` holds the drafter's tokens at block positions 1..b-1 (or logits [B, A, k, V], whose
  argmax is taken), `labels_BAk` the true tokens at anchor+1..anchor+b-1.
  """
  if draft_BAk.ndim == labels_BAk.ndim + 1:
    draft_BAk = jnp.argmax(draft_BAk, axis=-1)
  match_BAk = (draft_BAk == labels_BAk).astype(jnp.int32)
  return 1 + jnp.sum(jnp.cumprod(match_BAk, axis=-1), axis=-1)


def expected_acceptance_length(draft_BAk: jax.Array, labels_BAk: jax.Array,
                               valid_BA: jax.Array) -> jax.Array:
  """Mean over valid blocks of the greedy acceptance length under teacher forcing (a scalar).

  For a block at anchor p it counts a = the number of leading draft positions k = 1, 2, ...
  whose drafter argmax equals the data token at p+k, and returns a + 1 (the committed tokens of
  that cycle, bonus token included), averaged over the valid blocks (0 when none is valid).

  What it predicts: the decoder's tau for this block size at temperature 0, when the data are
  the target's own greedy continuations. In a decode cycle at position p the drafter sees
  exactly the features of the committed prefix (here: of the true prefix; identical, because the
  committed tokens are the target's greedy tokens) and draft d_i is accepted iff it equals the
  target's greedy token after [.., t, d_1..d_{i-1}], which for an accepted prefix is the data
  token p+i. Differences from a real decode: anchors are uniform over response positions whereas
  cycles start where the previous cycle ended, blocks near the end are not truncated by
  max_new_tokens/stop tokens, and for data sampled at temperature > 0 the labels are one sample,
  so the metric is then a lower-variance proxy rather than the decoder's tau at that temperature.
  """
  acc_BA = acceptance_lengths(draft_BAk, labels_BAk).astype(jnp.float32)
  w_BA = valid_BA.astype(jnp.float32)
  return jnp.sum(acc_BA * w_BA) / jnp.maximum(jnp.sum(w_BA), 1.0)


# ---- the drafter's training forward ----------------------------------------------------------


def context_kv(drafter: DFlashDrafter, target_hiddens_nBTD: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """Every draft layer's context keys/values [L, B, T, K, H] for all T positions.

  The same computation as `DFlashDrafter.add_context` on an empty cache (c = hidden_norm(fc(
  concat)), k_proj / v_proj, k_norm, RoPE at positions 0..T-1), returned directly instead of
  scattered into a cache (the scatter measured ~20% slower training steps on CPU).
  The tests check it against `add_context` + `draft`.
  """
  c = drafter.cfg.layers
  _, B, T, _ = target_hiddens_nBTD.shape
  K, H = c.num_key_value_heads, c.head_dim
  ctx_BTD = drafter.context_features(target_hiddens_nBTD)
  pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
  cos_BTH, sin_BTH = L.rope_cos_sin(pos_BT, H, c.rope_theta)
  p = drafter.layers.as_dict()
  k_LBTKH = jnp.einsum("btd,ldx->lbtx", ctx_BTD, p["k_proj"]).reshape(-1, B, T, K, H)
  v_LBTKH = jnp.einsum("btd,ldx->lbtx", ctx_BTD, p["v_proj"]).reshape(-1, B, T, K, H)
  k_LBTKH = jax.vmap(lambda k, w: L.rms_norm(k, w, c.rms_norm_eps))(k_LBTKH, p["k_norm"])
  k_LBTKH = jax.vmap(lambda k: L.apply_rope(k, cos_BTH, sin_BTH))(k_LBTKH)
  return k_LBTKH, v_LBTKH


def _block_attend(q_BAbNH: jax.Array, k_ctx_BTKH: jax.Array, v_ctx_BTKH: jax.Array,
                  ctx_mask_BAT: jax.Array, k_blk_BAbKH: jax.Array, v_blk_BAbKH: jax.Array,
                  valid_BA: jax.Array) -> jax.Array:
  """GQA of every block's queries over (context masked per anchor) + (its own block); [B, A*b, N*H].

  One float32 softmax over both parts. Rows of invalid anchors see nothing and return zeros.
  """
  B, A, b, N, H = q_BAbNH.shape
  K, T = k_ctx_BTKH.shape[2], k_ctx_BTKH.shape[1]
  scale = H ** -0.5
  q_BAbKGH = q_BAbNH.reshape(B, A, b, K, N // K, H)
  s_ctx = jnp.einsum("bajkgh,btkh->bkgajt", q_BAbKGH, k_ctx_BTKH,
                     preferred_element_type=jnp.float32) * scale
  s_blk = jnp.einsum("bajkgh,baukh->bkgaju", q_BAbKGH, k_blk_BAbKH,
                     preferred_element_type=jnp.float32) * scale
  s_BKGAbS = jnp.concatenate([s_ctx, s_blk], axis=-1)  # S = T + b
  ctx_BAbT = jnp.broadcast_to(ctx_mask_BAT[:, :, None, :], (B, A, b, T))
  blk_BAbb = jnp.broadcast_to(valid_BA[:, :, None, None], (B, A, b, b))
  mask_B11AbS = jnp.concatenate([ctx_BAbT & valid_BA[:, :, None, None], blk_BAbb],
                                axis=-1)[:, None, None]
  s_BKGAbS = jnp.where(mask_B11AbS, s_BKGAbS, -1e30)
  w_BKGAbS = jnp.where(mask_B11AbS, jax.nn.softmax(s_BKGAbS, axis=-1), 0.0)
  w_ctx, w_blk = w_BKGAbS[..., :T], w_BKGAbS[..., T:]
  o_BAbKGH = (jnp.einsum("bkgajt,btkh->bajkgh", w_ctx.astype(v_ctx_BTKH.dtype), v_ctx_BTKH,
                         preferred_element_type=jnp.float32)
              + jnp.einsum("bkgaju,baukh->bajkgh", w_blk.astype(v_blk_BAbKH.dtype), v_blk_BAbKH,
                           preferred_element_type=jnp.float32))
  return o_BAbKGH.reshape(B, A * b, N * H).astype(q_BAbNH.dtype)


def drafter_train_forward(drafter: DFlashDrafter, target_hiddens_nBTD: jax.Array,
                          block_emb_BAbD: jax.Array, anchors_BA: jax.Array, valid_BA: jax.Array,
                          *, dense_mask: bool = False) -> jax.Array:
  """Final-normed drafter states [B, A, b, D] of all blocks of every sequence, in one pass.

  Args:
    drafter: the drafter being trained.
    target_hiddens_nBTD: the target's chosen-layer hidden states at every position (frozen).
    block_emb_BAbD: the target's embedding of each block `[tokens[anchor], MASK, ...]`.
    anchors_BA, valid_BA: from `sample_anchors`; block a sits at positions anchor[a] + 0..b-1.
    dense_mask: attend with the dense `training_mask` over [context ; all blocks] (reference,
      A times more attention work) instead of the factored form. Both give the same result.

  Per draft layer: block x_n = input_layernorm(x); queries, and the block's own keys/values,
  from x_n (q_norm / k_norm, RoPE at the block's absolute positions); context keys/values from
  `context_kv` (shared by all blocks); one attention under the training mask; o_proj, residual,
  MLP, residual. This is `DFlashDrafter.draft` with the context cache holding positions < anchor,
  for every anchor at once. Multiply by the target's head weight for logits.
  """
  c = drafter.cfg.layers
  eps, N, K, H = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
  B, A, b, D = block_emb_BAbD.shape
  T = target_hiddens_nBTD.shape[2]
  k_ctx_LBTKH, v_ctx_LBTKH = context_kv(drafter, target_hiddens_nBTD)
  pos_BQ = (anchors_BA[..., None] + jnp.arange(b, dtype=jnp.int32)).reshape(B, A * b)
  cos_BQH, sin_BQH = L.rope_cos_sin(pos_BQ, H, c.rope_theta)
  ctx_mask_BAT = jnp.arange(T)[None, None, :] < anchors_BA[..., None]
  dense_BQS = training_mask(anchors_BA, valid_BA, b, T) if dense_mask else None

  def body(x_BQD, xs):
    p, k_ctx_BTKH, v_ctx_BTKH = xs
    xn_BQD = L.rms_norm(x_BQD, p["input_norm"], eps)
    q_BQNH = L.project_q(xn_BQD, p, cos_BQH, sin_BQH, N, H, eps)
    k_blk_BQKH, v_blk_BQKH = L.project_kv(xn_BQD, p, cos_BQH, sin_BQH, K, H, eps)
    if dense_mask:
      attn_BQX = L.attend_BSKH(q_BQNH, jnp.concatenate([k_ctx_BTKH, k_blk_BQKH], axis=1),
                               jnp.concatenate([v_ctx_BTKH, v_blk_BQKH], axis=1), dense_BQS)
    else:
      attn_BQX = _block_attend(q_BQNH.reshape(B, A, b, N, H), k_ctx_BTKH, v_ctx_BTKH,
                               ctx_mask_BAT, k_blk_BQKH.reshape(B, A, b, K, H),
                               v_blk_BQKH.reshape(B, A, b, K, H), valid_BA)
    h_BQD = x_BQD + attn_BQX @ p["o_proj"]
    x_BQD = h_BQD + L.swiglu_mlp(L.rms_norm(h_BQD, p["post_norm"], eps), p)
    return x_BQD, None

  x_BQD = block_emb_BAbD.reshape(B, A * b, D).astype(drafter.dtype)
  # Unrolled: a drafter has few layers, and on XLA:CPU the scanned backward (stacking per-layer
  # gradients with dynamic-update-slice) measured ~20% slower than the unrolled one.
  x_BQD, _ = jax.lax.scan(body, x_BQD, (drafter.layers.as_dict(), k_ctx_LBTKH, v_ctx_LBTKH),
                          unroll=True)
  return L.rms_norm(x_BQD, drafter.norm[...], eps).reshape(B, A, b, D)


# ---- the loss --------------------------------------------------------------------------------


def target_pass(target: nnx.Module, tokens_BT: jax.Array, layer_ids: tuple[int, ...],
                logits_at_BM: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """The frozen target's chosen-layer hidden states [n, B, T, D] of every position and, with
  `logits_at_BM` [B, M], its float32 logits there [B, M, V] (else None); one pass.

  A causal forward over the whole (padded) sequence on an empty cache of T slots; the vocabulary
  projection runs only at the requested positions. Padding after a sequence does not affect its
  positions (causal). Gradients are stopped.
  """
  B, T = tokens_BT.shape
  at = jnp.zeros((B,), jnp.int32) if logits_at_BM is None else logits_at_BM
  out = target(tokens_BT, target.init_cache(B, T), tuple(layer_ids), logits_at=at)
  logits = None if logits_at_BM is None else jax.lax.stop_gradient(out.logits)
  return jax.lax.stop_gradient(out.layer_hiddens), logits


def target_features(target: nnx.Module, tokens_BT: jax.Array,
                    layer_ids: tuple[int, ...]) -> jax.Array:
  """The frozen target's chosen-layer hidden states [n, B, T, D] of every position (`target_pass`
  without logits)."""
  return target_pass(target, tokens_BT, layer_ids)[0]


def soft_target_positions(anchors_BA: jax.Array, block_size: int, seq_len: int) -> jax.Array:
  """[B, A*(b-1)] the positions whose target logits predict draft positions 1..b-1 of each
  block: anchor + k - 1 (the target's next-token distribution after the true prefix)."""
  B, A = anchors_BA.shape
  pos_BAk = anchors_BA[..., None] + jnp.arange(block_size - 1, dtype=jnp.int32)
  return jnp.minimum(pos_BAk, seq_len - 1).reshape(B, A * (block_size - 1))


def block_logits(target: nnx.Module, hidden_BAbD: jax.Array) -> jax.Array:
  """float32 logits [B, A, b-1, V] at draft positions 1..b-1 with the target's (frozen) head."""
  head_DV = jax.lax.stop_gradient(target.head_weight())
  return jnp.einsum("bajd,dv->bajv", hidden_BAbD[:, :, 1:], head_DV.astype(hidden_BAbD.dtype),
                    preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class DraftLoss:
  """The per-position training objective of the drafter (`--config.draft.loss`).

  ce:  cross-entropy against the data token (the target's response), as DFlash trains.
  kl:  forward KL(p_t || q_t) against the frozen target's distribution at that position after
       the true prefix, both at `temperature` t (p_t = softmax(target logits / t)): distillation
       with soft targets (DistillSpec's forward KL).
  tvd: total variation TV(p_t, q_t): 1 - TV is the acceptance probability of speculative
       rejection sampling at temperature t, so this maximises it directly.
  mix: (1 - mix_weight) * ce + mix_weight * kl: the argmax for T = 0, the spread for T > 0.
  ce_label: what the CE of `mix` is taken against: "data" (the data token; for responses
  sampled at T > 0 a sample, not the argmax) or "argmax" (the target's own argmax at that
  position after the true prefix: the token T = 0 decoding needs there, on every context).
  """
  kind: str = "ce"
  temperature: float = 1.0
  mix_weight: float = 0.5
  ce_label: str = "data"

  def __post_init__(self):
    """Each field checked; the errors name the `--config.draft` flag that sets it."""
    if self.kind not in DRAFT_LOSSES:
      raise BadInputError(f"--config.draft.loss={self.kind!r} is not one of "
                          f"{list(DRAFT_LOSSES)}")
    if not self.temperature > 0:
      raise BadInputError(f"--config.draft.distill_temperature={self.temperature} must be > 0")
    if not 0 <= self.mix_weight <= 1:
      raise BadInputError(f"--config.draft.mix_weight={self.mix_weight} must lie in [0, 1]")
    if self.ce_label not in CE_LABELS:
      raise BadInputError(f"--config.draft.ce_label={self.ce_label!r} is not one of "
                          f"{list(CE_LABELS)}")

  @property
  def soft(self) -> bool:
    """Whether the objective needs the target's logits at the block positions."""
    return self.kind != "ce" or self.ce_label == "argmax"


def distribution_gaps(logits_BAkV: jax.Array, target_logits_BAkV: jax.Array,
                      temperature: float) -> tuple[jax.Array, jax.Array]:
  """(KL(p_t || q_t), TV(p_t, q_t)) per position [B, A, k], p the target's, q the drafter's."""
  logp = jax.nn.log_softmax(target_logits_BAkV / temperature, axis=-1)
  logq = jax.nn.log_softmax(logits_BAkV / temperature, axis=-1)
  p, q = jnp.exp(logp), jnp.exp(logq)
  kl = jnp.sum(p * (logp - logq), axis=-1)
  tv = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
  return kl, tv


def block_metrics(logits_BAkV: jax.Array, labels_BAb: jax.Array, valid_BA: jax.Array,
                  weights_b: jax.Array, target_logits_BAkV: jax.Array | None = None,
                  loss: DraftLoss = DraftLoss()) -> dict[str, jax.Array]:
  """The weighted objective and the other per-batch statistics of a set of blocks.

  Returns sums (to aggregate over batches) and their ratios: loss = sum_w(objective) / sum(w)
  over the valid blocks' positions 1..b-1 (`loss.kind`, its CE against `loss.ce_label`; CE
  against the data without target logits); ce = the weighted CE against the data; accuracy = top-1 over those positions (unweighted); acceptance_length =
  `expected_acceptance_length`; with target logits also tv_acceptance = mean 1 - TV(p_t, q_t)
  over the positions (unweighted): rejection sampling's per-position acceptance at t.
  """
  labels_BAk = labels_BAb[:, :, 1:]
  ce_BAk = optax.softmax_cross_entropy_with_integer_labels(logits_BAkV, labels_BAk)
  v_BA1 = valid_BA.astype(jnp.float32)[..., None]
  w_BAk = weights_b[1:][None, None, :] * v_BA1
  w_sum = jnp.sum(w_BAk)
  ce_sum = jnp.sum(ce_BAk * w_BAk)
  objective_BAk, extra = ce_BAk, {}
  if target_logits_BAkV is not None:
    kl_BAk, tv_BAk = distribution_gaps(logits_BAkV, target_logits_BAkV, loss.temperature)
    hard_BAk = ce_BAk
    if loss.ce_label == "argmax":
      hard_BAk = optax.softmax_cross_entropy_with_integer_labels(
          logits_BAkV, jnp.argmax(target_logits_BAkV, axis=-1))
    objective_BAk = {"ce": hard_BAk, "kl": kl_BAk, "tvd": tv_BAk,
                     "mix": (1 - loss.mix_weight) * hard_BAk + loss.mix_weight * kl_BAk
                     }[loss.kind]
    extra = {"kl_sum": jnp.sum(kl_BAk * w_BAk),
             "tv_acceptance_sum": jnp.sum((1.0 - tv_BAk) * v_BA1)}
  objective_sum = jnp.sum(objective_BAk * w_BAk)
  draft_BAk = jnp.argmax(logits_BAkV, axis=-1)
  n_pos = jnp.sum(jnp.broadcast_to(v_BA1, ce_BAk.shape))
  correct = jnp.sum((draft_BAk == labels_BAk).astype(jnp.float32) * v_BA1)
  acc_BA = acceptance_lengths(draft_BAk, labels_BAk).astype(jnp.float32)
  n_blocks = jnp.sum(v_BA1)
  acc_sum = jnp.sum(acc_BA * v_BA1[..., 0])
  out = {"loss": objective_sum / jnp.maximum(w_sum, 1e-6),
         "ce": ce_sum / jnp.maximum(w_sum, 1e-6),
         "accuracy": correct / jnp.maximum(n_pos, 1.0),
         "acceptance_length": acc_sum / jnp.maximum(n_blocks, 1.0),
         "objective_sum": objective_sum, "ce_sum": ce_sum, "weight_sum": w_sum,
         "correct_sum": correct, "positions": n_pos, "acceptance_sum": acc_sum,
         "blocks": n_blocks, **extra}
  if extra:
    out["tv_acceptance"] = extra["tv_acceptance_sum"] / jnp.maximum(n_pos, 1.0)
  return out


def draft_forward_metrics(drafter: DFlashDrafter, target: nnx.Module, batch: dict[str, jax.Array],
                          rng: jax.Array, *, block_size: int, num_anchors: int,
                          gamma: float, loss: DraftLoss = DraftLoss()) -> dict[str, jax.Array]:
  """Target pass -> anchors -> blocks -> drafter pass -> `block_metrics` for one batch (the
  target's logits at the block positions only for a soft objective)."""
  tokens_BT = batch["tokens"]
  B, T = tokens_BT.shape
  anchors_BA, valid_BA = sample_anchors(rng, batch["prompt_lens"], batch["lengths"], T,
                                        num_anchors, block_size)
  at_BM = soft_target_positions(anchors_BA, block_size, T) if loss.soft else None
  hiddens_nBTD, target_logits = target_pass(target, tokens_BT, drafter.cfg.target_layer_ids,
                                            at_BM)
  block_tokens_BAb, _, labels_BAb = build_blocks(tokens_BT, anchors_BA, block_size,
                                                 drafter.cfg.mask_token_id)
  emb_BAbD = jax.lax.stop_gradient(target.embed_tokens(block_tokens_BAb))
  hidden_BAbD = drafter_train_forward(drafter, hiddens_nBTD, emb_BAbD, anchors_BA, valid_BA)
  logits_BAkV = block_logits(target, hidden_BAbD)
  if target_logits is not None:
    target_logits = target_logits.reshape(logits_BAkV.shape)
  return block_metrics(logits_BAkV, labels_BAb, valid_BA, loss_weights(block_size, gamma),
                       target_logits, loss)


LossFn = Callable[[DFlashDrafter, Any, dict[str, jax.Array], jax.Array],
                  tuple[jax.Array, dict[str, jax.Array]]]


def make_draft_loss_fn(target_graphdef: Any, *, block_size: int, num_anchors: int,
                       gamma: float | None = None, loss: DraftLoss = DraftLoss()) -> LossFn:
  """The training loop's `loss_fn(drafter, frozen, batch, rng) -> (loss, metrics)`.

  `frozen` is the target's state (`nnx.split(target)[1]`) and `target_graphdef` its graph; the
  target is merged inside the jitted step, runs once over the batch for its features
  (`target_features`, stop_gradient) and lends its embedding and head (stop_gradient): only the
  drafter's weights (layers, fc, hidden_norm, norm) get gradients. Anchors are re-sampled from
  `rng` at every step. `batch` holds `tokens` [B, T], `lengths` [B], `prompt_lens` [B] (from
  `bp_jax.data.batches`). `loss`: the objective (`DraftLoss`; soft objectives also project the
  target's final states at the A*(b-1) block positions to the vocabulary).

  Cost: the features are recomputed every step (one causal target forward over B*T tokens,
  without the vocabulary projection and without backward), in exchange for no feature storage
  (n*D floats per token otherwise).
  """
  gamma = default_gamma(block_size) if not gamma else float(gamma)

  def draft_loss_fn(drafter: DFlashDrafter, frozen: Any, batch: dict[str, jax.Array],
                    rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    target = nnx.merge(target_graphdef, frozen)
    m = draft_forward_metrics(drafter, target, batch, rng, block_size=block_size,
                              num_anchors=num_anchors, gamma=gamma, loss=loss)
    metrics = {"accuracy": m["accuracy"], "acceptance_length": m["acceptance_length"],
               "anchors_per_seq": m["blocks"] / batch["tokens"].shape[0]}
    if loss.soft:
      metrics.update(ce=m["ce"], tv_acceptance=m["tv_acceptance"])
    return m["loss"], metrics

  return draft_loss_fn
