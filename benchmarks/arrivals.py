"""Requests arriving over time, as a server meets them: every method's engine serves the same
arrival trace through its continuous-batching scheduler, stepped as a server's engine thread
steps it (`Scheduler.submit` between `step`s), and the report gives each request's latency from
its arrival to the loop call that returned its last token.

Arrivals are Poisson, one trace per load in --loads. A load is the mean number of requests in
flight were each to take the time of --max_new_tokens AR steps alone: an arrival rate of load /
(--max_new_tokens x an AR step). Requests are the run's prompts in order (--num_prompts), each
sampled with its index as seed, as benchmarks/controllers.py samples them.

Clocks:
  --sim_clock_ms  every engine's loop calls run on a simulated device's clock at the given
                  prices (benchmarks/sim_clock.py, --controller_costs and
                  --controller_draft_cost); an engine with nothing to do idles until the next
                  arrival (`SimClock.advance_to`). Prefills cost nothing there (every method
                  prefills the same prompts). The AR step is --sim_clock_ms.
  (none)          the host's clock: latencies are wall time, prefills and the host's work
                  between calls included, and the host sleeps until the next arrival. The AR
                  step is timed from our AR decoding the first prompt alone. On a shared CPU
                  only figures of one run mean anything; --repeats alternates the methods'
                  order from pass to pass.

What it asks (issue 19's light-load risk): between arrivals no request waits, so a batch's
tail rule (`StartBackoff.tail_loses`) may move a drafting request to the plain bucket; a
request arriving next that drafts then runs in another bucket, and the scheduler runs the two
by turns. The report counts the loop calls after which more than one bucket held requests
("split calls"), beside each method's latencies against our AR's (paired 95% bootstrap over
the requests).

Methods and engines are benchmarks/controllers.py's (its flags: --methods, --batch_size,
--temperature, ...; --warmup_groups decodes that many groups of --batch_size prompts by every
method first, untimed).
"""

from __future__ import annotations

import collections
import os
import time
from typing import NamedTuple

import numpy as np
from absl import flags

from benchmarks import common, controllers
from benchmarks.sim_clock import SimClock
from bp_jax import cli
from bp_jax.decode_job.compare import check_repeats_agree
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.generation import Generation
from bp_jax.decoding.scheduler import Scheduler
from bp_jax.errors import BadInputError

flags.DEFINE_string("loads", "0.5,1,2,4", "comma-separated loads: mean requests in flight were "
                    "each to take --max_new_tokens AR steps alone (one Poisson trace each)")
flags.DEFINE_integer("arrival_seed", 0, "seed of the arrival traces (load i: this + i)")
FLAGS = flags.FLAGS


class Served(NamedTuple):
  """One request of a trace as one method served it: its arrival and the end of the loop call
  that returned its last token, in seconds since the trace's start, and the time between
  (from the engine clock's own readings: a request that ends in no forward, its first token a
  stop, takes 0 s, where the offsets' difference may round below it)."""
  index: int
  arrival_s: float
  finish_s: float
  latency_s: float
  generation: Generation


class TraceRun(NamedTuple):
  """One method's pass over one trace: its requests (in index order), the loop calls it made
  and after how many of them more than one bucket held requests (split calls: the scheduler
  runs such buckets by turns), and the calls that timed the plain loop on copies of drafting
  rows (`Scheduler._probe_plain`; not among `calls`)."""
  served: list[Served]
  calls: int
  split_calls: int
  probes: int


def parse_loads(text: str) -> list[float]:
  try:
    loads = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    loads = []
  if not loads or any(not np.isfinite(x) or x <= 0 for x in loads):
    raise BadInputError(f"--loads={text!r}: give comma-separated loads > 0, e.g. 0.5,1,2,4")
  return loads


def arrival_times(n: int, rate_per_s: float, seed: int) -> list[float]:
  """`n` Poisson arrival offsets (seconds) at `rate_per_s`, the first at 0."""
  gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, max(n - 1, 0))
  return [0.0] + [float(t) for t in np.cumsum(gaps)]


def idle_until(engine: Engine, t: float) -> None:
  """The engine has nothing to do until clock reading `t`: a simulated device's clock jumps
  there, the host sleeps."""
  if isinstance(engine.clock, SimClock):
    engine.clock.advance_to(t)
  else:
    time.sleep(max(0.0, t - engine.clock()))


