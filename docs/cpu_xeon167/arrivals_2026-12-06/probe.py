from absl import flags
from benchmarks import arrivals, controllers
from bp_jax import cli
from bp_jax.decoding.engine import decode_form
FLAGS = flags.FLAGS
def main(_):
  methods = controllers.parse_methods(FLAGS.methods)
  setup = controllers.load_setup()
  target, prompts = decode_form(setup.target), setup.prompts
  costs, source, measured = controllers.controller_costs(target, setup.drafter, setup.max_len)
  engines, _, size, forced, _ = controllers.build_engines(methods, setup, target, costs, source, measured)
  eng = engines["priced_default"]
  B = FLAGS.batch_size
  print("before warm-up", eng.start_choice(8))
  controllers.warm_up(engines, methods, [prompts[:B]], size, forced, B)
  print("after warm-up", eng.start_choice(8), eng.cost_estimate["by_batch_size"])
  arr = arrivals.arrival_times(len(prompts), 2 / (128 * FLAGS.sim_clock_ms * 1e-3), 0)
  run = arrivals.serve_trace(eng, prompts, arr, size["priced_default"], None)
  print("after trace", eng.start_choice(8), eng.cost_estimate["by_batch_size"])
  print("routes", "".join("p" if s.generation.plain_start else "m" if s.generation.moved_plain else "d" for s in run.served))
cli.run(main)
