"""The DFlash training objective (bp_jax/train/draft_objective.py) against hand-made cases and
against the drafter's inference path."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.qwen3 import Qwen3
from bp_jax.train import draft_objective as obj

V, D, MASK = 64, 32, 1
TARGET_CFG = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=10000.0)


def drafter_cfg(block_size: int = 4, layer_ids=(0, 2)) -> DFlashConfig:
  layers = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rope_theta=10000.0)
  return DFlashConfig(layers=layers, block_size=block_size, num_target_layers=3,
                      mask_token_id=MASK, target_layer_ids=tuple(layer_ids))


def scaled_drafter(seed: int = 0, block_size: int = 4) -> DFlashDrafter:
  """A random drafter with weights large enough that attention and context really matter."""
  drafter = DFlashDrafter(drafter_cfg(block_size), rngs=nnx.Rngs(seed))
  state = nnx.state(drafter, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  nnx.update(drafter, jax.tree.unflatten(tree, leaves))
  return drafter


# ---- mask, weights, anchors, blocks ----------------------------------------------------------


def _rows(text: str) -> np.ndarray:
  return np.array([[c == "1" for c in row.replace(" ", "")] for row in text.splitlines()
                   if row.strip()], bool)


def test_training_mask_hand_checked():
  # T = 6 context positions, b = 3, three anchor slots. Columns: context 0..5 | block 0 | block 1
  # | block 2. A block sees context strictly before its anchor and its own block only.
  anchors = jnp.array([[2, 4, 0], [1, 3, 5]])
  valid = jnp.array([[True, True, False], [True, True, True]])
  mask = np.asarray(obj.training_mask(anchors, valid, 3, 6))
  assert mask.shape == (2, 9, 15)
  want0 = """
      110000 111 000 000
      110000 111 000 000
      110000 111 000 000
      111100 000 111 000
      111100 000 111 000
      111100 000 111 000
      000000 000 000 000
      000000 000 000 000
      000000 000 000 000"""
  want1 = """
      100000 111 000 000
      100000 111 000 000
      100000 111 000 000
      111000 000 111 000
      111000 000 111 000
      111000 000 111 000
      111110 000 000 111
      111110 000 000 111
      111110 000 000 111"""
  np.testing.assert_array_equal(mask[0], _rows(want0).reshape(9, 15))
  np.testing.assert_array_equal(mask[1], _rows(want1).reshape(9, 15))


def test_loss_weights_values():
  w = np.asarray(obj.loss_weights(8, 4.0))
  assert w.shape == (8,)
  assert w[0] == 0.0 and w[1] == pytest.approx(1.0)
  np.testing.assert_allclose(w[1:], [math.exp(-(k - 1) / 4.0) for k in range(1, 8)], rtol=1e-6)
  assert obj.default_gamma(16) == 7.0 and obj.default_gamma(10) == 5.0
  assert obj.default_gamma(8) == 4.0
  with pytest.raises(ValueError):
    obj.loss_weights(8, 0.0)


def test_anchors_respect_prompt_and_block_room_over_many_rngs():
  T, A, b = 24, 6, 4
  rs = np.random.default_rng(0)
  sample = jax.jit(obj.sample_anchors, static_argnums=(3, 4, 5))
  for trial in range(200):
    lengths = rs.integers(1, T + 1, size=5)
    prompt_lens = np.array([rs.integers(0, n + 1) for n in lengths])
    anchors, valid = sample(jax.random.key(trial), jnp.asarray(prompt_lens, jnp.int32),
                            jnp.asarray(lengths, jnp.int32), T, A, b)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    for i in range(5):
      lo, hi = max(prompt_lens[i], 1), lengths[i] - b
      admissible = max(0, hi - lo + 1)
      got = anchors[i][valid[i]]
      assert len(got) == min(A, admissible)
      assert valid[i].tolist() == sorted(valid[i].tolist(), reverse=True)  # valid slots first
      assert np.all(got >= prompt_lens[i]) and np.all(got >= 1)  # never in the prompt
      assert np.all(got + b - 1 <= lengths[i] - 1)  # room for a full block of real labels
      assert len(set(got.tolist())) == len(got) and np.all(np.diff(got) > 0)
      assert np.all(anchors[i][~valid[i]] == 0)


def test_anchors_are_uniform_and_resampled():
  T, b = 20, 4
  draw = jax.jit(jax.vmap(lambda k: obj.sample_anchors(
      k, jnp.array([5]), jnp.array([18]), T, 3, b)[0][0]))
  anchors = np.asarray(draw(jax.random.split(jax.random.key(1), 6000)))  # [6000, 3]
  counts = np.bincount(anchors.reshape(-1), minlength=T)
  admissible = np.arange(5, 18 - b + 1)  # 5..14: 10 positions, each chosen w.p. 3/10
  assert counts[admissible].sum() == anchors.size
  np.testing.assert_allclose(counts[admissible] / 6000, 0.3, atol=0.03)
  assert len({tuple(r) for r in anchors[:50]}) > 10  # different rngs, different anchors


def test_build_blocks():
  tokens = jnp.arange(10, 20)[None]
  blocks, pos, labels = obj.build_blocks(tokens, jnp.array([[2, 5]]), 3, MASK)
  assert blocks.tolist() == [[[12, MASK, MASK], [15, MASK, MASK]]]
  assert pos.tolist() == [[[2, 3, 4], [5, 6, 7]]]
  assert labels.tolist() == [[[12, 13, 14], [15, 16, 17]]]


def test_expected_acceptance_length_hand_case():
  labels = jnp.array([[[5, 6, 7], [1, 2, 3], [4, 4, 4], [9, 9, 9]]])  # positions 1..b-1 (b = 4)
  draft = jnp.array([[[5, 6, 7], [1, 0, 3], [0, 4, 4], [9, 9, 9]]])
  valid = jnp.array([[True, True, True, False]])
  # Leading matches 3, 1, 0 -> acceptance 4, 2, 1; the invalid block is ignored.
  assert obj.acceptance_lengths(draft, labels).tolist() == [[4, 2, 1, 4]]
  assert float(obj.expected_acceptance_length(draft, labels, valid)) == pytest.approx(7 / 3)
  logits = jax.nn.one_hot(draft, 10)  # logits are reduced by argmax
  assert float(obj.expected_acceptance_length(logits, labels, valid)) == pytest.approx(7 / 3)
  assert float(obj.expected_acceptance_length(draft, labels, valid & False)) == 0.0


# ---- the training forward against the inference path -----------------------------------------


def _features(seed: int, B: int, T: int, n: int = 2) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (n, B, T, D))


def _jitted_forwards(drafter: DFlashDrafter):
  """(train forward, dense-mask train forward, inference path) as jitted functions of the state."""
  graph, state = nnx.split(drafter)

  @jax.jit
  def train(state, hiddens, emb, anchors, valid):
    return obj.drafter_train_forward(nnx.merge(graph, state), hiddens, emb, anchors, valid)

  @jax.jit
  def dense(state, hiddens, emb, anchors, valid):
    return obj.drafter_train_forward(nnx.merge(graph, state), hiddens, emb, anchors, valid,
                                     dense_mask=True)

  @jax.jit
  def infer(state, hiddens_n1TD, p, emb_1bD):
    """add_context with the features of positions < p only, then one draft step at p."""
    d = nnx.merge(graph, state)
    T = hiddens_n1TD.shape[2]
    before = jnp.where((jnp.arange(T) < p)[None, None, :, None], hiddens_n1TD, 0.0)
    cache = d.add_context(before, d.init_cache(1, 2 * T)).with_lengths(p[None])
    return d.draft(emb_1bD, cache)

  return state, train, dense, infer


def test_train_forward_matches_inference_path_for_several_anchors():
  b, T = 4, 16
  drafter = scaled_drafter(0, b)
  state, train, dense, infer = _jitted_forwards(drafter)
  emb_table = jax.random.normal(jax.random.key(7), (V, D))
  hiddens = _features(1, 2, T)
  tokens = jax.random.randint(jax.random.key(2), (2, T), 2, V)
  anchors = jnp.array([[1, 5, 12, 3], [7, 2, 9, 0]])
  valid = jnp.array([[True, True, True, True], [True, True, True, False]])
  blocks, _, _ = obj.build_blocks(tokens, anchors, b, MASK)
  emb = emb_table[blocks]
  train_h = np.asarray(train(state, hiddens, emb, anchors, valid))
  dense_h = np.asarray(dense(state, hiddens, emb, anchors, valid))
  checked = 0
  for i in range(2):
    for a in range(4):
      if not valid[i, a]:
        continue
      ref = np.asarray(infer(state, hiddens[:, i:i + 1], anchors[i, a], emb[i:i + 1, a]))[0]
      np.testing.assert_allclose(train_h[i, a], ref, atol=1e-4, rtol=1e-4)
      np.testing.assert_allclose(dense_h[i, a], ref, atol=1e-4, rtol=1e-4)
      checked += 1
  assert checked == 7
  assert np.abs(train_h).max() > 0.5  # not a degenerate all-zero comparison


def test_train_forward_sees_only_context_before_its_anchor():
  b, T = 4, 16
  state, train, _, _ = _jitted_forwards(scaled_drafter(3, b))
  hiddens = _features(4, 1, T)
  anchors, valid = jnp.array([[6, 10]]), jnp.array([[True, True]])
  emb = jax.random.normal(jax.random.key(5), (1, 2, b, D))
  base = train(state, hiddens, emb, anchors, valid)
  # Changing features at positions >= 6 leaves block 0 alone, but moves block 1 (anchor 10).
  out = train(state, hiddens.at[:, :, 6:].add(1.0), emb, anchors, valid)
  np.testing.assert_allclose(out[0, 0], base[0, 0], atol=1e-6)
  assert float(jnp.abs(out[0, 1] - base[0, 1]).max()) > 1e-3
  # Changing block 1's inputs never reaches block 0 (blocks do not see each other).
  out = train(state, hiddens, emb.at[0, 1].add(1.0), anchors, valid)
  np.testing.assert_allclose(out[0, 0], base[0, 0], atol=1e-6)


# ---- the loss --------------------------------------------------------------------------------


def _pattern_batch(rs: np.random.Generator, B: int, T: int) -> dict[str, np.ndarray]:
  """Sequences t_{i+1} = (t_i - 2 + 3) mod (V - 2) + 2 from a random start (learnable)."""
  starts = rs.integers(2, V, size=B)
  tokens = np.stack([(s - 2 + 3 * np.arange(T)) % (V - 2) + 2 for s in starts]).astype(np.int32)
  return {"tokens": tokens, "lengths": np.full((B,), T, np.int32),
          "prompt_lens": np.full((B,), 4, np.int32),
          "loss_mask": (np.arange(T)[None] >= 4).astype(np.int32).repeat(B, 0)}


def _strong_target() -> Qwen3:
  """A tiny random target whose embedding and head are large enough to give peaked logits."""
  target = Qwen3(TARGET_CFG, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(11), (V, D))
  target.lm_head[...] = jax.random.normal(jax.random.key(12), (D, V)) / math.sqrt(D) * 3.0
  return target


def _optax_steps(num_steps: int, loss: obj.DraftLoss = obj.DraftLoss()):
  """A minimal optax loop (independent of bp_jax.train.loop) training a drafter on a tiny
  frozen random target; yields (loss, metrics, largest target gradient, smallest largest
  drafter gradient) per step, on fresh pattern batches."""
  t_graph, t_state = nnx.split(_strong_target())
  drafter = DFlashDrafter(drafter_cfg(4), rngs=nnx.Rngs(1))
  d_graph, d_params = nnx.split(drafter)
  loss_fn = obj.make_draft_loss_fn(t_graph, block_size=4, num_anchors=8, gamma=4.0, loss=loss)
  opt = optax.adam(1e-2)
  opt_state = opt.init(d_params)

  @jax.jit
  def step(params, opt_state, t_state, batch, rng):
    f = lambda d, t: loss_fn(nnx.merge(d_graph, d), t, batch, rng)
    (loss, metrics), (g_d, g_t) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        params, t_state)
    updates, opt_state = opt.update(g_d, opt_state, params)
    g_t_max = jnp.max(jnp.stack([jnp.abs(x).max() for x in jax.tree.leaves(g_t)]))
    g_d_min = jnp.min(jnp.stack([jnp.abs(x).max() for x in jax.tree.leaves(g_d)]))
    return optax.apply_updates(params, updates), opt_state, loss, metrics, g_t_max, g_d_min

  rs = np.random.default_rng(0)
  for i in range(num_steps):
    batch = {k: jnp.asarray(v) for k, v in _pattern_batch(rs, 4, 20).items()}
    d_params, opt_state, *out = step(d_params, opt_state, t_state, batch, jax.random.key(i))
    yield out


def test_loss_fn_trains_only_the_drafter_and_a_few_steps_reduce_the_loss():
  losses = []
  for i, (loss, metrics, g_t_max, g_d_min) in enumerate(_optax_steps(40)):
    losses.append(float(loss))
    if i == 0:
      assert float(g_t_max) == 0.0  # the frozen target gets no gradient ...
      assert float(g_d_min) > 0.0  # ... every drafter parameter does
      assert np.isfinite(losses[0])
      # 20 tokens, prompt 4, b 4: 13 admissible anchors, all 8 slots valid.
      assert float(metrics["anchors_per_seq"]) == 8.0
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3]), losses
  assert float(metrics["acceptance_length"]) > 1.5


# ---- soft objectives (distillation) ----------------------------------------------------------

def test_soft_targets_are_the_targets_next_token_logits_after_the_true_prefix():
  """The target logits `draft_forward_metrics` distils against: block position k of the block
  at anchor p gets the target's logits at position p + k - 1 of a full causal forward."""
  target = _strong_target()
  rs = np.random.default_rng(3)
  tokens = jnp.asarray(_pattern_batch(rs, 2, 20)["tokens"])
  anchors = jnp.asarray([[4, 9, 12], [5, 6, 16]], jnp.int32)
  at = obj.soft_target_positions(anchors, 4, 20)
  _, logits = obj.target_pass(target, tokens, (0, 2), at)
  full = target(tokens, target.init_cache(2, 20)).logits
  for b in range(2):
    for a in range(3):
      for k in range(1, 4):
        np.testing.assert_allclose(logits[b, a * 3 + k - 1],
                                   full[b, min(int(anchors[b, a]) + k - 1, 19)],
                                   rtol=1e-5, atol=1e-5)


