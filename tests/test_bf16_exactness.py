"""What reduced precision guarantees (docs/design.md §12): in float32 speculative greedy output is
token-identical to AR; in bfloat16 it may leave AR's only at a near-tie of the target's logits.

One tiny random Qwen3 (4 layers, D=128, V=512, weights scaled up so its logits are far from
uniform, and tokens in near-twin pairs so that near-ties are common) and a random drafter, each
loaded in float32 and in bfloat16. Every prompt is decoded
with AR (block size 1) and speculatively (b=4, verify=exact), and the logits behind every
committed token are recomputed by replaying the request's forwards with the engine's shapes
(`bp_jax.eval.exactness.ForwardReplay`). The stated bf16 tolerance (`exactness.gap_tolerance`):

  the AR step's and the verify pass's logits differ by at most eps_bf16 * max|logits| (about
  one bf16 ulp of the largest logit; measured: at most 0.74 of it here and on the demo, see
  docs/exactness), hence a first divergence has gap logit_AR[AR token] - logit_AR[spec token]
  <= 2 * eps_bf16 * max|logits| (K = GAP_TOLERANCE_K = 2).

The check can fail: a token no exact verify rule would commit (the AR step's least likely
token, as a broken rule accepting any draft could) is flagged, on the real logits and on a
synthetic divergence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.eval import exactness as ex
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.nnx_utils import module_from_params, module_params
from bp_jax.models.qwen3 import Qwen3

V, B, MAX_NEW = 512, 4, 40
TWIN_NOISE = 0.003
CFG = Qwen3Config(vocab_size=V, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
                  tie_word_embeddings=False, max_position_embeddings=256)
DCFG = DFlashConfig(layers=Qwen3Config(**{**CFG.__dict__, "num_hidden_layers": 1}),
                    block_size=B, num_target_layers=4, mask_token_id=V - 1, target_layer_ids=(0, 2))
PROMPTS = [list(map(int, np.random.default_rng(i).integers(0, V - 1, size=3 + 5 * i)))
           for i in range(8)]


def _params():
  """Float32 parameters of the target and the drafter."""
  t = Qwen3(CFG, rngs=nnx.Rngs(0))
  t.embed[...] = jax.random.normal(jax.random.key(1), t.embed.shape)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    getattr(t.layers, name)[...] = 3 * getattr(t.layers, name)[...]
  # Near-twin tokens: each odd token's output column is its even neighbour's plus 0.3% noise,
  # so the two best logits often nearly tie and bf16 flips do happen (one here; none without).
  head = np.array(t.lm_head[...])
  noise = np.random.default_rng(7).normal(size=head[:, 1::2].shape) * head.std()
  head[:, 1::2] = head[:, 0::2] + TWIN_NOISE * noise
  t.lm_head[...] = jnp.asarray(head)
  return module_params(t), module_params(DFlashDrafter(DCFG, rngs=nnx.Rngs(2)))


def decode_runs(t_params, d_params) -> dict:
  """dtype -> one (ar ids, spec ids, first divergence, AR logits, verify logits) per prompt; the
  logit rows run up to the divergence (or the end)."""
  out = {}
  for name, dt in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    target = module_from_params(lambda: Qwen3(CFG, dtype=dt, rngs=nnx.Rngs(0)), t_params, dt)
    drafter = module_from_params(lambda: DFlashDrafter(DCFG, dtype=dt, rngs=nnx.Rngs(0)),
                                 d_params, dt)
    eng = Engine(target, drafter=drafter,
                 shapes=ShapeOptions(max_len=128, length_buckets=(64,), block_sizes=(B,)),
                 loop=LoopOptions(verify="exact"))
    replay, rows = ex.ForwardReplay(eng), []
    for ids in PROMPTS:
      ar = eng.generate(ids, max_new_tokens=MAX_NEW, block_size=1)
      sp = eng.generate(ids, max_new_tokens=MAX_NEW, block_size=B)
      j = ex.first_divergence(ar.output_ids, sp.output_ids)
      upto = len(ar.output_ids) - 1 if j is None else j
      rows.append((ar.output_ids, sp.output_ids, j,
                   replay.logits(ids, ar.output_ids, ex.forward_schedule(ar, 1), upto),
                   replay.logits(ids, sp.output_ids, ex.forward_schedule(sp, B), upto)))
    out[name] = rows
  return out


@pytest.fixture(scope="module")
def runs():
  return decode_runs(*_params())


def test_float32_speculative_output_is_token_identical_to_ar(runs):
  for ar, sp, j, _, _ in runs["float32"]:
    assert j is None and ar == sp and len(ar) == MAX_NEW


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_recomputes_the_committed_tokens(runs, dtype):
  """The replayed logits are those the engine chose by: their argmax is every committed token
  before the divergence (so the gaps below are measured on the right logits)."""
  for ar, sp, j, la, lv in runs[dtype]:
    n = len(la) - (j is not None)
    assert list(la[:n].argmax(-1)) == ar[:n] and list(lv[:n].argmax(-1)) == sp[:n]


def test_bfloat16_shapes_differ_by_at_most_the_stated_bound(runs):
  """Where the tolerance comes from: at every position, |logits_AR - logits_verify| <=
  eps_bf16 * max|logits_AR| (and in float32 far less, yet not always 0)."""
  worst = {}
  for dtype, rows in runs.items():
    rel = [np.max(np.abs(la - lv), -1) / np.max(np.abs(la), -1) for _, _, _, la, lv in rows]
    worst[dtype] = max(float(r.max()) for r in rel) / ex.BF16_EPS
  assert worst["bfloat16"] <= ex.GAP_TOLERANCE_K / 2, worst
  assert worst["float32"] <= 1e-3, worst
  assert worst["bfloat16"] > 100 * worst["float32"], worst  # bf16 does differ by shape


def test_every_bfloat16_divergence_is_a_near_tie(runs):
  divs = [ex.divergence_at(str(i), j, ar, sp, la[j], lv[j])
          for i, (ar, sp, j, la, lv) in enumerate(runs["bfloat16"]) if j is not None]
  assert ex.check_divergences(divs) == []
  for d in divs:
    assert 0 <= d.ar_gap <= 2 * ex.BF16_EPS * d.logit_scale and d.replay_agrees


def test_a_token_no_exact_rule_would_commit_is_flagged(runs):
  """A broken verify rule (e.g. one keeping every draft) commits tokens the target does not
  rank first: with the AR step's least likely token at position 5, the check fails."""
  ar, _, _, la, lv = runs["bfloat16"][0]
  j = 5
  wrong = ar[:j] + [int(np.argmin(la[j]))]
  d = ex.divergence_at("broken", j, ar, wrong, la[j], lv[j])
  assert not d.near_tie and d.ar_gap > 10 * d.tolerance
  assert len(ex.check_divergences([d])) == 1 and "broken @ 5" in ex.check_divergences([d])[0]


def test_synthetic_divergences():
  logits = np.array([4.0, 3.99, -1.0, 0.5])
  assert ex.gap_tolerance(logits) == pytest.approx(ex.GAP_TOLERANCE_K * ex.BF16_EPS * 4.0)
  assert ex.top2_gap(logits) == pytest.approx(0.01)
  tie = ex.divergence_at("tie", 0, [0], [1], logits, logits[[1, 0, 2, 3]])
  assert tie.near_tie and tie.replay_agrees and ex.check_divergences([tie]) == []
  far = ex.divergence_at("far", 0, [0], [3], logits, logits)  # gap 3.5 >> 0.0625
  assert not far.near_tie and not far.replay_agrees
  assert ex.check_divergences([tie, far]) == [
      "far @ 0: AR 0 vs spec 3, gaps AR 3.5 / verify -3.5 > tolerance 0.0625"]
  assert ex.first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert ex.first_divergence([1, 2, 3], [1, 5, 3]) == 1
  assert ex.first_divergence([1, 2], [1, 2, 3]) == 2
