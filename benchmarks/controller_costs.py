"""Measures the confidence controller's cost table (`--config.controller_costs`,
`--config.controller_draft_cost`): one target forward over 1, 2, 4, ... tokens and one drafter
pass, each relative to one AR step (a target forward over 1 token), as the speculative loop runs
them (per-layer weights, the drafter's chosen-layer features returned, a cache of `max_len`
slots read up to position `pos`).

Each forward runs `reps` times inside one jitted `fori_loop` (dispatch amortised); the fastest
of `repeats` runs is kept. The engine measures its own costs the same way at start-up unless
they are given (`bp_jax.decoding.costs`, at its verify lengths, mid-cache); this script shows
them at other cache positions and token counts. Example:

  python -m benchmarks.controller_costs --target demo/target --drafter demo/drafter
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from absl import flags

from flax import nnx

from benchmarks import common
from bp_jax import cli

common.define_flags("target", "drafter", "dtype", "max_len", "block_size", repeats=5)
flags.DEFINE_integer("pos", 300, "cache position of the measured forwards (prompt + generated)")
flags.DEFINE_string("tokens", "1,2,4,8,16,32", "verify lengths (powers of two from 1)")
flags.DEFINE_integer("reps", 64, "forwards per timed call")
FLAGS = flags.FLAGS


def _timed(fn, *args) -> float:
  """Fastest seconds per forward of a jitted fori_loop of FLAGS.reps forwards."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best / FLAGS.reps


def main(_):
  target, drafter, _, _ = common.load_models(FLAGS, tokenizer=False)
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  layer_ids = drafter.cfg.target_layer_ids
  pos = jnp.asarray([FLAGS.pos], jnp.int32)
  cache = target.init_cache(1, FLAGS.max_len).per_layer()
  draft_cache = drafter.init_cache(1, FLAGS.max_len).per_layer()

  @jax.jit
  def verify(state, cache, tokens_1T):
    model = nnx.merge(t_graph, state)
    layers = model.loop_layers()  # the form an engine decodes with

    def step(i, acc):  # tokens vary with i: a loop-invariant forward would be hoisted
      toks = (tokens_1T + i) % model.cfg.vocab_size
      out = model(toks, cache.with_lengths(pos), layer_ids, layers=layers)
      return acc + out.logits[0, -1, 0] + out.layer_hiddens[0][0, 0, 0]
    return jax.lax.fori_loop(0, FLAGS.reps, step, jnp.float32(0))

  @jax.jit
  def draft(state, d_state, draft_cache):
    model, dr = nnx.merge(t_graph, state), nnx.merge(d_graph, d_state)
    layers = dr.loop_layers()
    b = FLAGS.block_size

    def step(i, acc):
      block = jnp.full((1, b), dr.cfg.mask_token_id, jnp.int32).at[0, 0].set(i)
      h = dr.draft(model.embed_tokens(block), draft_cache.with_lengths(pos), layers)
      logits = model.project_to_vocab(h[:, 1:])
      return acc + jnp.sum(jnp.argmax(logits, -1)) + jnp.max(jax.nn.softmax(logits))
    return jax.lax.fori_loop(0, FLAGS.reps, step, jnp.float32(0))

  lengths = [int(t) for t in FLAGS.tokens.split(",")]
  secs = {t: _timed(verify, t_state, cache, jnp.ones((1, t), jnp.int32)) for t in lengths}
  draft_s = _timed(draft, t_state, d_state, draft_cache)
  ar = secs[1]
  out = {"device": str(jax.devices()[0]), "pos": FLAGS.pos, "block_size": FLAGS.block_size,
         "ms": {str(t): round(s * 1e3, 4) for t, s in secs.items()},
         "draft_ms": round(draft_s * 1e3, 4),
         "controller_costs": ",".join(f"{secs[t] / ar:.2f}" for t in lengths),
         "controller_draft_cost": round(draft_s / ar, 2)}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  cli.run(main, __doc__)
