"""Where a batch's wall time goes besides its loop calls and prefills: our AR, the learned
default and AR's twin, the benchmark's engines (`benchmarks.controllers`, its flags), each group
decoded by every method in turn; per method the wall time, the requests' decode seconds (their
loop calls), their prefill and insertion seconds, and the rest (the host's work between calls,
first runs of programs, fresh buffers, copies). `--profile_host`: a cProfile of each method's
timed decodes (host functions by own and cumulative time).

  PYTHONPATH=. python docs/cpu_amx/batch_t1_2026-12-07/host_phases.py --num_prompts 0 \
      --half eval --batch_size 4 --group_size 8 --repeats 2
  # batch 1, the default against b = 8 (its own engine and the default's):
  PYTHONPATH=. python docs/cpu_amx/batch_t1_2026-12-07/host_phases.py --num_prompts 0 \
      --half eval --batch_size 1 --group_size 1 --repeats 2 \
      --phase_methods ar,priced_default,learned_default,learned_fixed
"""
import collections
import cProfile
import pstats
import time

from absl import app, flags
from benchmarks import controllers as C
FLAGS = flags.FLAGS

def main(_):
  methods = FLAGS.phase_methods
  setup = C.load_setup()
  target = C.decode_form(setup.target)
  costs, source, measured = C.controller_costs(target, setup.drafter, setup.max_len)
  E = C.build_engines(methods, setup, target, costs, source, measured)
  engines, size, forced = E[0], E[2], E[3]
  prompts = setup.prompts
  G = FLAGS.group_size
  groups = [prompts[i:i + G] for i in range(0, len(prompts), G)]
  C.precompile(engines, methods, size, prompts)
  C.warm_up(engines, methods, groups[:1], size, forced, G)
  tot = {m: collections.Counter() for m in methods}
  last = {m: collections.Counter() for m in methods}  # the last repeat alone (first runs done)
  profs = {m: cProfile.Profile() for m in methods}
  for rep in range(FLAGS.repeats):
    for i, group in enumerate(groups):
      for m in C.method_order(methods, i + rep):
        eng = engines[m]
        prof = profs[m] if FLAGS.profile_host else None
        t0 = time.perf_counter()
        if prof: prof.enable()
        gens = C.decode_group(eng, group, size[m], i * G, forced[m])
        if prof: prof.disable()
        wall = time.perf_counter() - t0
        dec = sum(g.decode_s for g in gens)
        pre = sum(g.prefill_s for g in gens)
        for t in (tot[m], last[m]) if rep == FLAGS.repeats - 1 else (tot[m],):
          t["wall"] += wall; t["decode"] += dec; t["prefill"] += pre
          t["other"] += wall - dec - pre
          t["requests"] += len(gens)
  for title, split in (("every repeat", tot), ("the last repeat", last)):
    print(title)
    for m in methods:
      t = split[m]; n = t["requests"]
      print(f"{m:16s} wall {t['wall']:.3f}  decode {t['decode']:.3f}  prefill+insert {t['prefill']:.3f} "
            f"({1e3*t['prefill']/n:.2f} ms/request)  other {t['other']:.3f} ({1e3*t['other']/n:.2f} ms/request)")

  if FLAGS.profile_host:
    for m in methods[:2]:
      print("=====", m)
      st = pstats.Stats(profs[m]); st.sort_stats("tottime"); st.print_stats(25)
      st.sort_stats("cumulative"); st.print_stats(r"scheduler|engine|online_costs|start_backoff|programs|compiled", 40)

flags.DEFINE_list("phase_methods", ["ar", "learned_default", "ar_twin"],
                  "the methods to split (the benchmark's names; the first two are profiled)")
flags.DEFINE_bool("profile_host", False, "cProfile each method's timed calls")

if __name__ == "__main__":
  app.run(main)
