"""Plain autoregressive decoding through Engine.generate (block_size 1): greedy output against
transformers' generate, stop tokens, seeded sampling and its distribution, compile counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.errors import BadInputError
from hf_fixtures import jax_qwen3_from_torch, make_hf_qwen3

BUCKETS = (8, 16, 32)
MAX_LEN = 64
# Chi-square critical value for 15 degrees of freedom (16 categories) at p = 1e-4
# (scipy.stats.chi2.isf(1e-4, 15) = 44.263): a correct sampler fails with probability 1e-4.
CHI2_CRIT_DF15 = 44.263


def _prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
  return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _hf_greedy(hf, prompt: list[int], n: int, eos=None) -> list[int]:
  ids = torch.tensor([prompt])
  kw = dict(eos_token_id=eos, pad_token_id=0) if eos is not None else dict(min_new_tokens=n)
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=n, **kw)
  return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def engine(tiny_pair):
  return Engine(tiny_pair[1], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))


def test_greedy_decoding_matches_transformers_generate(tiny_pair, engine):
  hf, _ = tiny_pair
  # Long prompts before short ones: later requests reuse buffers holding stale entries.
  for i, n in enumerate([20, 3, 9, 7, 8, 31]):
    prompt = _prompt(n, seed=i)
    g = engine.generate(prompt, max_new_tokens=10)
    assert g.output_ids == _hf_greedy(hf, prompt, 10), f"prompt length {n}"
    assert g.new_tokens == 10 and g.prompt_len == n and g.block_size == 1
    assert g.acceptance_lengths == [1] * 9 and g.tau == 1.0  # the first token is the prefill's


def test_a_request_may_run_in_a_larger_sampling_form_with_the_same_tokens(tiny_pair):
  """`Engine.generate(sampling_form=...)` (benchmarks comparing forms): a form that serves the
  settings gives their tokens (greedy in ANY's program: its draws are computed and unused); one
  that does not is refused, naming the parameter."""
  eng = Engine(tiny_pair[1], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16,)))
  prompt = _prompt(9, seed=3)
  want = eng.generate(prompt, max_new_tokens=6).output_ids
  got = eng.generate(prompt, max_new_tokens=6, sampling_form=SamplingForm.ANY)
  assert got.output_ids == want
  assert ("ar_loop", 1, "any") in eng.compiled and ("prefill", 16, "any") in eng.compiled
  with pytest.raises(BadInputError, match=r"sampling_form=GREEDY: the request's settings need "
                                          r"SAMPLED or above \(GREEDY, SAMPLED, ANY\)"):
    eng.generate(prompt, max_new_tokens=6, temperature=1.0, sampling_form=SamplingForm.GREEDY)
  with pytest.raises(BadInputError, match="sampling_form=7"):
    eng.generate(prompt, max_new_tokens=6, sampling_form=7)


def test_prompts_of_many_lengths_compile_prefill_once_per_bucket_and_loop_once(tiny_pair,
                                                                               engine):
  hf, _ = tiny_pair
  lengths = [1, 2, 5, 8, 9, 10, 13, 16, 17, 24, 29, 32]  # 12 lengths over the 3 buckets
  for n in lengths:
    prompt = _prompt(n, seed=100 + n)
    assert engine.generate(prompt, max_new_tokens=4).output_ids == _hf_greedy(hf, prompt, 4)
  counts = engine.compiled.counts
  assert counts["prefill"] == len(BUCKETS), dict(counts)
  assert counts["ar_loop"] == 1, dict(counts)
  assert engine.compiled.total == len(BUCKETS) + 1
  assert all(("prefill", b) in engine.compiled for b in BUCKETS)
  # Sampling requests take the programs of their sampling form (`sampling.SamplingForm`), once
  # per bucket; runtime values (temperature, seed, max_new_tokens) never recompile them. One
  # prefill serves both drawing forms (ANY's); the loop is the request's form's.
  for t, n in zip((0.7, 1.3, 0.9, 1.0), lengths[::3]):
    engine.generate(_prompt(n, seed=n), max_new_tokens=7, temperature=t, seed=n)
  assert counts["prefill"] == 2 * len(BUCKETS) and counts["ar_loop"] == 2, dict(counts)
  assert all(("prefill", b, "any") in engine.compiled for b in BUCKETS)
  assert ("ar_loop", 1, "sampled") in engine.compiled
  engine.generate(_prompt(5, seed=5), max_new_tokens=7, temperature=0.8, top_p=0.9, seed=5)
  assert counts["prefill"] == 2 * len(BUCKETS) and counts["ar_loop"] == 3, dict(counts)


def test_sampling_with_a_fixed_seed_is_reproducible(engine):
  prompt = _prompt(6, seed=7)
  a = engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=123).output_ids
  engine.generate(_prompt(12, seed=8), max_new_tokens=5, temperature=1.0, seed=9)  # in between
  b = engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=123).output_ids
  c = engine.generate(prompt, max_new_tokens=16, temperature=1.0, seed=124).output_ids
  greedy = engine.generate(prompt, max_new_tokens=16).output_ids
  assert a == b
  assert a != c
  assert a != greedy


def test_prompt_that_does_not_fit_the_cache_is_refused(engine):
  with pytest.raises(BadInputError, match="max_len=64"):
    engine.generate(_prompt(60, seed=0), max_new_tokens=8)
  with pytest.raises(BadInputError, match="vocab_size=128"):
    engine.generate([5, 128], max_new_tokens=2)


# -- a 16-token vocabulary: stop tokens and the sampled distribution ----------------------------

@pytest.fixture(scope="module")
def small_vocab():
  hf = make_hf_qwen3(seed=4, vocab_size=16, hidden_size=32, intermediate_size=32,
                     num_hidden_layers=1, head_dim=8)
  with torch.no_grad():  # sharpen the output distribution so that temperatures are told apart
    hf.lm_head.weight.mul_(2.5)
  return hf, jax_qwen3_from_torch(hf)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
  expected = counts.sum() * probs
  return float(np.sum((counts - expected) ** 2 / expected))


def test_first_token_distribution_at_temperature_1_matches_softmax(small_vocab):
  hf, model = small_vocab
  engine = Engine(model, shapes=ShapeOptions(max_len=16, length_buckets=(8,)))
  prompt = [3, 1, 4, 1, 5]
  with torch.no_grad():
    logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
  p1 = np.exp(logits - logits.max())
  p1 /= p1.sum()
  p_t2 = np.exp((logits - logits.max()) / 2)
  p_t2 /= p_t2.sum()
  n = 3000
  assert n * p1.min() >= 5  # the chi-square approximation needs >= 5 expected per category
  # Power check: the wrong distribution's expected statistic is far above the critical value.
  assert n * np.sum((p1 - p_t2) ** 2 / p_t2) > 4 * CHI2_CRIT_DF15
  draws = [engine.generate(prompt, max_new_tokens=1, temperature=1.0, seed=s).output_ids
           for s in range(n)]
  assert all(len(d) == 1 for d in draws)
  counts = np.bincount([d[0] for d in draws], minlength=16)
  assert _chi_square(counts, p1) < CHI2_CRIT_DF15
  assert _chi_square(counts, p_t2) > CHI2_CRIT_DF15  # temperature 2 is rejected
  assert engine.compiled.total == 2


def test_generation_stops_after_the_first_stop_token_like_transformers(small_vocab):
  hf, model = small_vocab
  prompt = [2, 7, 1, 8]
  free = _hf_greedy(hf, prompt, 12)
  # A stop token whose first occurrence is not at the start of the output.
  stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
  first = free.index(stop)
  engine = Engine(model, stop_ids=[stop], shapes=ShapeOptions(max_len=32, length_buckets=(8,)))
  g = engine.generate(prompt, max_new_tokens=12)
  assert g.output_ids == free[:first + 1]
  assert g.output_ids == _hf_greedy(hf, prompt, 12, eos=[stop])
  assert g.target_forwards == first  # the loop stopped at the stop token
