"""Whether the default's choice follows costs that change under it: a second process loads the CPU.

The same prompts are decoded in phases (--phases, e.g. idle,load,idle). In each phase every
prompt is decoded once by the default (the demo config's priced controller: costs measured at
start-up, kept current from its own timed loop calls, requests starting deep or plain where
drafting lost) and once by our AR, the order alternating from prompt to prompt. A load phase
runs --load_procs other processes beside the decodes, each single-threaded:
  compute  multiplies a 256x256 matrix in a loop (a core taken from XLA's threads);
  memory   copies a 256 MB array back and forth (the caches and the memory bus taken).

At each phase's start the isolated forwards are timed again as at start-up
(`costs.measure_forward_costs`, under that phase's load): what a cycle of --block_size costs in
AR steps then, the mark the online price should move toward. Every loop call of the default is
recorded (`Engine.call_log`) with the break-even in effect after it.

Per phase the report gives: the isolated price of a cycle; the default's online break-even
(first, median, last over the phase's calls); how many speculative calls into the phase it moved
halfway from the previous phase's median to this one's ("followed after"); the requests that
drafted and the target forwards by verify length; default / AR with a 95% paired bootstrap
interval over prompts; AR tok/s. Writes load_shift.json and load_shift.png (the break-even per
loop call over time, load phases shaded, the isolated prices marked; below, each request's
speedup over AR, drafted or plain).

With --batch_size B > 1 both engines decode groups of --group_size prompts (static batches of
B slots, refilled as requests end, `Engine.generate_batch`), the methods alternating from group
to group. A batch's start rule weighs a cycle against a step of the plain loop at that batch
size (`OnlineCosts.start_break_even`), so that is the price followed there (after every call: a
plain call renews the plain step's price); the isolated forwards are timed at B rows; default /
AR is bootstrapped over the groups (a group's requests share its loop calls), and the lower plot
gives each group's speedup.

Examples (T = 0, about 3 minutes each on the 2-core CPU VM):

  python -m benchmarks.load_shift --num_prompts 24 --out /tmp/load_shift
  python -m benchmarks.load_shift --num_prompts 0 --batch_size 8 --out /tmp/load_shift_b8
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import flags

from benchmarks import common
from bp_jax import cli
from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding import controller as control
from bp_jax.decoding.costs import measure_forward_costs
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.errors import BadInputError
from bp_jax.eval.bootstrap import bootstrap_speedup

HOGS = {
    "compute": ("import numpy as np\na = np.random.rand(256, 256).astype(np.float32)\n"
                "while True:\n  a = (a @ a) * 1e-3 + 0.5\n"),
    "memory": ("import numpy as np\na = np.ones(64 << 20, np.float32)\nb = np.empty_like(a)\n"
               "while True:\n  np.copyto(b, a)\n  np.copyto(a, b)\n"),
}
PHASES = ("idle", "load")

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags (defined when run as a script, so that importing this module for
  its functions defines none)."""
  common.define_flags("target", "drafter", "max_len", "max_new_tokens", "block_size",
                      num_prompts=24,
                      helps={"num_prompts": "HumanEval eval-half prompts decoded in every phase "
                                            "(0 = all 82)."})
  flags.DEFINE_string("phases", "idle,load,idle", "comma-separated phases in order, each idle "
                      "or load")
  flags.DEFINE_enum("load", "compute", list(HOGS), "what a load phase runs beside the decodes "
                    "(module doc)")
  flags.DEFINE_integer("load_procs", 1, "processes a load phase runs (each single-threaded)")
  flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy); prompt i is "
                     "sampled with seed i by both methods")
  flags.DEFINE_enum("verify", "rejection", ["exact", "rejection"], "the default's verify rule at "
                    "T > 0 (the demo's: rejection)")
  flags.DEFINE_integer("batch_size", 1, "slots of both engines' loops (1: one request at a time)")
  flags.DEFINE_integer("group_size", 0, "prompts per generate_batch call at --batch_size > 1 "
                       "(0 = 2 x --batch_size)")
  flags.DEFINE_string("out", "out/load_shift", "folder for load_shift.json and load_shift.png")


