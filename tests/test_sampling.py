"""bp_jax/decoding/sampling.py: the vectorised argmax, greedy sampling and the inverse-CDF
draws."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding.sampling import draw_by_cdf, first_argmax, position_keys, sample
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
