from absl import flags
from benchmarks import arrivals, controllers
from bp_jax import cli
FLAGS = flags.FLAGS
def main(_):
  engines, size, _, prompts = arrivals.served_engines(controllers.parse_methods(FLAGS.methods))[:4]
  eng = engines["priced_default"]
  print("after warm-up", eng.start_choice(8), eng.cost_estimate["by_batch_size"])
  arr = arrivals.arrival_times(len(prompts), 2 / (128 * FLAGS.sim_clock_ms * 1e-3), 0)
  run = arrivals.serve_trace(eng, prompts, arr, size["priced_default"], None)
  print("after trace", eng.start_choice(8), eng.cost_estimate["by_batch_size"])
  print("routes", "".join("p" if s.generation.plain_start else "m" if s.generation.moved_plain else "d" for s in run.served))
cli.run(main)