def parse_phases(text: str) -> list[str]:
  phases = [p.strip() for p in text.split(",") if p.strip()]
  if not phases or any(p not in PHASES for p in phases):
    raise BadInputError(f"--phases={text!r}: give comma-separated phases, each of {PHASES}")
  return phases


def hog(kind: str) -> None:
  """Runs the `kind` load in this process until it is killed (single-threaded only where the
  caller's environment says so before numpy loads: OMP_NUM_THREADS=1). For a load that lasts
  beside another benchmark:
    OMP_NUM_THREADS=1 python -c "from benchmarks.load_shift import hog; hog('compute')" &
  """
  exec(HOGS[kind], {})


class Load:
  """`procs` single-threaded processes running the `kind` hog while the context is open."""

  def __init__(self, kind: str, procs: int):
    self.kind, self.procs, self.running = kind, procs, []

  def __enter__(self):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    self.running = [subprocess.Popen([sys.executable, "-c", HOGS[self.kind]], env=env)
                    for _ in range(self.procs)]
    time.sleep(1.0)  # running (the memory hog has allocated) before anything is timed
    return self

  def __exit__(self, *exc):
    for p in self.running:
      p.kill()
    for p in self.running:
      p.wait()
    self.running = []


def cycle_price(target, drafter, block_size: int, max_len: int, rows: int = 1) -> float:
  """A full cycle of `block_size` (drafter pass + verify) in AR steps of `rows` rows, from
  isolated forwards timed now (as the engine's start-up measurement)."""
  table, draft = measure_forward_costs(target, drafter, rows, block_size, max_len).relative()
  return control.break_even(block_size - 1, table, draft)


def prices(calls: list[dict], rows: int = 1) -> list[float]:
  """The price a phase follows, after each call that renews it: one request's start rule
  weighs τ against the speculative loop's break-even (renewed by speculative calls); a
  batch's (`rows` > 1 slots) against a cycle in steps of the plain loop at that batch size
  (`start_break_even`, renewed by every call of `rows` slots: a plain call times the plain
  step; a batch's tail calls, of fewer slots, price their own sizes)."""
  if rows > 1:
    return [c["start_break_even"] for c in calls
            if c["start_break_even"] is not None and c["rows"] == rows]
  return [c["break_even"] for c in calls if c["block_size"] > 1]


def followed_after(calls: list[dict], before: float | None, rows: int = 1) -> int | None:
  """Calls into a phase that renew its price (`prices`) until that price passed halfway from
  `before` (the previous phase's median) to this phase's own median; None: no earlier phase,
  no such call, or medians within 10% of each other (nothing to follow)."""
  spec = prices(calls, rows)
  if before is None or not spec:
    return None
  now = statistics.median(spec)
  if abs(now - before) < 0.1 * before:
    return None
  half = (before + now) / 2
  return next(i + 1 for i, b in enumerate(spec) if (b - half) * (now - before) >= 0)


