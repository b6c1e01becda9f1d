"""How often bfloat16 speculative decoding leaves AR's greedy output, and whether every place it
does is a near-tie of the target's two best logits (docs/design.md §12).

  python -m benchmarks.bf16_agreement                        # bf16 and f32, 82 held-out prompts
  python -m benchmarks.bf16_agreement --num_prompts 10 --dtypes bfloat16

Per dtype (--dtypes), on the demo's held-out HumanEval prompts (the BlockPilot evaluation half,
as benchmarks/sampling_modes.py) and with matmuls at --matmul_precision: every prompt is decoded
greedily with AR (block size 1) and speculatively at --block_size (verify=exact, no AR fallback:
every speculative token comes from a verify pass), and the outputs are compared. At each first
divergence the logits behind both tokens are recomputed by replaying the request's forwards with
the engine's shapes (`bp_jax.eval.exactness.ForwardReplay`): the AR step's (1 token) and the
verify pass's (b tokens); reported: the AR step's gap logit[AR token] - logit[spec token], its
top-1 minus top-2 gap, the verify pass's gaps, and the tolerance K * eps_bf16 * max|logits|.
Over every prompt's common prefix: the largest difference between the two shapes' logits, also
relative to the logits' size (the perturbation that causes the flips).
Writes <out>/bf16_agreement.json and <out>/bf16_agreement.md.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.eval import exactness as ex
from bp_jax.models.precision import MATMUL_PRECISIONS, matmul_precision
from bp_jax.text.tokenizer import load_tokenizer

common.define_flags("target", "drafter", "block_size", "num_prompts", "max_new_tokens", "max_len")
flags.DEFINE_string("dtypes", "bfloat16,float32", "Comma-separated dtypes the weights are loaded "
                    "in (--config.dtype values); each is measured on its own.")
flags.DEFINE_enum("matmul_precision", "highest", list(MATMUL_PRECISIONS),
                  "JAX's matmul precision (--config.matmul_precision).")
flags.DEFINE_float("tolerance_k", ex.GAP_TOLERANCE_K, "K of the near-tie tolerance "
                   "K * eps_bf16 * max|logits| at a divergence.")
flags.DEFINE_bool("logit_stats", True, "Also replay every prompt (not only divergent ones) to "
                  "measure the largest AR-step vs verify-pass logit difference.")
flags.DEFINE_string("out", "docs/exactness", "Output folder (JSON and Markdown).")
FLAGS = flags.FLAGS


def measure(dtype: str, prompts) -> dict:
  """Decodes `prompts` with AR and speculatively in `dtype`; divergences and logit differences."""
  target, drafter, _, stop_ids = common.load_models(FLAGS, dtype=dtype)
  b = FLAGS.block_size
  eng = Engine(target, stop_ids=stop_ids, drafter=drafter,
               shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=(b,)),
               loop=LoopOptions(verify="exact", ar_fallback=0))
  replay = ex.ForwardReplay(eng)
  divs, rel_diffs, abs_diffs, identical, t0 = [], [], [], 0, time.perf_counter()
  agree = [0, 0]  # replayed argmaxes equal to the committed tokens, rows compared
  for key, ids in tqdm(prompts, desc=dtype, unit="prompt"):
    ar = eng.generate(ids, max_new_tokens=FLAGS.max_new_tokens, block_size=1)
    sp = eng.generate(ids, max_new_tokens=FLAGS.max_new_tokens, block_size=b)
    j = ex.first_divergence(ar.output_ids, sp.output_ids)
    identical += j is None
    if j is None and not FLAGS.logit_stats:
      continue
    upto = min(len(ar.output_ids), len(sp.output_ids)) - 1 if j is None else j
    la = replay.logits(ids, ar.output_ids, ex.forward_schedule(ar, 1), upto)
    lv = replay.logits(ids, sp.output_ids, ex.forward_schedule(sp, b), upto)
    # Replay fidelity: the replayed argmax is the committed token (rows before the divergence).
    agree[0] += int((la[:upto].argmax(-1) == ar.output_ids[:upto]).sum()
                    + (lv[:upto].argmax(-1) == sp.output_ids[:upto]).sum())
    agree[1] += 2 * upto
    diff = np.abs(la.astype(np.float64) - lv).max(-1)       # per position
    scale = np.abs(la.astype(np.float64)).max(-1)
    abs_diffs.append(float(diff.max()))
    rel_diffs.append(float((diff / scale).max()))
    if j is not None:
      divs.append(ex.divergence_at(key, j, ar.output_ids, sp.output_ids, la[j], lv[j],
                                   k=FLAGS.tolerance_k))
  violations = ex.check_divergences(divs)
  eps = ex.BF16_EPS
  return {
      "dtype": dtype, "prompts": len(prompts), "identical": identical, "divergent": len(divs),
      "near_ties": sum(d.near_tie for d in divs), "violations": violations,
      "replays_agree": sum(d.replay_agrees for d in divs),
      "replay_rows_agree": agree[0], "replay_rows": agree[1],
      "max_ar_gap": max((d.ar_gap for d in divs), default=None),
      "max_ar_gap_in_eps_scale": max((d.ar_gap / (eps * d.logit_scale) for d in divs),
                                     default=None),
      "logit_diff": None if not abs_diffs else {
          "prompts": len(abs_diffs), "max_abs": max(abs_diffs),
          "median_abs": float(np.median(abs_diffs)), "max_rel_to_max_logit": max(rel_diffs),
          "max_in_eps_scale": max(rel_diffs) / eps},
      "divergences": [{**vars(d), "near_tie": d.near_tie} for d in divs],
      "wall_s": round(time.perf_counter() - t0, 1)}


def _write_markdown(report: dict, path: str) -> None:
  eps = report["bf16_eps"]
  lines = [f"# Speculative vs AR greedy output by dtype ({report['prompts']} held-out prompts)",
           "", f"Demo target + drafter, b={report['block_size']}, verify=exact, no AR fallback, "
           f"{report['max_new_tokens']} new tokens, matmul_precision="
           f"{report['matmul_precision']}, backend {report['jax_backend']} "
           f"({report['machine']}). Near-tie tolerance on the AR step's gap "
           f"logit[AR token] - logit[spec token]: {report['tolerance_k']:g} x eps_bf16 "
           f"({eps:g}) x max|logits|. Logits are recomputed by replaying each request's "
           "forwards with the engine's shapes; replayed argmax = committed token on "
           + ", ".join(f"{r['replay_rows_agree']}/{r['replay_rows']} ({r['dtype']})"
                       for r in report["by_dtype"].values()) + " rows.", "",
           "| dtype | identical | divergent | near-ties | max AR gap "
           "| max AR gap / (eps max \\|l\\|) | max \\|l_AR - l_verify\\| "
           "| same / (eps max \\|l\\|) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  f = lambda x: "-" if x is None else f"{x:.3g}"
  for r in report["by_dtype"].values():
    ld = r["logit_diff"] or {}
    lines.append(f"| {r['dtype']} | {r['identical']}/{r['prompts']} | {r['divergent']} | "
                 f"{r['near_ties']}/{r['divergent']} | {f(r['max_ar_gap'])} | "
                 f"{f(r['max_ar_gap_in_eps_scale'])} | {f(ld.get('max_abs'))} | "
                 f"{f(ld.get('max_in_eps_scale'))} |")
  for r in report["by_dtype"].values():
    if r["divergences"]:
      lines += ["", f"## First divergences, {r['dtype']}", "",
                "| prompt | index | AR / spec token | AR gap | AR top1-top2 | verify gap | "
                "verify top1-top2 | max \\|l\\| | tolerance | near-tie |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
      for d in r["divergences"]:
        lines.append(f"| {d['prompt']} | {d['index']} | {d['ar_token']} / {d['spec_token']} | "
                     f"{d['ar_gap']:.4g} | {d['ar_top2_gap']:.4g} | {d['verify_gap']:.4g} | "
                     f"{d['verify_top2_gap']:.4g} | {d['logit_scale']:.3g} | "
                     f"{d['tolerance']:.3g} | {d['near_tie']} |")
  lines.append("")
  common.write_text(path, "\n".join(lines))


def main(argv):
  del argv
  prompts = common.demo_prompts(load_tokenizer(FLAGS.target), "eval", limit=FLAGS.num_prompts)
  report = {"prompts": len(prompts), "block_size": FLAGS.block_size,
            "max_new_tokens": FLAGS.max_new_tokens, "matmul_precision": FLAGS.matmul_precision,
            "tolerance_k": FLAGS.tolerance_k, "bf16_eps": ex.BF16_EPS,
            "machine": os.uname().machine, "cpu_count": os.cpu_count(),
            "jax_backend": jax.default_backend(), "jax_version": jax.__version__,
            "command": common.command_line(), "by_dtype": {}}
  with matmul_precision(FLAGS.matmul_precision):
    for dtype in filter(None, FLAGS.dtypes.split(",")):
      r = measure(dtype, prompts)
      report["by_dtype"][dtype] = r
      print(json.dumps({k: v for k, v in r.items() if k != "divergences"}, indent=1), flush=True)
  common.write_json(os.path.join(FLAGS.out, "bf16_agreement.json"), report)
  _write_markdown(report, os.path.join(FLAGS.out, "bf16_agreement.md"))
  print(f"wrote {FLAGS.out}/bf16_agreement.json, .md")


if __name__ == "__main__":
  cli.run(main, __doc__)
