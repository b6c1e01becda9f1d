"""Batch 1 plain prefill seconds of the demo target by prompt length (random tokens), median
and least of 15 after 3 untimed.

  PYTHONPATH=. python docs/cpu_epyc/model17_2026-12-08/prefill_by_len.py
"""
import numpy as np
from bp_jax import Engine, ShapeOptions, load_drafter, load_target
target = load_target("demo/target", "float32")
drafter = load_drafter("demo/drafter", target.cfg, "float32")
print(target.cfg)
eng = Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=640, block_sizes=(8,)))
rng = np.random.default_rng(0)
for n in (40, 64, 100, 128, 200, 256, 400, 512):
  ids = [int(t) for t in rng.integers(10, 1000, n)]
  for _ in range(3): eng.generate(ids, max_new_tokens=2, block_size=1)
  pre = [eng.generate(ids, max_new_tokens=2, block_size=1).prefill_s for _ in range(15)]
  print(f"n={n}: plain prefill median {np.median(pre)*1e3:.2f} ms min {min(pre)*1e3:.2f}")
