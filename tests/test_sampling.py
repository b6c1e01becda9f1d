"""bp_jax/decoding/sampling.py: the vectorised argmax and greedy sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bp_jax.decoding.sampling import first_argmax, position_keys, sample


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
