"""Speculative decoding at T > 0: `exact` vs `rejection` verify, for one or more drafters, on the
demo's held-out HumanEval prompts (the BlockPilot evaluation half, never labelled on).

  python -m benchmarks.sampling_modes                   # both shipped demo drafters, 82 prompts
  python -m benchmarks.sampling_modes --num_prompts 20 --temperatures 1.0 --repeats 1

In one process, on the same prompts, weights and seeds (prompt i: seed + i):
  * per temperature (--temperatures, plus T=0 as a check): our AR decode and, for every
    (drafter, verify mode), speculative decoding at b (the paper's loop, no AR fallback unless
    --ar_fallback), all interleaved per prompt in a shuffled order, --repeats times each with the
    fastest time kept. Figures (decode.py's names): tau = mean over prompts of committed tokens
    per speculative cycle; tokens/s = all new tokens / all decode time; speedup over AR from the
    same run. At T = 0 every output must equal AR's (checked).
  * teacher-forced per-position acceptance of each drafter on the target's own sampled
    continuations (the AR outputs at that temperature): at every response position as anchor,
    p_k = the target's processed distribution at block position k after the true prefix and q_k
    the drafter's: 1 - TV(p_k, q_k) (rejection sampling's acceptance of position k) and
    p_k(argmax q_k) (the `exact` rule's), means over anchors, k = 1..b-1.
Writes <out>/sampling_modes.json, <out>/sampling_modes.md and <out>/acceptance_by_position.png.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.sampling import processed_logits, sampling_params
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.eval.plots import line_plot
from bp_jax.eval.report import acceptance_figures
from bp_jax.train import draft_objective as obj
from bp_jax.weights.loading import load_drafter

common.define_flags("target", "block_size", "num_prompts", "max_new_tokens", "max_len", "repeats")
flags.DEFINE_string("drafters", "ce=demo/drafter,mix=demo/drafter_sampling",
                    "Comma-separated drafter folders, each optionally named: name=folder.")
flags.DEFINE_string("modes", "exact,rejection", "Verify modes to compare (--config.verify).")
flags.DEFINE_string("temperatures", "0.6,1.0", "Temperatures > 0 to compare at (T=0 is run "
                    "too, as a losslessness check).")
flags.DEFINE_integer("ar_fallback", 0, "AR fallback steps after poor cycles (0 = the paper's "
                     "loop).")
flags.DEFINE_integer("seed", 0, "Seed of prompt i is seed + i.")
flags.DEFINE_string("out", "out/sampling_modes", "Output folder (JSON, Markdown, PNG).")
FLAGS = flags.FLAGS


def _drafter_paths(spec: str) -> dict[str, str]:
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, _, path = item.rpartition("=")
    out[name or path] = path
  return out


def _positional_acceptance(target, drafter, seqs, temperature: float, b: int) -> dict:
  """Teacher-forced per-position acceptance (see the module docstring) over `seqs`: a list of
  (prompt ids, continuation ids)."""
  sp = sampling_params(temperature)
  layer_ids = drafter.cfg.target_layer_ids

  @jax.jit
  def one(tokens_1T, anchors_1A, valid_1A):
    T = tokens_1T.shape[1]
    at = obj.soft_target_positions(anchors_1A, b, T)
    hid, t_logits = obj.target_pass(target, tokens_1T, layer_ids, at)
    blocks, _, _ = obj.build_blocks(tokens_1T, anchors_1A, b, drafter.cfg.mask_token_id)
    h = obj.drafter_train_forward(drafter, hid, target.embed_tokens(blocks), anchors_1A, valid_1A)
    q_logits = obj.block_logits(target, h)[0]                  # [A, k, V]
    t_logits = t_logits.reshape(q_logits.shape)
    _, tv = obj.distribution_gaps(q_logits, t_logits, temperature)  # the training metric's TV
    tv_accept = 1.0 - tv                                            # [A, k]
    p = jax.nn.softmax(processed_logits(t_logits, sp), axis=-1)
    argmax_accept = jnp.take_along_axis(p, jnp.argmax(q_logits, -1)[..., None], -1)[..., 0]
    return tv_accept, argmax_accept

  tv_sum, am_sum, n = np.zeros(b - 1), np.zeros(b - 1), 0
  for prompt, cont in seqs:
    toks = list(prompt) + list(cont)
    lo, hi = len(prompt), len(toks) - b  # anchors with a full block of real tokens after them
    if hi < lo:
      continue
    T = 1 << (len(toks) - 1).bit_length()  # few compiled shapes
    A = 1 << (hi - lo).bit_length()
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(toks)] = toks
    anchors = np.zeros((1, A), np.int32)
    anchors[0, :hi - lo + 1] = np.arange(lo, hi + 1)
    valid = np.arange(A)[None] <= hi - lo
    tv, am = one(jnp.asarray(tokens), jnp.asarray(anchors), jnp.asarray(valid))
    tv_sum += np.asarray(tv)[valid[0]].sum(0)
    am_sum += np.asarray(am)[valid[0]].sum(0)
    n += int(valid.sum())
  return {"anchors": n, "tv_acceptance": [round(float(x), 4) for x in tv_sum / max(n, 1)],
          "argmax_acceptance": [round(float(x), 4) for x in am_sum / max(n, 1)]}


def main(argv):
  del argv
  os.makedirs(FLAGS.out, exist_ok=True)
  target, _, tok, stop_ids = common.load_models(FLAGS, drafter=False)
  b = FLAGS.block_size
  modes = [m for m in FLAGS.modes.split(",") if m]
  temps = [float(t) for t in FLAGS.temperatures.split(",") if t]
  drafters = {name: load_drafter(path, target.cfg, "float32")
              for name, path in _drafter_paths(FLAGS.drafters).items()}
  engines = {(name, mode): Engine(target, stop_ids=stop_ids, drafter=d,
                                  shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=(b,)),
                                  loop=LoopOptions(verify=mode, ar_fallback=FLAGS.ar_fallback))
             for name, d in drafters.items() for mode in modes}
  ar_engine = next(iter(engines.values()))
  prompts = common.demo_prompts(tok, "eval", limit=FLAGS.num_prompts)
  methods = ["AR"] + [f"{name} {mode}" for name, mode in engines]
  report = {"block_size": b, "ar_fallback": FLAGS.ar_fallback, "prompts": len(prompts),
            "max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats,
            "drafters": _drafter_paths(FLAGS.drafters), "machine": os.uname().machine,
            "jax_backend": jax.default_backend(), "by_temperature": {}}
  for temp in [0.0] + temps:
    runs = {m: [] for m in methods}
    for i, (key, ids) in enumerate(tqdm(prompts, desc=f"T={temp:g}", unit="prompt")):
      best = {}
      for r in range(FLAGS.repeats):
        for k in np.random.default_rng([i, r, int(temp * 1000)]).permutation(len(methods)):
          m = methods[k]
          eng = ar_engine if m == "AR" else engines[tuple(m.split(" "))]
          g = eng.generate(ids, max_new_tokens=FLAGS.max_new_tokens, temperature=temp,
                           seed=FLAGS.seed + i, block_size=1 if m == "AR" else b)
          if m not in best or g.decode_s < best[m].decode_s:
            best[m] = g
      for m in methods:
        runs[m].append(best[m])
    ar_tok_s = sum(g.new_tokens for g in runs["AR"]) / sum(g.decode_s for g in runs["AR"])
    rows = {}
    for m in methods:
      gens = runs[m]
      tok_s = sum(g.new_tokens for g in gens) / sum(g.decode_s for g in gens)
      figs = acceptance_figures([{"acceptance_lengths": g.acceptance_lengths,
                                  "forward_lengths": g.forward_lengths} for g in gens])
      rows[m] = {"tau": round(figs["tau"], 3) if m != "AR" else 1.0,
                 "tokens_per_forward": round(figs["tokens_per_forward"], 3),
                 "tokens_per_s": round(tok_s, 1), "speedup_vs_ar": round(tok_s / ar_tok_s, 3),
                 "new_tokens": sum(g.new_tokens for g in gens)}
      if temp == 0:
        rows[m]["identical_to_ar"] = all(g.output_ids == a.output_ids
                                         for g, a in zip(gens, runs["AR"]))
    entry = {"methods": rows}
    if temp > 0:
      seqs = [(ids, g.output_ids) for (_, ids), g in zip(prompts, runs["AR"])]
      entry["per_position"] = {name: _positional_acceptance(target, d, seqs, temp, b)
                               for name, d in drafters.items()}
    report["by_temperature"][f"{temp:g}"] = entry
    print(json.dumps({f"T={temp:g}": rows}, indent=1), flush=True)
  common.write_json(os.path.join(FLAGS.out, "sampling_modes.json"), report)
  _write_markdown(report, os.path.join(FLAGS.out, "sampling_modes.md"))
  series = {}
  for temp, entry in report["by_temperature"].items():
    for name, pp in entry.get("per_position", {}).items():
      ks = list(range(1, b))
      series[f"{name} 1-TV T={temp}"] = (ks, pp["tv_acceptance"])
      series[f"{name} p(argmax q) T={temp}"] = (ks, pp["argmax_acceptance"])
  if series:
    line_plot(series, os.path.join(FLAGS.out, "acceptance_by_position.png"),
              xlabel="block position k", ylabel="acceptance probability (teacher-forced)",
              title="Per-position acceptance: rejection (1-TV) vs exact (p(argmax q))")
  print(f"wrote {FLAGS.out}/sampling_modes.json, .md, acceptance_by_position.png")


def _write_markdown(report: dict, path: str) -> None:
  lines = [f"# Sampling modes on {report['prompts']} held-out HumanEval prompts", "",
           f"b={report['block_size']}, AR fallback {report['ar_fallback']}, "
           f"{report['max_new_tokens']} new tokens, fastest of {report['repeats']} interleaved "
           f"runs; backend {report['jax_backend']}. τ = committed tokens per speculative "
           "cycle (mean over requests); tokens per forward counts every target forward.", ""]
  for temp, entry in report["by_temperature"].items():
    lines += [f"## T={temp}", "", "| method | τ per cycle | tokens per forward | tokens/s | "
              "speedup vs AR |" + (" identical to AR |" if temp == "0" else ""),
              "|---|---:|---:|---:|---:|" + ("---|" if temp == "0" else "")]
    for m, r in entry["methods"].items():
      lines.append(f"| {m} | {r['tau']:.3f} | {r['tokens_per_forward']:.3f} | "
                   f"{r['tokens_per_s']:.1f} | {r['speedup_vs_ar']:.3f}x |"
                   + (f" {r['identical_to_ar']} |" if temp == "0" else ""))
    for name, pp in entry.get("per_position", {}).items():
      lines += ["", f"Teacher-forced acceptance by block position k=1..{report['block_size'] - 1}"
                f" ({name}, {pp['anchors']} anchors): 1 - TV {pp['tv_acceptance']}; "
                f"p(argmax q) {pp['argmax_acceptance']}"]
    lines.append("")
  common.write_text(path, "\n".join(lines))


if __name__ == "__main__":
  cli.run(main, __doc__)
