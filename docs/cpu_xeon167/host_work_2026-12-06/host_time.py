"""Host time per request outside the loop calls at batch B: ar, learned_default, learned_fixed.

One process, the three interleaved per group (benchmarks.controllers' order and helpers),
precompiled and warmed; per method the wall time of its generate_batch calls less the requests'
decode seconds (non-decode), split into their prefill seconds (prefill and insertion) and the
rest. BY_FUNCTION=1: also each engine and scheduler function's inclusive ms per request (timers
around them). Run from the repo root:

  BY_FUNCTION=1 PYTHONPATH=. python docs/cpu_xeon167/host_work_2026-12-06/host_time.py \\
    --num_prompts 0 --half eval --repeats 2 --batch_size 4 --group_size 8
"""
import collections
import functools
import os
import time

from absl import app

from benchmarks import controllers as C
from benchmarks.controllers import FLAGS
from bp_jax.decoding import engine as engine_lib, scheduler as scheduler_lib
from bp_jax.decoding.engine import LEARNED, Engine, decode_form
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions

ENGINE_FNS = ("stage", "defers_context", "request_start", "starts_plain",
              "_place_policy_prices", "build_draft_context", "decode_size", "insert_program",
              "_prefill", "_prefill_args", "staging_buffers", "slot_carry", "start_choice",
              "encode_padded", "check_prefill", "request_done", "slots_program", "loop_ran",
              "break_even_N", "plain_now")
SCHEDULER_FNS = ("_route", "_prefill_some", "_insert_ready", "_run_one", "_collect",
                 "_move_losing", "_grow_wanted", "_may_prefill", "_generation", "_shrink_tail",
                 "step")
method_now = ["-"]
seconds = collections.defaultdict(float)
calls = collections.defaultdict(int)


def timed(cls, name):
  fn = getattr(cls, name)

  @functools.wraps(fn)
  def wrapper(*args, **kw):
    t0 = time.perf_counter()
    try:
      return fn(*args, **kw)
    finally:
      key = (method_now[0], f"{cls.__name__}.{name}")
      seconds[key] += time.perf_counter() - t0
      calls[key] += 1
  setattr(cls, name, wrapper)


def main(_):
  if os.environ.get("BY_FUNCTION") == "1":
    for name in ENGINE_FNS:
      timed(engine_lib.Engine, name)
    for name in SCHEDULER_FNS:
      timed(scheduler_lib.Scheduler, name)
  setup = C.load_setup()
  target, drafter, prompts = decode_form(setup.target), setup.drafter, setup.prompts
  costs, _, measured = C.controller_costs(target, drafter, setup.max_len)
  policy, sizes = C.learned_policy(["learned_default"])
  make = lambda method, pol, pol_sizes, meas: Engine(
      target, stop_ids=setup.stop_ids, drafter=drafter, measured_costs=meas,
      cost_cache=FLAGS.cost_cache, policy=pol, policy_sizes=pol_sizes,
      shapes=ShapeOptions(max_len=setup.max_len, length_buckets=setup.length_buckets,
                          block_sizes=tuple(sorted({1, FLAGS.block_size, *pol_sizes}))),
      loop=LoopOptions(**C.engine_options(method, costs, {})),
      batching=BatchOptions(batch_size=FLAGS.batch_size))
  learned = make("learned_default", policy, sizes, None)
  engines = {"ar": make("ar", None, (), measured), "learned_default": learned,
             "learned_fixed": learned}
  size = {"ar": 1, "learned_default": LEARNED, "learned_fixed": FLAGS.block_size}
  methods = list(size)
  C.precompile(engines, methods, size, prompts)
  G = FLAGS.group_size
  groups = [prompts[i:i + G] for i in range(0, len(prompts), G)]
  C.warm_up(engines, methods, groups[:1], size, {m: None for m in methods}, G)
  before = {m: engines[m].compiled.total for m in methods}
  seconds.clear()
  calls.clear()
  tot = {m: dict(wall=0.0, decode=0.0, prefill=0.0, n=0) for m in methods}
  for i, group in enumerate(groups):
    for _ in range(FLAGS.repeats):
      for m in C.method_order(methods, i):
        method_now[0] = m
        t0 = time.perf_counter()
        gens = C.decode_group(engines[m], group, size[m], i * G)
        t = tot[m]
        t["wall"] += time.perf_counter() - t0
        t["decode"] += sum(g.decode_s for g in gens)
        t["prefill"] += sum(g.prefill_s for g in gens)
        t["n"] += len(gens)
  print("timed compiles", {m: engines[m].compiled.total - before[m] for m in methods})
  for m, t in tot.items():
    per = lambda x: 1e3 * x / t["n"]
    print(f"{m:16s} wall {t['wall']:.3f} decode {t['decode']:.3f} n {t['n']}  non-decode ms/req "
          f"{per(t['wall'] - t['decode']):.2f}  prefill ms/req {per(t['prefill']):.2f}  other "
          f"ms/req {per(t['wall'] - t['decode'] - t['prefill']):.2f}")
  names = sorted({name for _, name in seconds})
  if names:
    print(f"{'function (ms per request, calls)':34s}" + "".join(f"{m:>22s}" for m in methods))
  for name in names:
    print(f"{name:34s}" + "".join(
        f"{1e3 * seconds[(m, name)] / tot[m]['n']:>14.3f} ({calls[(m, name)]:5d})"
        for m in methods))


if __name__ == "__main__":
  app.run(main)
