"""The intra-request analysis (bp_jax/train/intra_request.py): the teacher-forced replay predicts
every real decode cycle's acceptance, and the per-cycle dynamic program is right on small cases
worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.decoding.engine import Engine
from bp_jax.models.qwen3 import Qwen3
from bp_jax.train import intra_request as intra

V = 64
SIZES = (2, 3, 4, 5)
MAX_NEW = 30


@pytest.fixture(scope="module")
def models():
  """A random untied target whose greedy output often is token 0, and a drafter whose final
  norm is zero: its logits are all 0, so it always drafts token 0 and a cycle accepts exactly
  the run of 0s the target produces next — partial acceptances of every length occur."""
  cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=False, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    getattr(target.layers, name)[...] = 5 * getattr(target.layers, name)[...]
  head = target.lm_head[...]
  target.lm_head[...] = head.at[:, 0].add(0.3 * jax.random.normal(jax.random.key(5), (32,)))
  layers = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": 1})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=4, num_target_layers=3,
                                       mask_token_id=V - 1, target_layer_ids=(0, 2)),
                          rngs=nnx.Rngs(2))
  drafter.norm[...] = jnp.zeros_like(drafter.norm[...])
  return target, drafter


def test_replay_predicts_every_real_cycle(models):
  target, drafter = models
  engine = Engine(target, max_len=96, length_buckets=(32, 64, 96), drafter=drafter,
                  block_sizes=SIZES)
  rng = np.random.default_rng(0)
  partial = 0
  for _ in range(6):
    prompt = rng.integers(1, V - 1, int(rng.integers(3, 30))).tolist()
    out = engine.generate(prompt, max_new_tokens=MAX_NEW).output_ids
    acc = intra.replay_acceptance(target, drafter, prompt, out, SIZES, MAX_NEW,
                                  engine.length_buckets)
    for b in SIZES:
      g = engine.generate(prompt, max_new_tokens=MAX_NEW, block_size=b)
      assert g.output_ids == out
      m = 1
      for a in g.acceptance_lengths:  # cycle starting with m committed tokens accepted a - 1
        want = min(a - 1, len(out) - m)  # the replay cannot see past the output's end
        assert acc[b][m] == want, (b, m, a, acc[b][:m + 3])
        partial += 0 < a - 1 < b - 1
        m += a
      assert intra.fixed_cycles(acc[b]) == len(g.acceptance_lengths)
  assert partial >= 3  # intermediate acceptance lengths were checked, not only 0 and b-1


def test_fixed_cycles_and_per_cycle_oracle_by_hand():
  # M = 6 tokens; size 2 accepts 1 everywhere; size 3 accepts 0 except 2 at m=1 and m=3.
  acc = {2: np.array([0, 1, 1, 1, 1, 1]), 3: np.array([0, 2, 0, 2, 0, 0])}
  assert intra.fixed_cycles(acc[2]) == 3   # m: 1 -> 3 -> 5 -> 7
  assert intra.fixed_cycles(acc[3]) == 3   # m: 1 -> 4 -> 5 -> 6
  # Two optimal schedules of 2 cycles: 3 then 2 (1 -> 4 -> 6) or 2 then 3 (1 -> 3 -> 6); ties go
  # to the preferred size.
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.0}, prefer=2) == (2.0, [2, 3])
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.0}, prefer=3) == (2.0, [3, 2])
  # When size 3 costs more per cycle, the cheapest mixes least of it.
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 1.5}, prefer=3) == (2.5, [3, 2])
  assert intra.per_cycle_oracle(acc, {2: 1.0, 3: 2.5}, prefer=3) == (3.0, [2, 2, 2])


def test_per_cycle_oracle_never_worse_than_any_fixed_size():
  rng = np.random.default_rng(3)
  for _ in range(50):
    M = int(rng.integers(2, 40))
    acc = {b: np.minimum(rng.geometric(0.4, M) - 1, b - 1) for b in (2, 3, 5, 8)}
    costs = {b: 1.0 + 0.1 * b for b in acc}
    for c in ({b: 1.0 for b in acc}, costs):
      total, schedule = intra.per_cycle_oracle(acc, c, prefer=3)
      assert all(total <= intra.fixed_cycles(acc[b]) * c[b] + 1e-9 for b in acc)
      # The schedule really reaches M and costs `total`.
      m, spent = 1, 0.0
      for b in schedule:
        m += int(acc[b][m]) + 1
        spent += c[b]
      assert m >= M and spent == pytest.approx(total)
      # Brute force over all schedules on short requests.
      if M <= 7:
        best = min(_brute(acc, c, M, 1), default=0.0)
        assert total == pytest.approx(best)


def _brute(acc, costs, M, m):
  if m >= M:
    yield 0.0
    return
  for b in acc:
    for rest in _brute(acc, costs, M, m + int(acc[b][m]) + 1):
      yield costs[b] + rest


def test_analysis_counts_switches_only_when_needed():
  acc = {2: np.array([0, 1, 1, 1, 1, 1]), 3: np.array([0, 2, 2, 2, 2, 2])}
  a = intra.analyse_request(acc, {2: 1.0, 3: 1.0})
  assert a["cycles"]["best_fixed_size"] == 3 and a["cycles"]["switched_cycles"] == 0
  assert a["cycles"]["per_cycle"] == a["cycles"]["best_fixed"] == 2
  s = intra.summarize([a, a], {2: 1.0, 3: 1.0})
  assert s["cycles"]["gain_per_cycle_over_per_request"] == 0.0
  assert s["cycles"]["global_static_size"] == 3