def phase_figures(calls: list[dict], units: dict[str, list[list]], price: float,
                  rows: int = 1, greedy: bool = True) -> dict:
  """One phase's report entry (module doc). `units`: per method, the phase's decodes in the
  units the interval resamples (one request each alone; a group's requests in a batch of
  `rows` slots); `greedy`: outputs are compared with AR's (T = 0)."""
  spec = prices(calls, rows)
  gens = {m: [g for unit in us for g in unit] for m, us in units.items()}
  lengths = collections.Counter(v for g in gens["default"] for v in g.forward_verified)
  toks = {m: np.array([sum(g.new_tokens for g in u) for u in us], float)
          for m, us in units.items()}
  secs = {m: np.array([sum(g.decode_s for g in u) for u in us], float)
          for m, us in units.items()}
  sp = bootstrap_speedup(toks["default"], secs["default"], toks["ar"], secs["ar"])
  return {"isolated_cycle_price": round(price, 3),
          "break_even": {"first": spec[0] if spec else None, "last": spec[-1] if spec else None,
                         "median": round(statistics.median(spec), 4) if spec else None},
          "speculative_calls": sum(c["block_size"] > 1 for c in calls), "calls": len(calls),
          "price_calls": len(spec),
          "drafted": sum(not g.plain_start for g in gens["default"]),
          "requests": len(gens["default"]),
          "verify_lengths": common.by_verify_length(lengths),
          "speedup_vs_ar": {"ratio": round(sp.ratio, 4), "lo": round(sp.lo, 4),
                            "hi": round(sp.hi, 4)},
          "ar_tokens_per_s": round(float(toks["ar"].sum() / secs["ar"].sum()), 1),
          "by_start": by_start(gens),
          "identical_to_ar": (sum(a.output_ids == b.output_ids
                                  for a, b in zip(gens["default"], gens["ar"]))
                              if greedy else None)}


def by_start(gens: dict[str, list]) -> dict:
  """The default's drafted and plain requests apart: how many, their speed over AR's on the
  same prompts (tokens per second of the group), and the drafted ones' τ (committed tokens per
  cycle over their cycles)."""
  out = {}
  for name, drafted in (("drafted", True), ("plain", False)):
    pairs = [(d, a) for d, a in zip(gens["default"], gens["ar"]) if d.plain_start != drafted]
    if not pairs:
      continue
    rate = lambda gs: sum(g.new_tokens for g in gs) / max(sum(g.decode_s for g in gs), 1e-9)
    cycles = [x for d, _ in pairs for x in d.acceptance_lengths]
    out[name] = {"requests": len(pairs),
                 "speedup_vs_ar": round(rate([d for d, _ in pairs]) / rate([a for _, a in pairs]),
                                        4),
                 "tau": round(float(np.mean(cycles)), 3) if drafted and cycles else None}
  return out


def plot(report: dict, path: str) -> str:
  from bp_jax.eval.plots import plt, save_figure
  fig, (top, low) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  for phase in report["phases"]:
    t0, t1 = phase["start_s"], phase["end_s"]
    for ax in (top, low):
      if phase["name"] == "load":
        ax.axvspan(t0, t1, color="#f4cccc", lw=0)
    top.hlines(phase["isolated_cycle_price"], t0, t1, colors="k", linestyles="dashed")
  calls = report["calls"]
  batched = report["batch_size"] > 1
  key = "start_break_even" if batched else "break_even"
  shown = [c for c in calls if c[key] is not None and (c["rows"] == report["batch_size"])]
  top.step([c["end_s"] for c in shown], [c[key] for c in shown], where="post",
           color="#4c72b0", lw=1, label="online break-even in effect"
           + (" (in plain-loop steps)" if batched else ""))
  spec = [c for c in shown if c["block_size"] > 1]
  top.plot([c["end_s"] for c in spec], [c[key] for c in spec], "o", ms=3,
           color="#4c72b0", label="after a speculative call")
  top.plot([], [], "k--", label="isolated forwards timed at the phase's start")
  top.set_ylabel(f"a b={FLAGS.block_size} cycle, in AR steps"
                 + (f" (batch {report['batch_size']})" if batched else ""))
  top.legend(fontsize=8, loc="upper left")
  reqs = report["requests"]
  for drafted, color, label in ((True, "#55a868", "drafted"), (False, "#8c8c8c", "plain")):
    pts = [(r["end_s"], r["speedup"]) for r in reqs if (r["drafted"] > 0) == drafted]
    if pts:
      low.plot(*zip(*pts), "o", ms=3, color=color,
               label=f"{label} (a group with a request that drafted)" if batched and drafted
               else label)
  low.axhline(1.0, color="k", lw=0.8)
  low.set_ylabel(f"{'group' if batched else 'request'}: AR s / default s")
  low.set_xlabel(f"seconds since the first phase (shaded: {FLAGS.load} load, "
                 f"{FLAGS.load_procs} process{'es' if FLAGS.load_procs > 1 else ''})")
  low.legend(fontsize=8, loc="upper left")
  return save_figure(fig, path)


