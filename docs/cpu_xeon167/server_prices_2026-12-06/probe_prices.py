"""Every loop call of one trace with its seconds and what the simulated clock charged, and the
start rule's inputs after the warm-up and after the trace (stop 77's probe; README)."""
from absl import flags
from benchmarks import arrivals, controllers
from bp_jax import cli
FLAGS = flags.FLAGS
flags.DEFINE_float("load", 2.0, "the trace's load (mean requests in flight at 128 AR steps each)")


def dump(eng, label):
  print(label, eng.start_choice(8))
  print(" estimate", eng.cost_estimate["by_batch_size"])


def main(_):
  engines, size, _, prompts = arrivals.served_engines(controllers.parse_methods(FLAGS.methods))[:4]
  eng = engines["priced_default"]
  clock = eng.clock
  dump(eng, "after warm-up")
  rate = FLAGS.load / (FLAGS.max_new_tokens * FLAGS.sim_clock_ms * 1e-3)
  eng.call_log = []
  run = arrivals.serve_trace(eng, prompts, arrivals.arrival_times(len(prompts), rate, 0),
                             size["priced_default"], None)
  dump(eng, "after trace")
  for c in eng.call_log:
    charge = sum(clock.price_s(n) * k for n, k in enumerate(c.forwards_N) if k)
    print("trace", c.block_size, c.rows, "end %.3f secs %.4f charge %.4f ratio %.3f" % (
        c.end_s, c.seconds, charge, c.seconds / charge if charge else 0),
        {n: k for n, k in enumerate(c.forwards_N) if k}, c.break_even, c.start_break_even)
  print("routes", "".join("p" if s.generation.plain_start else "m" if s.generation.moved_plain
                          else "d" for s in run.served))


cli.run(main)
