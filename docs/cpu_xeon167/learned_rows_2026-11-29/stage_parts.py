"""The learned request's host pieces at batch 1 (decode.py's demo engine), the third of three
passes over 40 prompts, learned and b = 8 alternating, each piece timed where it runs
(perf_counter). T = 0 by default; with an argument T > 0, at that temperature with the sampling
drafter and rejection sampling, prompt i sampled with seed i:

  PYTHONPATH=. python docs/cpu_xeon167/learned_rows_2026-11-29/stage_parts.py      # T = 0
  PYTHONPATH=. python docs/cpu_xeon167/learned_rows_2026-11-29/stage_parts.py 1    # T = 1
"""
import collections
import sys
import time

import numpy as np

from benchmarks import common
from bp_jax.decode_job.run import build_engine
from bp_jax.decoding.engine import LEARNED
from bp_jax.policy.mlp import load_policy
from configs import demo

temperature = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
cfg = demo.get_config()
if temperature > 0:
  cfg.drafter, cfg.verify = "demo/drafter_sampling", "rejection"
engine, tok, _ = build_engine(cfg)
pol, info = load_policy("demo/policy")
engine.set_policy(pol, info.block_sizes)
prompts = [ids for _, ids in common.demo_prompts(tok, "eval")][:40]
acc = collections.defaultdict(list)


def wrap(name):
  f = getattr(engine, name)

  def g(*a, **k):
    t0 = time.perf_counter()
    r = f(*a, **k)
    acc[name].append(time.perf_counter() - t0)
    return r

  setattr(engine, name, g)


for n in ("_place_policy_prices", "_prefill_form", "stage", "build_draft_context",
          "request_start", "loop_ran", "_loop_args"):
  wrap(n)
for rep in range(3):
  if rep == 2:
    acc.clear()
  for i, p in enumerate(prompts):
    for bs in (LEARNED, 8):
      t0 = time.perf_counter()
      g = engine.generate(p, max_new_tokens=128, block_size=bs, temperature=temperature, seed=i)
      w = time.perf_counter() - t0
      if rep == 2:
        for key, v in (("wall", w), ("pre", g.prefill_s), ("dec", g.decode_s),
                       ("other", w - g.prefill_s - g.decode_s)):
          acc[f"{key}_{bs}"].append(v)
for k, v in acc.items():
  print(f"{k:24s} n={len(v):3d} mean {1e3*np.mean(v):8.3f} ms  median {1e3*np.median(v):8.3f}")
print(dict(engine.compiled.counts))
