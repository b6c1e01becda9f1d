"""A learned request's price pieces on decode.py's demo engine with demo/policy at T = 1 (the
sampling drafter, rejection):

  PYTHONPATH=. python docs/cpu_xeon167/learned_one_engine_2026-11-30/price_pieces.py
      alone (no decode between calls), after 12 requests: medians of 200 calls each (ms)
  PYTHONPATH=. python docs/cpu_xeon167/learned_one_engine_2026-11-30/price_pieces.py after
      `policy_prices` four times in a row after each of 30 requests, second pass: the median
      and mean of each call (ms), the first right after a decode
"""
import sys
import time

import numpy as np

from benchmarks import common
from bp_jax.decode_job.run import build_engine
from bp_jax.decoding.engine import LEARNED
from bp_jax.policy.mlp import load_policy
from configs import demo

cfg = demo.get_config()
cfg.drafter, cfg.verify = "demo/drafter_sampling", "rejection"
engine, tok, _ = build_engine(cfg)
policy, info = load_policy("demo/policy")
engine.set_policy(policy, info.block_sizes)
after = sys.argv[1:] == ["after"]
prompts = [ids for _, ids in common.demo_prompts(tok, "eval")][:30 if after else 12]


def decode(i: int, ids) -> None:
  engine.generate(ids, max_new_tokens=128, block_size=LEARNED, temperature=1.0, seed=i)


def seconds(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


if after:
  calls = []
  for rep in range(2):
    for i, ids in enumerate(prompts):
      decode(i, ids)
      ts = [seconds(engine.policy_prices) for _ in range(4)]
      if rep:
        calls.append(ts)
  ms = 1e3 * np.asarray(calls)
  print("policy_prices after a decode, calls 1..4: median", np.median(ms, 0).round(3),
        "mean", ms.mean(0).round(3))
  sys.exit()

for i, ids in enumerate(prompts):
  decode(i, ids)


def place_anew():
  engine._placed_prices = None  # as when the prices moved past PRICE_PLACE_RTOL
  engine._place_policy_prices()


for name, fn in (("policy_prices", engine.policy_prices), ("place prices anew", place_anew),
                 ("defers_context", engine.defers_context),
                 ("start_choice(7)", lambda: engine.start_choice(7)),
                 ("request_start(7)", lambda: engine.request_start(7))):
  print(f"{name:20s} {1e3 * float(np.median([seconds(fn) for _ in range(200)])):.3f} ms")
