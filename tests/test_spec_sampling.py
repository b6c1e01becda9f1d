"""Speculative decoding at T=1 samples from the target's own distribution (docs/design.md §3).

A tiny target over a 16-token vocabulary; the exact distribution of the first three generated
tokens is enumerated with transformers (float64, every prefix), and the empirical distribution of
thousands of speculative generations (one seed each) is compared with it by a chi-square test.
The same test is shown to fail when `decode_verify.accept_length` is replaced by a wrong rule.

The chi-square test and the tiny models: `sampling_stats`.

Why the third token: the loop always commits the target's own samples y_0..y_a, so the second
token is y_0 ~ p(. | prompt, t1) under ANY acceptance rule; a wrong rule shows first in the
third token, which it draws conditioned on a draft token that was never committed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bp_jax.decoding import verify as decode_verify
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
from sampling_stats import MASK, PROMPT, V, chi_square, counts_of, exact_joint, tiny_models

B = 4              # block size of the statistical tests
N_TOKENS = 3       # generated tokens whose joint distribution is tested
N_SAMPLES = 4000   # generations with the correct rule
N_WRONG = 1000     # generations with the wrong rule
MAX_LEN = 32


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
  return tiny_models()


@pytest.fixture(scope="module")
def exact(models):
  """p[t1, t2, t3] = P(t1) P(t2 | t1) P(t3 | t1, t2) of the target at T=1, in float64."""
  return exact_joint(models[0], PROMPT, temperature=1.0)


@pytest.fixture(scope="module")
def greedy(models):
  """The target's greedy continuation, proposed by the perfect-ish drafter at every sample."""
  hf = models[0]
  with torch.no_grad():
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
  return out[0, len(PROMPT):].tolist()


def _make_engine(models) -> Engine:
  _, target, drafter = models
  return Engine(target, drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(8,), block_sizes=(B,)))


@pytest.fixture(scope="module")
def engine(models):
  return _make_engine(models)


def _sample(engine: Engine, n: int, forced) -> tuple[np.ndarray, list[list[int]]]:
  toks, accepts = [], []
  for seed in range(n):
    g = engine.generate(PROMPT, max_new_tokens=N_TOKENS, temperature=1.0, seed=seed,
                        block_size=B, forced_continuation=forced)
    assert len(g.output_ids) == N_TOKENS
    toks.append(g.output_ids)
    accepts.append(g.acceptance_lengths)
  return np.array(toks), accepts


@pytest.fixture(scope="module")
def spec_samples(engine, greedy):
  return _sample(engine, N_SAMPLES, greedy)


# ---- tests --------------------------------------------------------------------------------------

def test_exact_distribution_is_a_useful_reference(exact, greedy):
  assert exact.shape == (V, V, V) and abs(exact.sum() - 1) < 1e-9
  # Neither degenerate nor near-uniform: a real test of the sampler.
  p1 = exact.sum((1, 2))
  assert 0.2 < p1.max() < 0.95
  assert int(np.argmax(p1)) == greedy[0]
  # The perfect-ish drafter's proposals are often, but not always, right.
  p_accept_first = exact[greedy[0], greedy[1]].sum() / p1[greedy[0]]
  assert 0.2 < p_accept_first < 0.95


def test_spec_sampling_matches_the_target_distribution(exact, spec_samples):
  toks, accepts = spec_samples
  first_cycle = np.array([a[0] for a in accepts])
  # Both outcomes of the first verification occur often: acceptance and rejection.
  assert 0.1 < np.mean(first_cycle >= 2) < 0.9, np.mean(first_cycle >= 2)
  checks = {
      "2nd token": (counts_of(toks[:, 1:], 1), exact.sum((0, 2))),
      "(1st, 2nd)": (counts_of(toks, 2), exact.sum(2)),
      "(1st, 2nd, 3rd)": (counts_of(toks, 3), exact),
  }
  for what, (counts, probs) in checks.items():
    stat, df, thr = chi_square(counts, probs)
    assert stat < thr, f"{what}: chi2={stat:.1f} >= {thr:.1f} (df={df})"


def _accept_mismatches(draft, y):
  """A wrong rule: the longest prefix where the draft DIFFERS from the target's samples.

  For the first three tokens every wrong rule that accepts a rejected draft token acts alike
  (it commits y_1, drawn after d_1, although y_0 != d_1 was committed); "always accept the
  whole draft" gives token-identical samples here, so one rule is enough."""
  return jnp.sum(jnp.cumprod((draft != y[:draft.shape[0]]).astype(jnp.int32)))


def test_wrong_acceptance_rule_fails_the_same_test(models, exact, greedy, monkeypatch):
  monkeypatch.setattr(decode_verify, "accept_length", _accept_mismatches)
  wrong = _make_engine(models)  # a fresh engine: its loop is traced with the wrong rule
  toks, _ = _sample(wrong, N_WRONG, greedy)
  stat, df, thr = chi_square(counts_of(toks, 3), exact)
  assert stat > thr, f"wrong rule not detected: chi2={stat:.1f} < {thr:.1f} (df={df})"