def main(_):
  try:
    measure()
  except BadInputError as e:
    sys.exit(f"load_shift: error: {e}")


def measure() -> None:
  """Runs the phases and writes the report (module doc)."""
  phases = parse_phases(FLAGS.phases)
  if FLAGS.load_procs < 1 or FLAGS.block_size < 2 or FLAGS.max_new_tokens < 1:
    raise BadInputError("--load_procs and --max_new_tokens must be >= 1, --block_size >= 2")
  B = FLAGS.batch_size
  if B < 1 or FLAGS.group_size < 0 or 0 < FLAGS.group_size < B:
    raise BadInputError(f"--batch_size={B} must be >= 1 and --group_size={FLAGS.group_size} "
                        "0 or at least --batch_size")
  G = 1 if B == 1 else FLAGS.group_size or 2 * B
  from configs import demo
  models = common.load_models(FLAGS)
  prompts = common.demo_prompts(models.tokenizer, "eval", limit=FLAGS.num_prompts)
  target = decode_form(models.target)
  shapes = ShapeOptions(max_len=FLAGS.max_len, block_sizes=(1, FLAGS.block_size))
  cfg = demo.get_config()
  cfg.verify = FLAGS.verify
  cfg.controller_calibration = ""  # the priced controller prices no confidence
  engines = {
      # The default as decode.py builds it from configs/demo.py, costs measured now, uncached.
      "default": Engine(target, drafter=models.drafter, stop_ids=models.stop_ids, shapes=shapes,
                        loop=LoopOptions(**loop_options(cfg), online_costs=None,
                                         start_backoff=True, start_plain=True),
                        batching=BatchOptions(batch_size=B), cost_cache=""),
      "ar": Engine(target, stop_ids=models.stop_ids, shapes=shapes,
                   loop=LoopOptions(controller="none"), batching=BatchOptions(batch_size=B))}
  engines["default"].call_log = []
  kw = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature)
  size = {"default": FLAGS.block_size, "ar": 1}
  groups = [prompts[i:i + G] for i in range(0, len(prompts), G)]

  def decode(m: str, g: int) -> list:
    """Group g's prompts decoded by method m (seed: the prompt's index in the phase)."""
    ids = [p for _, p in groups[g]]
    if B == 1:
      return [engines[m].generate(ids[0], seed=g, block_size=size[m], **kw)]
    return engines[m].generate_batch(ids, seeds=g * G, block_size=size[m], **kw)

  for name, e in engines.items():  # compile outside the timed phases
    if B > 1:  # the batched loops, for the windows these prompts take, and a first group
      e.precompile([1, size[name]], request_lengths=[len(ids) + FLAGS.max_new_tokens
                                                     for _, ids in prompts])
      decode(name, 0)
    else:  # the one-request loops: drafting first and a plain start
      e.generate(prompts[0][1], block_size=size[name], **kw)
      e.generate(prompts[0][1], block_size=1, **kw)
  log = engines["default"].call_log
  origin = time.perf_counter()
  entries, requests, timed_calls, before = [], [], [], None
  for p, name in enumerate(phases):
    with Load(FLAGS.load, FLAGS.load_procs) if name == "load" else contextlib.nullcontext():
      start, first_call = time.perf_counter() - origin, len(log)
      price = cycle_price(target, models.drafter, FLAGS.block_size, FLAGS.max_len, B)
      units = {"default": [], "ar": []}
      for g in range(len(groups)):
        for m in (("default", "ar") if g % 2 == 0 else ("ar", "default")):
          units[m].append(decode(m, g))
        requests.append(dict(unit_entry(units["default"][-1], units["ar"][-1]), phase=p,
                             key=",".join(k for k, _ in groups[g]),
                             end_s=round(time.perf_counter() - origin, 3)))
      calls = [dict(c.to_json(), end_s=round(c.end_s - origin, 4)) for c in log[first_call:]]
      timed_calls += calls
      entry = {"name": name, "start_s": round(start, 3),
               "end_s": round(time.perf_counter() - origin, 3),
               **phase_figures(calls, units, price, B, FLAGS.temperature == 0),
               "followed_after": followed_after(calls, before, B)}
    entries.append(entry)
    before = entry["break_even"]["median"] if entry["price_calls"] else before
    print_phase(p, entry)
  report = {"command": common.command_line(), "load": FLAGS.load,
            "load_procs": FLAGS.load_procs, "temperature": FLAGS.temperature,
            "block_size": FLAGS.block_size, "prompts_per_phase": len(prompts),
            "batch_size": B, "group_size": G,
            "start_up_costs": engines["default"].measured_costs.describe(),
            "phases": entries, "calls": timed_calls,
            "requests": requests}
  # One line: every loop call is in it (90-160 KB at batch 4-8 over five phases of 82 prompts).
  common.write_json(os.path.join(FLAGS.out, "load_shift.json"), report, indent=None)
  print(f"  wrote {os.path.join(FLAGS.out, 'load_shift.json')} and "
        f"{plot(report, os.path.join(FLAGS.out, 'load_shift.png'))}")


