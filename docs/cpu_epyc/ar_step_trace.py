"""Where a plain AR step of the demo's target goes on this machine: the XLA:CPU operations of
three 128-token requests (batch 1, max_len 512), from a JAX profiler trace.

    PYTHONPATH=. python docs/cpu_epyc/ar_step_trace.py /tmp/ar_trace

Prints the loop's steps, the wall time per step, the operations' time per step by kind, and
each matrix product's microseconds per step with its shapes and the rate at which it reads its
weight operand (GB/s).
"""

import collections
import glob
import gzip
import json
import os
import re
import sys
import time

FOLDER = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ar_trace"
# The AR loop's optimized HLO, for the products' shapes (before JAX creates its CPU backend).
os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={FOLDER}/hlo "
                           "--xla_dump_hlo_module_re=.*ar_loop.* --xla_dump_hlo_pass_re=^$")

import jax  # noqa: E402
import numpy as np

from bp_jax.decoding.engine import Engine, decode_form  # noqa: E402
from bp_jax.decoding.options import ShapeOptions  # noqa: E402
from bp_jax.weights.loading import load_target  # noqa: E402

REQUESTS, NEW = 3, 128


def main(folder: str) -> None:
  target = decode_form(load_target("demo/target", "float32"))
  engine = Engine(target, stop_ids=[], shapes=ShapeOptions(max_len=512, length_buckets=(128,)))
  prompt = list(np.random.default_rng(0).integers(10, 4000, size=100))
  engine.generate(prompt, max_new_tokens=NEW)  # compiles
  with jax.profiler.trace(f"{folder}/trace", create_perfetto_trace=True):
    t0 = time.perf_counter()
    for _ in range(REQUESTS):
      engine.generate(prompt, max_new_tokens=NEW)
    wall = time.perf_counter() - t0
  trace = sorted(glob.glob(f"{folder}/trace/**/*.trace.json.gz", recursive=True))[-1]
  events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
  per_op = collections.defaultdict(float)
  for e in events:
    per_op[e["name"]] += e.get("dur", 0.0)
  steps = REQUESTS * (NEW - 1)  # the prefill gives each request's first token
  print(f"{steps} AR steps, {1e3 * wall / steps:.3f} ms per step (traced)")
  kinds = collections.defaultdict(float)
  for name, us in per_op.items():
    if name.startswith(("$", "np.", "end:")) or "Thunk" in name or "Pjit" in name:
      continue
    kinds[re.sub(r"[.\d]+$", "", name)] += us
  for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]:
    print(f"  {kind:28s} {us / steps:8.1f} us per step")
  dots = sorted((n for n in per_op if re.fullmatch(r"dot\.\d+", n)), key=lambda n: -per_op[n])
  hlo = ar_loop_hlo(folder)
  for name in dots:
    m = re.search(rf"%{re.escape(name)} = (\S+) dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    if not m:
      continue
    rhs = re.search(rf"%{re.escape(m.group(3))} = f32\[([\d,]+)\]", hlo)
    size = int(np.prod([int(d) for d in rhs.group(1).split(",")])) * 4 if rhs else 0
    us = per_op[name] / steps
    print(f"  {name:9s} {us:7.1f} us  out {m.group(1):18s} weights {size / 1e6:.2f} MB "
          f"({size / us / 1e3:.1f} GB/s)")


def ar_loop_hlo(folder: str) -> str:
  """The optimized HLO text of the AR loop the trace ran (XLA's dump; empty when none)."""
  files = glob.glob(f"{folder}/hlo/*ar_loop*after_optimizations.txt")
  return open(files[0]).read() if files else ""


if __name__ == "__main__":
  main(FOLDER)
