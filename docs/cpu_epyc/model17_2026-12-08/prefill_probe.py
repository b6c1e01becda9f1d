"""Batch 1 prefill time on the demo over HumanEval's evaluation half: the prompts' lengths and
length buckets, and per block size (1: the plain prefill; 8: with the drafter's context) the
median prefill_s and wall time less decode of a 4-token request.

  PYTHONPATH=. python docs/cpu_epyc/model17_2026-12-08/prefill_probe.py
"""
import time
import numpy as np
from bp_jax import Engine, ShapeOptions, load_drafter, load_target, load_tokenizer
from benchmarks.common import demo_prompts

target = load_target("demo/target", "float32")
drafter = load_drafter("demo/drafter", target.cfg, "float32")
tok = load_tokenizer("demo/target")
prompts = demo_prompts(tok, "eval")
lens = [len(p) for _, p in prompts]
print("prompt lengths: min %d median %d max %d" % (min(lens), np.median(lens), max(lens)))
eng = Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=640, block_sizes=(8,)))
print("length buckets", eng.length_buckets)
from bp_jax.decoding.buckets import pick_bucket
print("bucket counts", {b: sum(pick_bucket(n, eng.length_buckets) == b for n in lens) for b in eng.length_buckets})
for size in (1, 8):
  for _ in range(2):  # warm
    for _, ids in prompts[:40]:
      eng.generate(ids, max_new_tokens=4, block_size=size)
  pre, wall, dec = [], [], []
  for _, ids in prompts:
    t0 = time.perf_counter(); g = eng.generate(ids, max_new_tokens=4, block_size=size)
    wall.append(time.perf_counter() - t0); pre.append(g.prefill_s); dec.append(g.decode_s)
  print(f"block {size}: prefill_s median {np.median(pre)*1e3:.2f} ms, wall-decode median "
        f"{np.median(np.array(wall)-np.array(dec))*1e3:.2f} ms, decode(4 tok) {np.median(dec)*1e3:.2f}")