def unit_entry(default: list, ar: list) -> dict:
  """One unit's line in the report's requests (a request alone, or a group): how many of the
  default's requests drafted, their τ (over the unit's cycles), cycles and AR steps, and AR's
  seconds per token over the default's."""
  tau = [a for g in default for a in g.acceptance_lengths]
  rate = lambda gs: sum(g.new_tokens for g in gs) / max(sum(g.decode_s for g in gs), 1e-9)
  return {"requests": len(default), "drafted": sum(not g.plain_start for g in default),
          "tau": round(float(np.mean(tau)), 3) if tau else None,
          "cycles": sum(g.cycles for g in default), "ar_steps": sum(g.ar_steps for g in default),
          "speedup": round(rate(default) / max(rate(ar), 1e-9), 4)}


def print_phase(p: int, e: dict) -> None:
  be, sp = e["break_even"], e["speedup_vs_ar"]
  fmt = lambda x: "-" if x is None else f"{x:.2f}"
  same = "" if e["identical_to_ar"] is None else f", {e['identical_to_ar']}/{e['requests']} as AR"
  print(f"  phase {p + 1} {e['name']} ({e['start_s']:.0f}-{e['end_s']:.0f} s): cycle "
        f"{e['isolated_cycle_price']:.2f} AR steps isolated; online break-even first "
        f"{fmt(be['first'])}, median {fmt(be['median'])}, last {fmt(be['last'])} over "
        f"{e['price_calls']} calls that renew it ({e['speculative_calls']} speculative) of "
        f"{e['calls']}; followed after "
        f"{e['followed_after'] if e['followed_after'] is not None else '-'}; drafted "
        f"{e['drafted']}/{e['requests']}; {e['verify_lengths']}; default/AR {sp['ratio']:.3f}x "
        f"[{sp['lo']:.3f}, {sp['hi']:.3f}]"
        + "".join(f"; {k} {v['requests']} at {v['speedup_vs_ar']:.3f}x"
                  + (f" (tau {v['tau']:.2f})" if v["tau"] is not None else "")
                  for k, v in e["by_start"].items())
        + f"; AR {e['ar_tokens_per_s']:,.0f} tok/s{same}",
        flush=True)


if __name__ == "__main__":
  define_flags()
  cli.run(main, __doc__)
