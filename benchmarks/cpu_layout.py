"""Does storing weights [out, in] instead of [in, out] lower a multi-token forward's cost on
XLA:CPU? The demo target's matmul shapes, M = 1 and M = 8 rows, both layouts, one process,
interleaved, many repeats.

  python -m benchmarks.cpu_layout --rows 1,8 --reps 7

Each timing is one jitted `fori_loop` of `--iters` products (the weight a loop invariant, as in
the decode loops), median of `--reps`. Reported per layout: the sum over one forward's matmuls
(4 layers of q, k, v, o, gate, up, down, and the output projection) in microseconds, and the
M = 8 forward's matmul time in M = 1 forwards.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import flags

from bp_jax import cli

flags.DEFINE_list("rows", ["1", "8"], "Rows (tokens) per product.")
flags.DEFINE_integer("reps", 7, "Timed repeats per case (median).")
flags.DEFINE_integer("iters", 200, "Products per timed loop.")
flags.DEFINE_string("config", "demo/target/config.json", "A target config.json for the shapes.")
FLAGS = flags.FLAGS


def shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
  """name -> (in, out, count per forward) of the target's matmuls."""
  D, F = cfg["hidden_size"], cfg["intermediate_size"]
  H, N, K, L = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
      cfg["num_hidden_layers"]
  return {"q": (D, N * H, L), "k": (D, K * H, L), "v": (D, K * H, L), "o": (N * H, D, L),
          "gate": (D, F, L), "up": (D, F, L), "down": (F, D, L),
          "lm_head": (D, cfg["vocab_size"], 1)}


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  with open(FLAGS.config) as f:
    cfg = json.load(f)
  rows = [int(r) for r in FLAGS.rows]

  def looped(layout: str):
    eq = "md,do->mo" if layout == "in_out" else "md,od->mo"

    @jax.jit
    def run(x, w):
      def body(_, acc):
        return acc + jnp.einsum(eq, x + acc[:, :1], w)[:, :x.shape[1]].sum()
      return jax.lax.fori_loop(0, FLAGS.iters, body, jnp.zeros((x.shape[0], 1), jnp.float32))
    return run

  fns = {lay: looped(lay) for lay in ("in_out", "out_in")}
  times = {}
  cases = [(name, m, lay) for name in shapes(cfg) for m in rows for lay in fns]
  key = jax.random.key(0)
  data = {}
  for name, (i, o, _) in shapes(cfg).items():
    w = jax.random.normal(key, (i, o), jnp.float32)
    data[(name, "in_out")], data[(name, "out_in")] = w, jnp.asarray(w.T)
  for name, m, lay in cases:  # warm up (compile)
    x = jnp.ones((m, shapes(cfg)[name][0]), jnp.float32)
    jax.block_until_ready(fns[lay](x, data[(name, lay)]))
  for rep in range(FLAGS.reps):
    for name, m, lay in (cases if rep % 2 == 0 else cases[::-1]):
      x = jnp.ones((m, shapes(cfg)[name][0]), jnp.float32)
      t0 = time.perf_counter()
      jax.block_until_ready(fns[lay](x, data[(name, lay)]))
      times.setdefault((name, m, lay), []).append((time.perf_counter() - t0) / FLAGS.iters)
  med = {k: statistics.median(v) for k, v in times.items()}
  out = {"config": FLAGS.config, "iters": FLAGS.iters, "reps": FLAGS.reps, "per_matmul_us": {}}
  for (name, m, lay), s in sorted(med.items()):
    out["per_matmul_us"][f"{name}/M{m}/{lay}"] = round(1e6 * s, 2)
  for lay in fns:
    for m in rows:
      out[f"forward_matmuls_us/M{m}/{lay}"] = round(1e6 * sum(
          med[(name, m, lay)] * n for name, (_, _, n) in shapes(cfg).items()), 1)
    out[f"M{rows[-1]}_in_M{rows[0]}_forwards/{lay}"] = round(
        out[f"forward_matmuls_us/M{rows[-1]}/{lay}"] / out[f"forward_matmuls_us/M{rows[0]}/{lay}"],
        2)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  cli.run(main, __doc__)
