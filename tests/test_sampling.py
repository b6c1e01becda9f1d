"""bp_jax/decoding/sampling.py: the vectorised argmax, greedy sampling, the Gumbel and
inverse-CDF draws; what the rejection rule draws per cycle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding import sampling, verify
from bp_jax.decoding.sampling import (SamplingForm, SamplingParams, draw, draw_by_cdf,
                                      first_argmax, form_of, in_form, position_keys, sample,
                                      sampling_params)
from sampling_stats import chi_square


def test_first_argmax_equals_jnp_argmax_including_ties():
  x = jax.random.normal(jax.random.key(0), (3, 5, 257))
  np.testing.assert_array_equal(np.asarray(first_argmax(x)), np.asarray(jnp.argmax(x, -1)))
  ties = jnp.asarray([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
  assert first_argmax(ties).tolist() == [1, 0, 0] == jnp.argmax(ties, -1).tolist()
  assert first_argmax(ties).dtype == jnp.int32


def test_greedy_sample_is_the_first_argmax():
  logits = jax.random.normal(jax.random.key(1), (8, 1000))
  keys = position_keys(jax.random.key(2), jnp.arange(8))
  got = jax.jit(sample)(logits, jnp.float32(0.0), keys)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, -1)))


def test_draws_by_cdf_follow_the_softmax_and_skip_zero_probability_tokens():
  """One uniform per draw, inverted through the running sum: 60,000 draws from each of two rows
  match softmax(logits) (chi-square at 1 - 1e-6); tokens of probability 0 (-inf logits, the
  first and last among them) are never drawn. A draw that read the running sum one token off
  fails (checked)."""
  logits = jnp.asarray([[-jnp.inf, 0.3, 2.0, -1.0, -jnp.inf, 1.1, 0.0, -jnp.inf],
                        [1.0, -0.5, 0.0, 2.5, 0.2, -2.0, 0.7, 1.9]], jnp.float32)
  n = 60_000
  keys = position_keys(jax.random.key(7), jnp.arange(n))
  toks = np.asarray(jax.jit(jax.vmap(lambda k: draw_by_cdf(logits, jnp.stack([k, k]))))(keys))
  x = np.asarray(logits, np.float64)
  probs = np.exp(x - x.max(axis=-1, keepdims=True))
  for row in range(2):
    p = probs[row] / probs[row].sum()
    counts = np.bincount(toks[:, row], minlength=logits.shape[1])
    assert counts[p == 0].sum() == 0, counts
    stat, df, limit = chi_square(counts[p > 0], p[p > 0])
    assert stat < limit, (row, stat, df, limit, counts)


def test_draws_by_cdf_over_blocks_are_the_whole_running_sums():
  """The running sum is taken over blocks of CDF_BLOCK tokens and then within the block that
  crosses u: over a vocabulary of several blocks, its last one partial, the token is the one
  the whole vocabulary's running sum gives for the same uniform (computed here in float64
  with numpy), but at float32 rounding ties; tokens of probability 0 never."""
  V = 3 * sampling.CDF_BLOCK + 17
  logits = 2.0 * jax.random.normal(jax.random.key(8), (3, V))
  logits = logits.at[:, ::5].set(-jnp.inf).at[:, -1].set(-jnp.inf)
  n = 5000
  keys = position_keys(jax.random.key(9), jnp.arange(3 * n)).reshape(n, 3)
  toks = np.asarray(jax.jit(jax.vmap(lambda k: draw_by_cdf(logits, k)))(keys))
  u01 = 1.0 - np.asarray(jax.vmap(jax.vmap(jax.random.uniform))(keys), np.float64)
  x = np.asarray(logits, np.float64)
  p = np.exp(x - x.max(-1, keepdims=True))
  cdf = np.cumsum(p / p.sum(-1, keepdims=True), -1)
  want = np.stack([np.searchsorted(cdf[r], u01[:, r] * cdf[r, -1]) for r in range(3)], 1)
  assert np.mean(toks == want) > 0.999, np.mean(toks == want)
  assert np.all(np.isfinite(x[np.arange(3), toks]))


def test_draw_is_jax_categorical_for_the_same_keys():
  """`draw` takes categorical's Gumbel noise and a cheaper argmax: the same token for every key
  (AR decoding and `exact` keep their tokens for a seed), masked tokens never drawn."""
  logits = 3.0 * jax.random.normal(jax.random.key(1), (500, 3, 97))
  logits = logits.at[..., ::4].set(-jnp.inf)
  keys = position_keys(jax.random.key(3), jnp.arange(1500)).reshape(500, 3)
  got = np.asarray(jax.jit(draw)(logits, keys))
  want = jax.vmap(jax.random.categorical)(keys.reshape(-1), logits.reshape(1500, 97))
  np.testing.assert_array_equal(got, np.asarray(want).reshape(500, 3))
  assert got.dtype == np.int32 and np.all(got % 4 != 0)


def _random_bits_shapes(jaxpr) -> list[tuple[int, ...]]:
  """The output shapes of every `random_bits` in a jaxpr, its sub-jaxprs (branches, loops,
  vmapped calls) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "random_bits":
      found.append(tuple(eqn.outvars[0].aval.shape))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += _random_bits_shapes(inner)
  return found


