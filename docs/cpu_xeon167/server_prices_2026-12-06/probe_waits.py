"""Which bucket each call ran, and what moved requests waited (stop 77 probe)."""
import numpy as np
from absl import flags
from benchmarks import arrivals, controllers
from bp_jax import cli
from bp_jax.decoding import scheduler as S
FLAGS = flags.FLAGS
flags.DEFINE_string("loads_probe", "2,4", "loads")
LOG = []
orig_run_one, orig_move = S.Scheduler._run_one, S.Scheduler._move_losing
def run_one(self):
  live = {b: [id(s) for s in k.rows if s is not None] for b, k in self.buckets.items() if k.live()}
  t = self.engine.clock()
  orig_run_one(self)
  LOG.append(("call", t, self._report.ran, {b: len(v) for b, v in live.items()}, live.get(self._report.ran, [])))
def move(self, b, bucket):
  before = [id(s) for s in bucket.rows if s is not None]
  orig_move(self, b, bucket)
  after = {id(s) for s in bucket.rows if s is not None}
  gone = [i for i in before if i not in after and any(s is not None and id(s) == i and s.moved_plain for s in self.buckets[1].rows)] if 1 in self.buckets else []
  if gone:
    LOG.append(("move", self.engine.clock(), b, len(before), gone))
S.Scheduler._run_one, S.Scheduler._move_losing = run_one, move
def main(_):
  engines, size, _, prompts = arrivals.served_engines(controllers.parse_methods(FLAGS.methods))[:4]
  eng = engines["priced_default"]
  for load in [float(x) for x in FLAGS.loads_probe.split(",")]:
    LOG.clear()
    arr = arrivals.arrival_times(len(prompts), load / (FLAGS.max_new_tokens * FLAGS.sim_clock_ms * 1e-3), 0)
    run = arrivals.serve_trace(eng, prompts, arr, size["priced_default"], None)
    lat = np.array([s.latency_s for s in run.served])
    print(f"load {load}: mean {lat.mean():.3f} p90 {np.percentile(lat,90):.3f}")
    moves = [e for e in LOG if e[0] == "move"]
    print(" moves", [(round(e[1],3), e[2], e[3], len(e[4])) for e in moves])
    for e in moves:
      t_move, ids = e[1], set(e[4])
      waited = 0; ran_plain = None
      for c in LOG:
        if c[0] == "call" and c[1] >= t_move:
          if c[2] == 1 and ids & set(c[4]):
            ran_plain = c[1]; break
          waited += 1
      print("  moved at %.3f: %d rows; %d calls of other buckets before its first plain call (%.3f s)" % (t_move, len(ids), waited, (ran_plain or t_move) - t_move))
    print(" ", "".join({1: "p"}.get(c[2], "s") for c in LOG if c[0] == "call"))
cli.run(main)
