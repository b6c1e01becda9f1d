"""Batch 1: where the learned default's host time goes against b = 8 in the same engine
(`learned_fixed`), in the running benchmark's context (each request right after the other
method's loop call, as `benchmarks.controllers` runs them): the engine's host steps are timed
by wrapping them, per request, every repeat after the first; medians and means per method.
`other` is the request's wall time less its loop call (`decode_s`) and its prefill
(`prefill_s`, which holds the prefill's call and reading its choice back).

  PYTHONPATH=. python docs/cpu_amx/b1_host_2026-12-07/host_split.py --num_prompts 0 \
      --half eval --batch_size 1 --repeats 3
"""
import collections
import functools
import time

import numpy as np
from absl import app, flags

from benchmarks import controllers as C

FLAGS = flags.FLAGS
STEPS = ("_prefill_form", "_place_policy_prices", "_prefill", "build_draft_context",
         "request_start", "_warm_loop", "_loop_args", "request_window", "loop_ran",
         "request_done")
METHODS = ("learned_default", "learned_fixed")


def timed(spent: collections.Counter, name: str, fn):
  @functools.wraps(fn)
  def run(*args, **kw):
    t0 = time.perf_counter()
    try:
      return fn(*args, **kw)
    finally:
      spent[name] += time.perf_counter() - t0
  return run


def main(_):
  setup = C.load_setup()
  target = C.decode_form(setup.target)
  costs, source, measured = C.controller_costs(target, setup.drafter, setup.max_len)
  methods = ["ar", *METHODS]
  built = C.build_engines(methods, setup, target, costs, source, measured)
  engines, size = built.by_method, built.size
  engine = engines["learned_default"]  # learned_fixed's too
  C.precompile(engines, methods, size, setup.prompts)
  spent = collections.Counter()
  for name in STEPS:
    setattr(engine, name, timed(spent, name, getattr(engine, name)))
  got = {m: collections.defaultdict(list) for m in METHODS}
  for rep in range(FLAGS.repeats):
    for i, prompt in enumerate(setup.prompts):
      for m in C.method_order(list(METHODS), i + rep):
        spent.clear()
        t0 = time.perf_counter()
        g = C.decode_group(engine, [prompt], size[m], i)[0]
        wall = time.perf_counter() - t0
        if rep == 0:
          continue
        row = {**spent, "wall": wall, "decode_s": g.decode_s, "prefill_s": g.prefill_s,
               "other": wall - g.decode_s - g.prefill_s}
        for k, v in row.items():
          got[m][k].append(1e3 * v)
  n = len(got[METHODS[0]]["wall"])
  print(f"ms per request, {n} requests each (repeats 2..{FLAGS.repeats}): median (mean)")
  for k in ("wall", "decode_s", "prefill_s", "other", *STEPS):
    a, b = (np.asarray(got[m].get(k, [0.0] * n)) for m in METHODS)
    print(f"  {k:22s} default {np.median(a):8.3f} ({a.mean():8.3f})   b = 8 {np.median(b):8.3f} "
          f"({b.mean():8.3f})   default - b = 8: median {np.median(a) - np.median(b):+.3f}")


if __name__ == "__main__":
  app.run(main)
