"""The demo drafter's per-cycle acceptance histogram at block size 16: the shape of the
SIMULATED acceptance profile of benchmarks/accelerator.py.

  python -m benchmarks.acceptance_profile --num_prompts 40 \
      --out benchmarks/data/demo_acceptance_b16.json

Decodes HumanEval's held-out half with demo/target + demo/drafter at b = 16, T = 0, verify
`exact`, the paper's loop (no fallback, no controller) and counts accepted drafts per cycle
(0..15); each request's last cycle is dropped (it may be clipped at max_new_tokens).
"""

from __future__ import annotations

import collections
import json
import os
import platform
import time

import jax
from absl import flags

from benchmarks import common
from bp_jax import cli

common.define_flags("max_new_tokens", num_prompts=40)
flags.DEFINE_string("out", "benchmarks/data/demo_acceptance_b16.json", "Where to write it.")
FLAGS = flags.FLAGS

BLOCK = 16


def main(argv):
  del argv
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import LoopOptions, ShapeOptions
  from bp_jax.text.tokenizer import load_tokenizer
  from bp_jax.weights.loading import load_drafter, load_target
  target = load_target("demo/target", "float32")
  drafter = load_drafter("demo/drafter", target.cfg, "float32")
  tok = load_tokenizer("demo/target")
  engine = Engine(target, drafter=drafter,
                  shapes=ShapeOptions(max_len=512 + FLAGS.max_new_tokens + BLOCK,
                                      block_sizes=(BLOCK,)),
                  loop=LoopOptions(controller="none", verify="exact"))
  counts = collections.Counter()
  t0 = time.perf_counter()
  for _, ids in common.demo_prompts(tok, "eval", limit=FLAGS.num_prompts):
    g = engine.generate(ids, max_new_tokens=FLAGS.max_new_tokens, block_size=BLOCK)
    counts.update(a - 1 for a in g.acceptance_lengths[:-1])
  hist = [counts[i] for i in range(BLOCK)]
  out = {"what": f"accepted drafts per cycle (0..{BLOCK - 1}): demo/target + demo/drafter "
                 f"(float32), b={BLOCK}, T=0, verify=exact, no fallback, {FLAGS.num_prompts} HumanEval "
                 f"held-out prompts, {FLAGS.max_new_tokens} new tokens, each request's last "
                 "cycle dropped",
         "command": "python -m benchmarks.acceptance_profile "
                    f"--num_prompts {FLAGS.num_prompts} --max_new_tokens {FLAGS.max_new_tokens}",
         "date": time.strftime("%Y-%m-%d"),
         "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.default_backend()}",
         "counts": hist, "cycles": sum(hist),
         "tau": round(sum((i + 1) * c for i, c in enumerate(hist)) / sum(hist), 3)}
  common.write_json(FLAGS.out, out, indent=1)
  print(json.dumps(out), f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  cli.run(main, __doc__)