def test_soft_losses_match_their_formulas():
  q = jax.random.normal(jax.random.key(0), (2, 3, 3, V))
  p = 2 * jax.random.normal(jax.random.key(1), (2, 3, 3, V))
  labels = jax.random.randint(jax.random.key(2), (2, 3, 4), 0, V)
  valid = jnp.asarray([[True, True, False], [True, False, False]])
  w = obj.loss_weights(4, 4.0)
  t = 0.7
  pt, qt = jax.nn.softmax(p / t), jax.nn.softmax(q / t)
  kl = np.asarray(jnp.sum(pt * (jnp.log(pt) - jnp.log(qt)), -1))
  tv = np.asarray(0.5 * jnp.sum(jnp.abs(pt - qt), -1))
  ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(q, labels[:, :, 1:]))
  wv = np.asarray(w[1:])[None, None] * np.asarray(valid)[..., None]
  for kind, per_pos in (("ce", ce), ("kl", kl), ("tvd", tv), ("mix", 0.7 * ce + 0.3 * kl)):
    m = obj.block_metrics(q, labels, valid, w, p, obj.DraftLoss(kind, t, 0.3))
    np.testing.assert_allclose(float(m["loss"]), (per_pos * wv).sum() / wv.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ce"]), (ce * wv).sum() / wv.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["tv_acceptance"]),
                               ((1 - tv) * (wv > 0)).sum() / (wv > 0).sum(), rtol=1e-5)
  # mix with CE against the target's argmax instead of the data token.
  ce_arg = np.asarray(optax.softmax_cross_entropy_with_integer_labels(q, jnp.argmax(p, -1)))
  m = obj.block_metrics(q, labels, valid, w, p, obj.DraftLoss("mix", t, 0.3, "argmax"))
  np.testing.assert_allclose(float(m["loss"]), ((0.7 * ce_arg + 0.3 * kl) * wv).sum() / wv.sum(),
                             rtol=1e-5)
  assert obj.DraftLoss("ce", ce_label="argmax").soft and not obj.DraftLoss("ce").soft
  # A drafter equal to the target: zero KL and TV, full acceptance.
  m = obj.block_metrics(p, labels, valid, w, p, obj.DraftLoss("tvd", t))
  assert abs(float(m["loss"])) < 1e-6 and abs(float(m["tv_acceptance"]) - 1) < 1e-6
  with pytest.raises(ValueError, match="not one of"):
    obj.DraftLoss("l2")


@pytest.mark.parametrize("kind", ["kl", "tvd", "mix"])
def test_soft_objectives_train_the_drafter_toward_the_target(kind):
  """A few steps of each soft objective raise 1 - TV(p, q) on fixed batches; the target
  gets no gradient."""
  accept = []
  for _, metrics, g_t_max, _ in _optax_steps(30, obj.DraftLoss(kind, 1.0, 0.5)):
    assert float(g_t_max) == 0.0
    accept.append(float(metrics["tv_acceptance"]))
  assert np.mean(accept[-5:]) > np.mean(accept[:3]) + 0.05, accept