def serve_trace(engine: Engine, prompts: list, arrivals: list[float], block_size,
                forced: dict | None) -> TraceRun:
  """Serves prompt i at `arrivals[i]` seconds after the start on the engine's clock (module
  doc): submits what has arrived, steps the scheduler, notes when each request ended."""
  sched = Scheduler(engine, forced=forced is not None, track_progress=False)
  sampling = (FLAGS.temperature, FLAGS.top_k, 1.0, 0.0)
  t0 = engine.clock()
  pending = collections.deque(range(len(prompts)))
  served: dict[int, Served] = {}
  calls = split = 0
  probes = engine.plain_probes
  while pending or sched.busy():
    now = engine.clock()  # (absolute readings: t0 + a - t0 may round below a)
    while pending and t0 + arrivals[pending[0]] <= now:
      i = pending.popleft()
      key, ids = prompts[i]
      sched.submit(engine.batch_request(
          i, ids, FLAGS.max_new_tokens, seed=i, block_size=block_size, sampling=sampling,
          forced_continuation=None if forced is None else forced[key]))
    if not sched.busy():
      idle_until(engine, t0 + arrivals[pending[0]])
      continue
    report = sched.step()
    if report.failed:
      raise next(iter(report.failed.values()))
    if report.ran is not None:
      calls += 1
      split += sum(1 for n in sched.occupancy().values() if n) > 1
    end = engine.clock()
    for i, gen in report.finished.items():
      served[i] = Served(i, arrivals[i], end - t0, max(end - (t0 + arrivals[i]), 0.0), gen)
  return TraceRun([served[i] for i in sorted(served)], calls, split,
                  engine.plain_probes - probes)


def summary(run: TraceRun, ar: TraceRun) -> dict:
  """One method's figures on one trace; `ar`: our AR's on the same trace."""
  lat = np.array([s.latency_s for s in run.served])
  gens = [s.generation for s in run.served]
  makespan = max(s.finish_s for s in run.served)
  ones = [1] * len(lat)
  vs_ar = controllers.speedup_entry((ones, list(lat)), (ones, [s.latency_s for s in ar.served]))
  return {"requests": len(lat), "latency_mean_s": round(float(lat.mean()), 5),
          "latency_p50_s": round(float(np.percentile(lat, 50)), 5),
          "latency_p90_s": round(float(np.percentile(lat, 90)), 5),
          "latency_max_s": round(float(lat.max()), 5),
          # AR's mean latency / this method's (> 1: faster), paired over the requests
          "latency_speedup_vs_ar": vs_ar,
          "makespan_s": round(makespan, 5),
          "tokens_per_s": round(sum(g.new_tokens for g in gens) / max(makespan, 1e-9), 2),
          "drafted": sum(g.drafter_passes > 0 and not g.plain_start for g in gens),
          "plain_starts": sum(g.plain_start for g in gens),
          "moved_plain": sum(g.moved_plain for g in gens),
          "calls": run.calls, "split_calls": run.split_calls, "plain_probes": run.probes,
          "identical_to_ar": sum(g.output_ids == a.generation.output_ids
                                 for g, a in zip(gens, ar.served)),
          "latencies_s": [round(float(x), 5) for x in lat],
          "new_tokens": [g.new_tokens for g in gens],
          # each request's route: d drafted throughout, p a plain start, m moved plain midway
          "routes": "".join("p" if g.plain_start else "m" if g.moved_plain else "d"
                            for g in gens)}


def ar_step_s(engines: dict[str, Engine], prompts: list) -> float:
  """The load's unit: --sim_clock_ms, or our AR's seconds per token decoding the first prompt
  alone on this machine."""
  if FLAGS.sim_clock_ms:
    return FLAGS.sim_clock_ms * 1e-3
  gen = engines["ar"].generate(prompts[0][1], max_new_tokens=FLAGS.max_new_tokens,
                               block_size=1)
  engines["ar"].clear_tallies()
  return gen.decode_s / max(gen.new_tokens, 1)


class Prepared(NamedTuple):
  """What `served_engines` builds: each method's engine, block size and forced drafts (by
  method), the prompts, the prompt set's label, and the controller's costs and their source."""
  engines: dict
  size: dict
  forced: dict
  prompts: list
  label: str
  costs: dict
  source: str


def served_engines(methods: list[str]) -> Prepared:
  """Each method's engine as `main` serves traces with it, built from the flags, precompiled
  (`--precompile`) and warmed up (`--warmup_groups`)."""
  setup = controllers.load_setup()
  target, prompts = decode_form(setup.target), setup.prompts
  costs, source, measured = controllers.controller_costs(target, setup.drafter, setup.max_len)
  engines, _, size, forced, _ = controllers.build_engines(methods, setup, target, costs, source,
                                                          measured)
  B = FLAGS.batch_size
  if FLAGS.precompile:
    controllers.precompile(engines, methods, size, prompts)
  controllers.warm_up(engines, methods,
                      [prompts[i:i + B] for i in range(0, B * FLAGS.warmup_groups, B)],
                      size, forced, B)
  return Prepared(engines, size, forced, prompts, setup.label, costs, source)