def test_rejection_draws_one_vocabulary_vector_per_row_and_cycle():
  """Under rows with their own temperatures the rule's branch on T > 0 is a select that computes
  both sides: the greedy side takes the argmax and draws nothing, so the only vocabulary-sized
  random numbers of a cycle are each row's bonus draw (a greedy side that sampled drew b more
  per row: ~0.3 ms of a 3-5 ms demo cycle on this CPU)."""
  B, b, V = 2, 4, 64
  sp = SamplingParams(jnp.ones((B,)), jnp.zeros((B,), jnp.int32), jnp.ones((B,)),
                      jnp.zeros((B,)))
  keys = position_keys(jax.random.key(0), jnp.arange(B))
  rule = verify.RULES["rejection"]
  pos_B = jnp.zeros((B,), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda t, q, k: rule.verify(t, q, k, sp, keys, pos_B))(
      jnp.zeros((B, b, V)), jnp.zeros((B, b - 1, V)), jnp.zeros((B, b - 1), jnp.int32))
  vocab_sized = [s for s in _random_bits_shapes(jaxpr.jaxpr) if s[-1] == V]
  assert vocab_sized and all(s == (B, 1, V) for s in vocab_sized), vocab_sized


def test_the_sampling_form_serves_every_request_of_a_call():
  """`form_of`: the least program form for the requests a call decodes (temperature, top_k,
  top_p[, min_p] each): truncation at T = 0 is moot, min_p needs no bisection."""
  assert form_of([]) == SamplingForm.GREEDY
  assert form_of([(0.0, 5, 0.5, 0.0), (0, 0, 1.0)]) == SamplingForm.GREEDY
  assert form_of([(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.2)]) == SamplingForm.SAMPLED
  assert form_of([(1.0, 0, 1.0, 0.0), (0.5, 3, 1.0, 0.0)]) == SamplingForm.ANY
  assert form_of([(0.7, 0, 0.9)]) == SamplingForm.ANY
  sp = sampling_params(1.0, 5, 0.9, 0.1)
  assert in_form(sp, SamplingForm.ANY) is sp
  assert in_form(sp, SamplingForm.SAMPLED) == sp._replace(top_k=None, top_p=None)
  assert in_form(sp, SamplingForm.GREEDY) == SamplingParams(None, None, None, None)
  # A greedy form's draw is the argmax, whatever the values it is given would say.
  logits = jax.random.normal(jax.random.key(0), (3, 16))
  keys = position_keys(jax.random.key(1), jnp.arange(3))
  np.testing.assert_array_equal(sample(logits, in_form(sp, SamplingForm.GREEDY), keys),
                                jnp.argmax(logits, axis=-1))


def test_seed_key_is_jax_random_key_made_once_per_seed_and_implementation():
  from bp_jax.decoding.sampling import seed_key
  for s in (0, 7, 2**31 + 5):
    k = seed_key(s)
    assert k is seed_key(s)  # reused, not made again
    np.testing.assert_array_equal(jax.random.key_data(k),
                                  jax.random.key_data(jax.random.key(s)))
  assert seed_key(np.int64(7)) is seed_key(7)
  threefry = seed_key(7)
  with jax.default_prng_impl("rbg"):  # another implementation: a key of its own
    rbg = seed_key(7)
    assert rbg is not threefry
    np.testing.assert_array_equal(jax.random.key_data(rbg),
                                  jax.random.key_data(jax.random.key(7)))
  assert jax.random.key_data(rbg).shape != jax.random.key_data(threefry).shape
  assert seed_key(7) is threefry
