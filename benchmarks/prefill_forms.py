"""What each form of the prefill costs (`Engine._prefill_form`, `programs.DraftContext`): one
request's prefill at each length bucket, timed form by form in one process, the forms
interleaved repeat by repeat (the first --skip repeats not counted), median milliseconds:

  target_only          the target's forward alone (a request that decodes plain)
  drafter              and the drafter's context over the prompt (a fixed size that drafts)
  drafter_first_block  and the drafter's pass over its first block (the `draft_confidence`
                       feature: every prefill with a drafter ran it before 2026-11-29; now only
                       one whose policy reads it, or labelling)
  policy_drafter       a learned size's prefill with the drafter's context (the --policy's)
  policy_later         a learned size's prefill without it, keeping the drafter's layers'
                       outputs (`Engine.defers_context`); `draft_context` is then the program
                       that builds that context for a request that drafts

  python -m benchmarks.prefill_forms --lengths 128,256 --repeats 40 --out out/prefill_forms.json

Prompts are random token ids filling the bucket but for its last --pad positions.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import flags

from benchmarks import common
from bp_jax import cli

common.define_flags("target", "drafter", "max_len")
flags.DEFINE_string("policy", "demo/policy", "Block-size policy checkpoint of the policy forms.")
flags.DEFINE_string("lengths", "128,256", "Length buckets (padded prompt lengths) timed.")
flags.DEFINE_integer("pad", 20, "Padding positions at the end of each bucket's prompt.")
flags.DEFINE_integer("repeats", 40, "Prefills per form and length.")
flags.DEFINE_integer("skip", 5, "First repeats not counted (compiles, first runs).")
flags.DEFINE_float("temperature", 0.0, "Temperature of the first token each prefill samples "
                   "(its sampling form: `sampling.form_of`); 0: greedy.")
flags.DEFINE_string("out", "", "Optional JSON output path.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import ShapeOptions
  from bp_jax.decoding.programs import DraftContext
  from bp_jax.decoding.sampling import form_of, sampling_params
  from bp_jax.decoding.requests import check_sampling
  from bp_jax.errors import BadInputError
  from bp_jax.policy.features import FEATURE_TYPES
  from bp_jax.policy.mlp import load_policy
  lengths = [int(x) for x in FLAGS.lengths.split(",") if x.strip()]
  if FLAGS.repeats <= FLAGS.skip or FLAGS.skip < 0 or not lengths or FLAGS.pad < 0:
    raise BadInputError("--repeats must exceed --skip >= 0; --lengths non-empty; --pad >= 0")
  settings = (FLAGS.temperature, 0, 1.0, 0.0)  # (temperature, top_k, top_p, min_p)
  check_sampling(*settings)
  sp, form = sampling_params(*settings), form_of([settings])
  models = common.load_models(FLAGS, tokenizer=False)
  policy, info = load_policy(FLAGS.policy)
  sizes = tuple(int(b) for b in info.block_sizes)
  engine = Engine(models.target, drafter=models.drafter, policy=policy, policy_sizes=sizes,
                  shapes=ShapeOptions(max_len=FLAGS.max_len, length_buckets=tuple(lengths),
                                      block_sizes=tuple(sorted({1, *sizes}))))
  forms = {"target_only": dict(context=DraftContext.NONE),
           "drafter": dict(context=DraftContext.BUILT),
           "drafter_first_block": dict(context=DraftContext.BUILT, features=FEATURE_TYPES),
           "policy_drafter": dict(context=DraftContext.BUILT, with_policy=True),
           "policy_later": dict(context=DraftContext.LATER, with_policy=True)}
  rows = {}
  for P in lengths:
    n = P - FLAGS.pad
    if n < 1:
      raise BadInputError(f"--pad={FLAGS.pad} leaves no prompt in a bucket of {P}")
    tokens = np.random.default_rng(P).integers(1, engine.cfg.vocab_size - 1,
                                               (1, P)).astype(np.int32)
    ms = {k: [] for k in (*forms, "draft_context")}
    for rep in range(FLAGS.repeats):
      for name, kw in forms.items():
        buffers = engine.staging_buffers()
        fn, args = engine._prefill(tokens, np.int32(n), jax.random.key(0), sp, form,
                                   buffers=buffers, **kw)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        secs = time.perf_counter() - t0
        if rep >= FLAGS.skip:
          ms[name].append(1e3 * secs)
        if kw["context"] == DraftContext.LATER:
          _, context_s = engine.build_draft_context(out._replace(draft_cache=buffers[1]), n)
          if rep >= FLAGS.skip:
            ms["draft_context"].append(1e3 * context_s)
    rows[P] = {k: round(float(np.median(v)), 3) for k, v in ms.items()}
    print(f"  bucket {P} ({n} tokens), median ms: " + ", ".join(f"{k} {v}"
                                                                 for k, v in rows[P].items()),
          flush=True)
  result = {"date": time.strftime("%Y-%m-%d"), "command": common.command_line(),
            "repeats_counted": FLAGS.repeats - FLAGS.skip,
            "temperature": FLAGS.temperature, "sampling_form": form.name,
            "median_ms_by_bucket": rows}
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    common.write_json(FLAGS.out, result, indent=1)


if __name__ == "__main__":
  cli.run(main, __doc__)
