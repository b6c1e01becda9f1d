"""Drafter quality of a target + DFlash drafter on a prompt set (the demo's quality bar, issue 4).

  python -m benchmarks.drafter_quality                       # the shipped demo on HumanEval
  python -m benchmarks.drafter_quality --num_prompts 40 --out out/drafter_quality

In one process, on the same prompts and weights (128 new tokens each by default):
  * our AR decode at T=0 (the baseline of every speedup);
  * speculative decoding at the drafter's training block size b at T=0: tau, tokens/s, speedup
    over AR, and a check that every output is token-identical to AR; also with the demo's AR
    fallback steps after poor cycles (--ar_fallback, as decode.py's --config.ar_fallback);
  * tau per block size b-4 .. b+4 at T=0 and at T=1 (same seeds per prompt);
  * PNGs: the acceptance-length histogram at b (T=0) and tau by block size (T=0 and T=1).
Figures have decode.py's names and meanings (`bp_jax.eval.report.acceptance_figures`): `tau` is
the mean over prompts of each request's committed tokens per speculative cycle (draft + verify),
`tau_pooled_over_cycles` the same over all cycles, `tokens_per_forward` the mean over prompts of
committed tokens per target forward (with the fallback its AR steps count there, not in tau).
AR and spec at b run alternately prompt by prompt, twice each, keeping the faster of the two,
so that a load change on the machine hits both alike. Writes `<out>/drafter_quality.json`.
"""

from __future__ import annotations

import json
import os
import time

from absl import flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.engine import Engine
from bp_jax.eval.plots import acceptance_histogram, line_plot
from bp_jax.eval.report import acceptance_figures
from bp_jax.text.prompts import load_prompts
from bp_jax.decode_job.block_choice import default_block_sizes
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.text.tokenizer import encode_prompt

common.define_flags("target", "drafter", "num_prompts", "max_new_tokens", max_len=1024)
flags.DEFINE_string("prompts", "humaneval", "Prompt source (JSONL path, humaneval, pysrc:<dir>).")
flags.DEFINE_integer("sweep_prompts", 40, "Prompts for the per-block-size sweeps (0 = all).")
flags.DEFINE_integer("seed", 0, "Sampling seed of prompt i is seed + i (T=1 sweep).")
flags.DEFINE_string("out", "out/drafter_quality", "Output folder (JSON and PNGs).")
flags.DEFINE_integer("ar_fallback", 16, "AR steps after poor cycles, at most (the demo's "
                     "--config.ar_fallback); 0 = off. With > 0 the main comparison also runs "
                     "spec without it.")
FLAGS = flags.FLAGS


def _decode(engine, ids, block_size, temperature=0.0, seed=0):
  return engine.generate(ids, max_new_tokens=FLAGS.max_new_tokens, block_size=block_size,
                         temperature=temperature, seed=seed)


