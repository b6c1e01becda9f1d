"""Does a one-request step grow with max_len? The demo's AR step and b=8 cycle at two cache
sizes, same requests, one process, interleaved per request.

  python -m benchmarks.max_len_step --max_lens 640,2048 --num_prompts 12 --repeats 2

Per request: an AR decode and a speculative decode (b = 8, the paper's loop: every draft
verified, verify `exact`) on an engine of each max_len; the figures are seconds per AR step
(decode seconds / target forwards) and per cycle (decode seconds / cycles), and their ratio
between the largest and the smallest max_len with a paired bootstrap interval over requests.
Outputs must be identical at every max_len (checked).
"""

from __future__ import annotations

import json
import time

from absl import flags

from benchmarks import common
from bp_jax import cli

flags.DEFINE_list("max_lens", ["640", "2048"], "Cache sizes to compare (the first is the base).")
common.define_flags("max_new_tokens", "block_size", "repeats", num_prompts=12)
flags.DEFINE_string("out", "", "Optional JSON output path.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import LoopOptions, ShapeOptions
  from bp_jax.eval.bootstrap import bootstrap_ratio_ci
  from bp_jax.text.tokenizer import load_tokenizer
  from bp_jax.weights.loading import load_drafter, load_target
  target = load_target("demo/target", "float32")
  drafter = load_drafter("demo/drafter", target.cfg, "float32")
  tok = load_tokenizer("demo/target")
  lens = [int(m) for m in FLAGS.max_lens]
  b = FLAGS.block_size
  engines = {m: Engine(target, drafter=drafter,
                       shapes=ShapeOptions(max_len=m, block_sizes=(b,), length_buckets=(512,)),
                       loop=LoopOptions(controller="none", verify="exact")) for m in lens}
  prompts = [ids for _, ids in common.demo_prompts(tok, "eval", limit=FLAGS.num_prompts)]
  secs = {(m, k): [0.0] * len(prompts) for m in lens for k in ("ar", "spec")}
  counts, outputs = {}, {}
  for rep in range(FLAGS.repeats + 1):  # pass 0 warms up (compiles); not counted
    for i, ids in enumerate(prompts):
      order = lens if (rep + i) % 2 == 0 else lens[::-1]
      for kind, size in (("ar", 1), ("spec", b)):
        for m in order:
          g = engines[m].generate(ids, max_new_tokens=FLAGS.max_new_tokens, block_size=size)
          outputs.setdefault((kind, i), g.output_ids)
          if g.output_ids != outputs[(kind, i)]:
            raise RuntimeError(f"prompt {i}: {kind} output differs at max_len {m}")
          counts[(kind, i)] = g.target_forwards if kind == "ar" else g.cycles
          if rep:
            secs[(m, kind)][i] += g.decode_s
  base, top = lens[0], lens[-1]
  result = {"date": time.strftime("%Y-%m-%d"), "max_lens": lens, "block_size": b,
            "prompts": len(prompts), "repeats": FLAGS.repeats}
  for kind, what in (("ar", "step"), ("spec", "cycle")):
    n = sum(counts[(kind, i)] for i in range(len(prompts))) * FLAGS.repeats
    for m in lens:
      result[f"{kind}_{what}_ms_at_{m}"] = 1e3 * sum(secs[(m, kind)]) / n
    ci = bootstrap_ratio_ci(secs[(top, kind)], secs[(base, kind)])
    result[f"{kind}_{what}_ratio_{top}_over_{base}"] = [round(x, 3) for x in ci]
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    common.write_json(FLAGS.out, result, indent=1)


if __name__ == "__main__":
  cli.run(main, __doc__)
