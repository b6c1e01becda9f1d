"""Times the verify rules' sampling work alone: one cycle's `propose` and `verify` of each rule
(`bp_jax.decoding.verify`) on random logits, with a batch's per-row sampling settings, as the
speculative loop calls them. No model runs: this is the cost a cycle pays at T > 0 on top of
its forwards, and what top-k / top-p add to it.

Each call is jitted once and then timed over --reps calls (mean); the settings are T = 1 with
nothing truncated, then --top_k / --top_p. Example (the demo's shapes, b = 8, vocabulary 4096):

  python -m benchmarks.verify_cost --batch_size 1 --block_size 8 --vocab 4096
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding import sampling, verify
from bp_jax.decoding.sampling import SamplingForm, SamplingParams, form_of, in_form
from bp_jax.errors import BadInputError

flags.DEFINE_integer("batch_size", 1, "rows of the batch (each with its own settings)")
flags.DEFINE_integer("block_size", 8, "block size b: b-1 drafts, b target positions")
flags.DEFINE_integer("vocab", 4096, "vocabulary size of the logits")
flags.DEFINE_integer("top_k", 20, "top-k of the truncated settings")
flags.DEFINE_float("top_p", 0.95, "top-p of the truncated settings")
flags.DEFINE_integer("reps", 50, "timed calls per measurement (their mean is reported)")
flags.DEFINE_list("top_candidates", [str(sampling.TOP_CANDIDATES), "0"],
                  "the truncated settings timed with each of these counts of largest values per "
                  "row to read the thresholds off (sampling.TOP_CANDIDATES; 0: every row "
                  "bisected), in one process on the same logits")
flags.DEFINE_string("out", "", "folder for verify_cost.json (empty: print only)")
FLAGS = flags.FLAGS


def row_settings(B: int, top_k: int, top_p: float) -> SamplingParams:
  """[B] settings: T = 1 for every row, with top_k / top_p (0 / 1.0: off)."""
  return SamplingParams(jnp.ones((B,), jnp.float32), jnp.full((B,), top_k, jnp.int32),
                        jnp.full((B,), top_p, jnp.float32), jnp.zeros((B,), jnp.float32))


def measure(B: int, b: int, V: int, top_k: int, top_p: float, reps: int,
            candidates: tuple[int, ...] = (sampling.TOP_CANDIDATES,)) -> dict:
  """{rule: {settings: {"propose_ms", "verify_ms"}}} for both rules, untruncated and truncated,
  the truncated settings once per count of `candidates` (`sampling.TOP_CANDIDATES`, set while
  they are traced; labelled unless it is the default)."""
  rng = np.random.default_rng(0)
  target_BbV = jnp.asarray(rng.normal(size=(B, b, V)), jnp.float32)
  draft_BkV = jnp.asarray(rng.normal(size=(B, b - 1, V)), jnp.float32)
  keys_B = jax.vmap(jax.random.key)(jnp.arange(B))
  pos_B = jnp.arange(B, dtype=jnp.int32) * 10 + 50
  # Each in the sampling form an engine's loop reads it in (`sampling.form_of`, `in_form`).
  settings = [("T=1", in_form(row_settings(B, 0, 1.0), SamplingForm.SAMPLED),
               sampling.TOP_CANDIDATES)]
  truncated = in_form(row_settings(B, top_k, top_p), form_of([(1.0, top_k, top_p)]))
  for n in candidates:
    label = f"T=1, top_k {top_k}, top_p {top_p:g}"
    if n != sampling.TOP_CANDIDATES:
      label += f", {n} candidates" if n > 0 else ", bisection only"
    settings.append((label, truncated, n))
  out: dict = {}
  default = sampling.TOP_CANDIDATES
  try:
    for name, rule in verify.RULES.items():
      for label, sp, n in settings:
        sampling.TOP_CANDIDATES = n  # read while the calls below are traced (fresh functions)
        drafts_Bk, q_BkV = jax.jit(rule.propose)(draft_BkV, sp, keys_B, pos_B)  # not op by op
        propose_args = (draft_BkV, sp, keys_B, pos_B)
        verify_args = (target_BbV, q_BkV, drafts_Bk, sp, keys_B, pos_B)
        out.setdefault(name, {})[label] = {
            "propose_ms": round(common.mean_ms(lambda *a: rule.propose(*a), propose_args, reps),
                                4),
            "verify_ms": round(common.mean_ms(lambda *a: rule.verify(*a), verify_args, reps),
                               4)}
  finally:
    sampling.TOP_CANDIDATES = default
  return out


def main(_):
  if min(FLAGS.batch_size, FLAGS.vocab, FLAGS.reps) < 1 or FLAGS.block_size < 2:
    raise BadInputError("--batch_size, --vocab and --reps must be >= 1, --block_size >= 2")
  B, b, V = FLAGS.batch_size, FLAGS.block_size, FLAGS.vocab
  try:
    candidates = tuple(int(n) for n in FLAGS.top_candidates)
  except ValueError:
    raise BadInputError(f"--top_candidates={','.join(FLAGS.top_candidates)}: expected integers "
                        "(0: every row bisected)") from None
  report = measure(B, b, V, FLAGS.top_k, FLAGS.top_p, FLAGS.reps, candidates)
  print(f"  batch {B}, b={b}, vocabulary {V}, {jax.default_backend()}, mean of {FLAGS.reps} "
        "calls")
  print(f"  {'rule':<11}{'settings':<46}{'propose ms':>12}{'verify ms':>11}")
  for name, by in report.items():
    for label, t in by.items():
      print(f"  {name:<11}{label:<46}{t['propose_ms']:>12.3f}{t['verify_ms']:>11.3f}")
  if FLAGS.out:
    common.write_json(os.path.join(FLAGS.out, "verify_cost.json"),
                      {"batch_size": B, "block_size": b, "vocab": V, "reps": FLAGS.reps,
                       "backend": jax.default_backend(), "rules": report}, indent=1)
    print(f"  wrote {os.path.join(FLAGS.out, 'verify_cost.json')}")


if __name__ == "__main__":
  cli.run(main, __doc__)