def _figures(gens) -> dict:
  """τ (per speculative cycle) and tokens per target forward of `gens`, rounded."""
  runs = [{"acceptance_lengths": g.acceptance_lengths, "forward_lengths": g.forward_lengths}
          for g in gens]
  return {k: round(v, 3) if isinstance(v, float) else v
          for k, v in acceptance_figures(runs).items()}


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  target, drafter, tok, stop_ids = common.load_models(FLAGS)
  b = drafter.cfg.block_size
  sweep = default_block_sizes(b)
  # The paper's loop (AR, every spec size, the sweeps) and, on the same weights, the demo's loop
  # with AR fallback steps at b.
  engine = Engine(target, stop_ids=stop_ids, drafter=drafter,
                  shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=(1,) + sweep))
  fallback = (Engine(target, stop_ids=stop_ids, drafter=drafter,
                     shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=(b,)),
                     loop=LoopOptions(ar_fallback=FLAGS.ar_fallback))
              if FLAGS.ar_fallback else None)
  prompts = load_prompts(FLAGS.prompts, FLAGS.num_prompts or None)
  encoded = [encode_prompt(tok, p.text, False) for p in prompts]
  t0 = time.perf_counter()
  comp = engine.precompile((1,) + sweep)
  compile_s = time.perf_counter() - t0
  if fallback is not None:
    fallback.precompile((b,))

  # Main comparison: AR vs spec at b, T=0, alternating per prompt, best of two runs each.
  ar_s = spec_s = fb_s = 0.0
  new_tokens, spec_runs, fb_runs, mismatches = 0, [], [], []
  for p, ids in tqdm(list(zip(prompts, encoded)), desc=f"AR vs spec b={b}", unit="prompt"):
    ar = [_decode(engine, ids, 1) for _ in range(2)]
    sp = [_decode(engine, ids, b) for _ in range(2)]
    fb = [_decode(fallback, ids, b) for _ in range(2)] if fallback is not None else sp
    if sp[0].output_ids != ar[0].output_ids or fb[0].output_ids != ar[0].output_ids:
      mismatches.append(p.id)
    ar_s += min(g.decode_s for g in ar)
    spec_s += min(g.decode_s for g in sp)
    fb_s += min(g.decode_s for g in fb)
    new_tokens += ar[0].new_tokens
    spec_runs.append(sp[0])
    fb_runs.append(fb[0])
  accepts = [a for g in spec_runs for a in g.acceptance_lengths]
  main = {"prompts": len(prompts), "new_tokens": new_tokens,
          "ar_tokens_per_s": round(new_tokens / ar_s, 1),
          "spec_tokens_per_s": round(new_tokens / spec_s, 1),
          "speedup": round(ar_s / spec_s, 3), **_figures(spec_runs),
          "with_ar_fallback": {"ar_fallback": FLAGS.ar_fallback,
                               "tokens_per_s": round(new_tokens / fb_s, 1),
                               "speedup": round(ar_s / fb_s, 3), **_figures(fb_runs),
                               "target_forwards": sum(g.target_forwards for g in fb_runs)},
          "identical_to_ar": not mismatches, "mismatched_prompts": mismatches}

  # Sweeps: tau per block size at T=0 and T=1 (the paper's loop: every forward is a cycle).
  n_sweep = FLAGS.sweep_prompts or len(encoded)
  taus: dict[str, dict[int, float]] = {}
  pooled: dict[str, dict[int, float]] = {}
  for temperature in (0.0, 1.0):
    row, row_pooled = {}, {}
    for size in tqdm(sweep, desc=f"tau by block size, T={temperature:g}", unit="size"):
      gens = [_decode(engine, ids, size, temperature, FLAGS.seed + i)
              for i, ids in enumerate(encoded[:n_sweep])]
      figures = _figures(gens)
      row[size], row_pooled[size] = figures["tau"], figures["tau_pooled_over_cycles"]
    taus[f"T={temperature:g}"], pooled[f"T={temperature:g}"] = row, row_pooled

  hist = acceptance_histogram(accepts, os.path.join(FLAGS.out, "acceptance_hist.png"),
                              title=f"{FLAGS.prompts}, b={b}, T=0")
  plot = line_plot({name: (list(row), list(row.values())) for name, row in taus.items()},
                   os.path.join(FLAGS.out, "tau_by_block_size.png"), "block size",
                   "τ (committed tokens per speculative cycle)",
                   f"τ by block size ({n_sweep} prompts of {FLAGS.prompts})")
  result = {"target": FLAGS.target, "drafter": FLAGS.drafter, "block_size": b,
            "max_new_tokens": FLAGS.max_new_tokens, "max_len": FLAGS.max_len,
            "main_T0": main, "sweep_prompts": n_sweep, "tau_by_block_size": taus,
            "tau_pooled_over_cycles_by_block_size": pooled,
            "compile_s": round(compile_s, 2), "compilations": comp["compilations"],
            "plots": [hist, plot]}
  common.write_json(os.path.join(FLAGS.out, "drafter_quality.json"), result)
  print(json.dumps({k: v for k, v in result.items() if k != "plots"}, indent=2))


if __name__ == "__main__":
  cli.run(main, __doc__)
