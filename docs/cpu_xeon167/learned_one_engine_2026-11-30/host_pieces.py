"""Where a learned request's non-decode time goes: decode.py's demo engine twice, one with
demo/policy (learned sizes, "L") and one at the fixed b = 8 ("F"), both precompiled for the
run's lengths and sampling form and their start-up frozen out of garbage collections, the two
alternating per prompt over 3 passes; each engine method and program lookup timed where it
runs, per request (the fastest pass of each request by its wall time), summed over requests /
N. Nested: `stage` holds `_prefill_form` (which holds `defers_context`), `_place_policy_prices`
and `programs.prefill`.

  PYTHONPATH=. python docs/cpu_xeon167/learned_one_engine_2026-11-30/host_pieces.py 1 82
  # arguments: temperature (> 0: the sampling drafter, rejection), prompts
"""
import collections, sys, time
import numpy as np
from benchmarks import common
from bp_jax.decode_job.run import build_engine
from bp_jax.decoding.engine import LEARNED
from bp_jax.decoding.sampling import form_of
from bp_jax.gc_freeze import freeze_after_startup
from bp_jax.policy.mlp import load_policy
from configs import demo

T = float(sys.argv[1]); N = int(sys.argv[2])
cfg = demo.get_config()
if T > 0:
  cfg.drafter, cfg.verify = "demo/drafter_sampling", "rejection"
eL, tok, _ = build_engine(cfg)
eF, _, _ = build_engine(cfg)
pol, info = load_policy("demo/policy")
eL.set_policy(pol, info.block_sizes)
prompts = [ids for _, ids in common.demo_prompts(tok, "eval")][:N]
form = form_of([(T, 0, 1.0, 0.0)])
lengths = [len(p) + 128 for p in prompts]
t0 = time.perf_counter()
eL.precompile(eL.policy_sizes, policy=True, plain_prefill=False, request_lengths=lengths, forms=(form,))
eF.precompile((8,), request_lengths=lengths, forms=(form,))
print("precompile", round(time.perf_counter() - t0, 1), flush=True)
freeze_after_startup()
log = collections.defaultdict(float)
def wrap(obj, name, tag):
  f = getattr(obj, name)
  def g(*a, **k):
    t0 = time.perf_counter(); r = f(*a, **k)
    log[tag + name] += time.perf_counter() - t0
    return r
  setattr(obj, name, g)
for e, tag in ((eL, "L."), (eF, "F.")):
  for n in ("_place_policy_prices", "defers_context", "_prefill_form", "stage", "build_draft_context",
            "request_start", "loop_ran", "request_done", "check_prefill", "_loop_args", "request_window"):
    wrap(e, n, tag)
  for n in ("warm", "loop", "prefill"):
    wrap(e.programs, n, tag + "programs.")
rows = collections.defaultdict(list)
for rep in range(3):
  for i, p in enumerate(prompts):
    order = [(eL, LEARNED, "L"), (eF, 8, "F")]
    if i % 2: order = order[::-1]
    for e, bs, tag in order:
      log.clear()
      t0 = time.perf_counter()
      g = e.generate(p, max_new_tokens=128, block_size=bs, temperature=T, seed=i)
      w = time.perf_counter() - t0
      rec = dict(log); rec.update(wall=w, pre=g.prefill_s, dec=g.decode_s, plain=g.plain_start, b=g.block_size)
      rows[(tag, i)].append(rec)
# per request: fastest repeat by wall
agg = collections.defaultdict(lambda: collections.defaultdict(list))
for (tag, i), recs in rows.items():
  best = min(recs, key=lambda r: r["wall"])
  for k, v in best.items():
    if isinstance(v, float):
      agg[tag][k.split(".", 1)[-1]].append(v)
keys = sorted(set(agg["L"]) | set(agg["F"]))
for k in keys:
  l, f = agg["L"].get(k, [0]), agg["F"].get(k, [0])
  print(f"{k:28s} L mean {1e3*np.sum(l)/N:8.3f}  F mean {1e3*np.sum(f)/N:8.3f}  (per request)")
for tag in "LF":
  o = np.array(agg[tag]["wall"]) - np.array(agg[tag]["dec"])
  print(tag, "other(wall-dec) median %.2f mean %.2f" % (1e3*np.median(o), 1e3*np.mean(o)))
