"""Per request: cycles, AR steps, declined, latency; per call: bucket, rows, sim seconds (stop 78)."""
import collections
import numpy as np
from absl import flags
from benchmarks import arrivals, controllers
from bp_jax import cli
from bp_jax.decoding import scheduler as S
FLAGS = flags.FLAGS
flags.DEFINE_string("loads_probe", "2", "loads")
CALLS = []
orig = S.Scheduler._run_one
def run_one(self):
  live = {b: sum(1 for s in k.rows if s is not None) for b, k in self.buckets.items() if k.live()}
  t = self.engine.clock()
  orig(self)
  CALLS.append((self._report.ran, live.get(self._report.ran, 0), len(live), self.engine.clock() - t))
S.Scheduler._run_one = run_one
def main(_):
  methods = controllers.parse_methods(FLAGS.methods)
  engines, size, forced, prompts = arrivals.served_engines(methods)[:4]
  for load in [float(x) for x in FLAGS.loads_probe.split(",")]:
    arr = arrivals.arrival_times(len(prompts), load / (FLAGS.max_new_tokens * FLAGS.sim_clock_ms * 1e-3), FLAGS.arrival_seed)
    runs = {}
    for m in methods:
      CALLS.clear()
      run = arrivals.serve_trace(engines[m], prompts, arr, size[m], None)
      runs[m] = run
      lat = np.array([s.latency_s for s in run.served])
      g = [s.generation for s in run.served]
      by = collections.defaultdict(lambda: [0, 0.0])
      for b, rows, nb, dt in CALLS:
        k = (b, rows, nb); by[k][0] += 1; by[k][1] += dt
      print(f"load {load} {m}: mean {lat.mean():.4f} calls {len(CALLS)} sim s {sum(c[3] for c in CALLS):.3f}")
      print("  cycles %d ar_steps %d verified0 %d moved %d" % (sum(x.cycles for x in g), sum(x.ar_steps for x in g),
            sum(1 for x in g for v, c in zip(x.forward_verified, x.forward_is_cycle) if c and v == 0), sum(x.moved_plain for x in g)))
      tab = collections.defaultdict(lambda: [0, 0.0])
      for (b, rows, nb), (n, s) in by.items():
        tab[(b, nb)][0] += n; tab[(b, nb)][1] += s
      for k in sorted(tab, key=str):
        print("   bucket %s buckets-live %d: %d calls %.3f s" % (k[0], k[1], tab[k][0], tab[k][1]))
      hist = collections.Counter(r for b, r, nb, dt in CALLS if b != 1)
      print("   spec rows/call", sorted(hist.items()))
    a, b = methods[-2], methods[-1]
    A = runs[a].served; B = runs[b].served
    print(" per request (%s vs %s): idx lat_a lat_b cyc_a cyc_b ar_a ar_b moved" % (a, b))
    worst = sorted(range(len(A)), key=lambda i: B[i].latency_s - A[i].latency_s)[:15]
    for i in worst:
      ga, gb = A[i].generation, B[i].generation
      print("  %2d %.3f %.3f %3d %3d %3d %3d %s %s" % (i, A[i].latency_s, B[i].latency_s, ga.cycles, gb.cycles, ga.ar_steps, gb.ar_steps, ga.moved_plain, ga.plain_start))
cli.run(main)