def test_same_seed_spec_equals_ar_at_temperature_one(engine, greedy):
  """Per-position keys: AR and spec draw the same token at a position with the same prefix."""
  rng = np.random.default_rng(0)
  b = B
  for seed in range(24):
    m = int(rng.integers(1, 20))
    prompt = rng.integers(0, V, int(rng.integers(1, 9))).tolist()
    ar = engine.generate(prompt, max_new_tokens=m, temperature=1.0, seed=seed, block_size=1)
    for forced in (None, greedy, ar.output_ids):
      g = engine.generate(prompt, max_new_tokens=m, temperature=1.0, seed=seed, block_size=b,
                          forced_continuation=forced)
      assert g.output_ids == ar.output_ids, (seed, b, m, forced is None)
    # The last drafter proposed this very sample: it is accepted in full.
    assert all(a == b for a in g.acceptance_lengths[:-1]), g.acceptance_lengths


def test_seeds_matter_only_when_sampling(engine, spec_samples):
  toks, _ = spec_samples
  assert len({tuple(t) for t in toks}) > 50
  g0 = [engine.generate(PROMPT, max_new_tokens=N_TOKENS, temperature=0.0, seed=s,
                        block_size=B).output_ids for s in range(3)]
  assert g0[0] == g0[1] == g0[2]


# ---- the loop's drafts are the drafter's --------------------------------------------------------

def _reference_drafter(models, b: int):
  """drafts(tokens_1S, n): the drafter's b-1 proposals after the n committed tokens, computed
  from scratch: one full target forward (no incremental cache) gives the context features of
  positions 0..n-2, a fresh drafter cache holds them, and the block [t_{n-1}, MASK..] is drafted.
  """
  _, target, drafter = models

  @nnx.jit
  def drafts(target, drafter, tokens_1S, n):
    S = tokens_1S.shape[1]
    out = target(tokens_1S, target.init_cache(1, S), drafter.cfg.target_layer_ids)
    cache = drafter.add_context(out.layer_hiddens, drafter.init_cache(1, S))
    cache = cache.with_lengths(jnp.reshape(n - 1, (1,)))
    block = jnp.full((1, b), MASK, jnp.int32).at[0, 0].set(tokens_1S[0, n - 1])
    h = drafter.draft(target.embed_tokens(block), cache)
    return jnp.argmax(h[0, 1:] @ target.head_weight(), axis=-1)

  return lambda tokens, n: np.asarray(drafts(target, drafter, tokens, n)).tolist()


def test_loop_drafts_are_the_drafters_proposals_from_scratch(models, engine, monkeypatch):
  """Every cycle's draft inside the compiled loop (recorded through the acceptance rule, which
  receives it) equals the drafter's proposal recomputed from scratch for the committed prefix,
  and the target samples y_0..y_a of every cycle are the AR tokens there. So the loop's
  incremental drafter context (prefill context, fixed-size chunks with invalid tails, rollback)
  is right, which losslessness alone cannot show (any drafter is lossless)."""
  real_rule = decode_verify.accept_length
  calls = []

  def recording_rule(draft, y):
    jax.debug.callback(lambda d, t: calls.append((np.asarray(d).tolist(), np.asarray(t).tolist())),
                       draft, y, ordered=True)
    return real_rule(draft, y)

  monkeypatch.setattr(decode_verify, "accept_length", recording_rule)
  eng = _make_engine(models)  # a fresh engine: its loop is traced with the recording rule
  for temp in (0.0, 1.0):  # each sampling form's loop: its untimed first runs record calls too
    eng.generate([1], max_new_tokens=2, block_size=B, temperature=temp)
  ref = _reference_drafter(models, B)
  rng = np.random.default_rng(7)
  n_cycles = n_accepted = 0
  for case in range(8):
    temp = (0.0, 1.0)[case % 2]
    prompt = rng.integers(0, V, int(rng.integers(1, 9))).tolist()
    m = int(rng.integers(8, 21))
    calls.clear()
    g = eng.generate(prompt, max_new_tokens=m, temperature=temp, seed=case, block_size=B)
    # The target's tokens after correct prefixes: the AR output (same seed, per-position keys),
    # long enough to cover the last block.
    ar = engine.generate(prompt, max_new_tokens=m + B, temperature=temp, seed=case,
                         block_size=1).output_ids
    assert g.output_ids == ar[:m]
    assert len(calls) == len(g.acceptance_lengths)
    toks = np.zeros((1, MAX_LEN), np.int32)
    toks[0, :len(prompt) + len(ar)] = prompt + ar
    k = 1  # committed new tokens
    for (draft, y), acc in zip(calls, g.acceptance_lengths):
      assert draft == ref(toks, len(prompt) + k), (case, k)
      a = acc - 1
      assert y[:a + 1] == ar[k:k + a + 1], (case, k)
      assert draft[:a] == y[:a] and (a == B - 1 or draft[a] != y[a])
      k += acc
      n_cycles += 1
      n_accepted += a > 0
  assert n_cycles >= 60 and n_accepted >= 1, (n_cycles, n_accepted)