def main(_):
  methods = controllers.parse_methods(FLAGS.methods)
  loads = parse_loads(FLAGS.loads)
  controllers.check_run_flags()
  shared = [m for m in methods if m in controllers.SHARED]
  if shared:
    raise BadInputError(f"--methods: {shared} decode in another method's engine; a trace "
                        "needs an engine of its own per method")
  started = time.perf_counter()
  engines, size, forced, prompts, label, costs, source = served_engines(methods)
  B = FLAGS.batch_size
  step_s = ar_step_s(engines, prompts)
  path_free = FLAGS.temperature == 0 or FLAGS.verify == "exact"
  print(f"  {len(prompts)} {label}, {FLAGS.max_new_tokens} new tokens, batch {B}, "
        f"AR step {1e3 * step_s:.3f} ms ({'simulated' if FLAGS.sim_clock_ms else 'timed'}), "
        f"{time.perf_counter() - started:.0f} s since start", flush=True)
  report = {}
  for j, load in enumerate(loads):
    rate = load / (FLAGS.max_new_tokens * step_s)
    arrivals = arrival_times(len(prompts), rate, FLAGS.arrival_seed + j)
    runs: dict[str, list[TraceRun]] = {m: [] for m in methods}
    for r in range(FLAGS.repeats):
      for m in controllers.method_order(methods, j * FLAGS.repeats + r):
        runs[m].append(serve_trace(engines[m], prompts, arrivals, size[m], forced[m]))
    if path_free:  # every pass gives each request the same tokens
      for m in methods:
        for i in range(len(prompts)):
          check_repeats_agree([run.served[i].generation for run in runs[m]])
    # each method's pass of the lowest mean latency
    best = {m: min(rs, key=lambda run: sum(s.latency_s for s in run.served))
            for m, rs in runs.items()}
    rows = {m: summary(best[m], best["ar"]) for m in methods}
    report[f"{load:g}"] = {"arrival_rate_per_s": round(rate, 4),
                           "arrivals_s": [round(t, 5) for t in arrivals], "methods": rows}
    print(f"\n  load {load:g} ({rate:.2f} requests/s), fastest of {FLAGS.repeats} pass(es)")
    print(f"  {'method':<24}{'mean s':>9}{'p50 s':>9}{'p90 s':>9}{'vs AR':>8}  {'95% CI':<17}"
          f"{'tok/s':>9}{'drafted':>8}{'moved':>6}{'split':>10}{'probes':>7}{'same':>6}")
    for m, row in rows.items():
      ci = row["latency_speedup_vs_ar"]
      interval = "(one request)" if ci["lo"] is None else f"[{ci['lo']:.3f}, {ci['hi']:.3f}]"
      print(f"  {m:<24}{row['latency_mean_s']:>9.4f}{row['latency_p50_s']:>9.4f}"
            f"{row['latency_p90_s']:>9.4f}{ci['ratio']:>7.3f}x  "
            f"{interval:<16}  {row['tokens_per_s']:>8,.0f}"
            f"{row['drafted']:>8}{row['moved_plain']:>6}"
            f"{row['split_calls']:>5}/{row['calls']:<4}{row['plain_probes']:>7}"
            f"{row['identical_to_ar']:>6}")
  print("\n  vs AR: AR's mean latency / the method's (> 1: faster), paired over the requests; "
        "split: loop calls after which more than one bucket held requests / all calls; "
        "probes: plain loop calls on copies of drafting rows (not among all calls)")
  if FLAGS.out:
    path = os.path.join(FLAGS.out, "arrivals.json")
    common.write_json(path, {
        "prompts": [k for k, _ in prompts], "prompt_set": label,
        "max_new_tokens": FLAGS.max_new_tokens, "block_size": FLAGS.block_size,
        "batch_size": B, "temperature": FLAGS.temperature, "verify": FLAGS.verify,
        "repeats": FLAGS.repeats, "warmup_groups": FLAGS.warmup_groups,
        "ar_step_s": step_s, "clock": "simulated" if FLAGS.sim_clock_ms else "host",
        "sim_clock_ms": FLAGS.sim_clock_ms, "sim_clock_noise": FLAGS.sim_clock_noise,
        "controller_costs": {**costs, "source": source}, "loads": report}, indent=1)
    print(f"  wrote {path}")


if __name__ == "__main__":
  cli.run(main, __doc__)
