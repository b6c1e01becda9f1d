"""Block-size and verify-length choice on the demo, held-out prompts: every fixed size, the AR
back-off, learned per-request policies, the verify-length controller alone and with a policy,
against our own AR decode, and the per-cycle oracle (an upper bound, by replay).

  python -m benchmarks.block_choice                          # all 82 held-out prompts, 3 repeats
  python -m benchmarks.block_choice --num_prompts 16 --repeats 2 --sizes 8

In one process, on the same weights and prompts (the BlockPilot evaluation half of HumanEval,
never labelled on), T = 0, 128 new tokens: for every prompt and repeat, every method decodes it
once, the methods in a shuffled order (so slow phases of the machine hit them alike); each
(method, prompt) keeps its fastest repeat. Every output must equal the AR output (checked).

A method is `controller/size`: controller none (the paper's loop), backoff (the AR fallback,
--ar_fallback), confidence (the per-cycle verify-length controller) or priced (backoff whose
misses are the cycles committing fewer tokens than they cost AR steps); size a block size, or
`learned` (the --policy's choice) or `value` (the --value_policy's choice). Figures, one meaning
each:
  tokens/s          new tokens / (prefill + decode seconds), summed over the prompts
  decode tokens/s   new tokens / decode-loop seconds
  tau               mean over prompts of committed tokens per speculative cycle (the paper's)
  tokens/forward    committed tokens per target forward, pooled (cycles and AR steps)
  vs AR, vs static  ratio of tokens/s, with a 95% bootstrap interval over prompts (the same
                    resampled prompts for both methods); `static` = the best static size chosen
                    on the labelling set (--static_size, default: the value policy's)
  vs best fixed     against the fastest fixed size of this very run (chosen in hindsight)
The per-cycle oracle: teacher-forced replay of every prompt's greedy output at every candidate
size (`bp_jax.train.intra_request`), then the cheapest per-forward choice of size or AR step
under the cost table (--cost_table, from the labels stage); `share of the oracle's gain` =
(method's speedup over the static size - 1) / (the oracle's estimated speedup over the static
size under the same table - 1).

Writes <out>/block_choice.json, <out>/block_choice.md and <out>/block_choice.png.
"""

from __future__ import annotations

import json
import os
import random
import time

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.controller import load_calibration
from bp_jax.decoding.engine import LEARNED, Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.eval.bootstrap import bootstrap_speedup
from bp_jax.eval.plots import interval_bars
from bp_jax.policy.mlp import load_policy

common.define_flags("target", "drafter", "num_prompts", "max_new_tokens", "max_len", repeats=3)
flags.DEFINE_string("policy", "demo/policy", "Block-size policy, any head (size `learned`; "
                    "demo/policy is a priced head).")
flags.DEFINE_string("value_policy", "", "Value-head block-size policy (size `value`); '' = none.")
flags.DEFINE_string("methods", "", "Comma-separated controller/size methods; '' = AR, every "
                    "candidate size with backoff, none/8, backoff/learned, backoff/value, "
                    "confidence/8, confidence/learned, confidence/value (those with a policy).")
flags.DEFINE_string("sizes", "5,6,7,8,9,10,11", "Candidate block sizes (fixed methods, replay).")
flags.DEFINE_integer("static_size", 0, "The best static size chosen on the labelling set "
                     "(0 = the value policy's static size, else 8).")
flags.DEFINE_string("cost_table", "runs/demo/data/cost_table.json", "Cost table of the labels "
                    "stage (prices the per-cycle oracle); '' = no oracle.")
flags.DEFINE_integer("ar_fallback", 16, "Most AR steps of the back-off after poor cycles (and "
                     "after the confidence controller's declined cycles).")
flags.DEFINE_string("calibration", "demo/controller_calibration.json", "The confidence "
                    "controller's calibration table ('' = the drafter's raw probabilities).")
flags.DEFINE_string("controller_costs", "", "Confidence: relative costs of target forwards over "
                    "1, 2, 4, ... tokens ('' = measured here by the engine, bp_jax.decoding.costs; "
                    "give --controller_draft_cost with it).")
flags.DEFINE_float("controller_draft_cost", -1.0, "Confidence: one drafter pass in AR steps "
                   "(< 0 = measured here, with the verify costs).")
flags.DEFINE_bool("poor_miss", True, "Confidence: a cycle accepting <= 1 of more verified "
                  "drafts counts as declined too (--config.controller_poor_miss).")
flags.DEFINE_integer("seed", 0, "Seed of the method order and the bootstrap.")
flags.DEFINE_string("out", "out/block_choice", "Output folder (JSON, Markdown, PNG).")
FLAGS = flags.FLAGS

CONTROLLERS = ("none", "backoff", "confidence", "priced")


def parse_method(text: str, sizes: list[int], policies: dict) -> tuple[str, object]:
  """(controller, block size | LEARNED with a policy name) of 'controller/size' or 'ar'."""
  if text == "ar":
    return "none", 1
  controller, _, size = text.partition("/")
  if controller not in CONTROLLERS:
    raise app.UsageError(f"--methods: {text!r}: controller must be one of {CONTROLLERS}")
  if size in ("learned", "value"):
    if size not in policies:
      flag = "--policy" if size == "learned" else "--value_policy"
      raise app.UsageError(f"--methods: {text!r} needs {flag}")
    return controller, size
  if not size.isdigit() or int(size) < 2:
    raise app.UsageError(f"--methods: {text!r}: size must be a block size >= 2, learned or "
                         "value")
  if int(size) not in sizes:
    raise app.UsageError(f"--methods: {text!r}: size {size} is not in --sizes")
  return controller, int(size)


def default_methods(sizes: list[int], policies: dict) -> list[str]:
  out = ["ar"] + [f"backoff/{b}" for b in sizes] + ["none/8"]
  out += [f"backoff/{p}" for p in policies] + ["confidence/8"]
  out += [f"confidence/{p}" for p in policies]
  return out


def per_cycle_oracle(target, drafter, prompts, outputs, sizes, table, engine
                     ) -> tuple[dict, list[dict]]:
  """(`intra_request.summarize` of the prompts, each prompt's analysis): the per-cycle oracle's
  and every fixed size's estimated seconds under the cost table."""
  from bp_jax.train import intra_request as intra
  spc = {b: float(table["cycle_s"][str(b)]) for b in sizes}
  step = {b: float(table.get("fallback_step_s", {}).get(str(b), table["ar_step_s"]))
          for b in sizes}
  analyses = []
  for ids, out in tqdm(list(zip(prompts, outputs)), desc="replay (per-cycle oracle)"):
    acc = intra.replay_acceptance(target, drafter, ids, out, sizes, FLAGS.max_new_tokens,
                                  engine.length_buckets)
    analyses.append(intra.analyse_request(acc, spc, float(np.mean(list(step.values()))),
                                          FLAGS.ar_fallback, 1))
  return intra.summarize(analyses), analyses


def controller_costs() -> dict:
  """The confidence controller's cost flags as `LoopOptions` fields (only those given: both, or
  neither and the engine measures them)."""
  out = {}
  if FLAGS.controller_costs:
    out["controller_costs"] = FLAGS.controller_costs
  if FLAGS.controller_draft_cost >= 0:
    out["controller_draft_cost"] = FLAGS.controller_draft_cost
  return out


def main(_):
  target, drafter, tok, stop_ids = common.load_models(FLAGS)
  keyed = common.demo_prompts(tok, "eval", limit=FLAGS.num_prompts)
  prompts = [ids for _, ids in keyed]
  sizes = sorted(int(b) for b in FLAGS.sizes.split(",") if b)
  policies = {}
  if FLAGS.policy:
    policies["learned"] = load_policy(FLAGS.policy)
  if FLAGS.value_policy:
    policies["value"] = load_policy(FLAGS.value_policy)
  methods = [m for m in (FLAGS.methods.split(",") if FLAGS.methods else
                         default_methods(sizes, policies)) if m]
  parsed = {m: parse_method(m, sizes, policies) for m in methods}
  buckets = sorted({1, *sizes, *(b for _, info in policies.values() for b in info.block_sizes)})
  engines = {c: Engine(target, stop_ids=stop_ids, drafter=drafter,
                       shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=tuple(buckets)),
                       loop=LoopOptions(verify="exact", controller=c,
                                        controller_poor_miss=FLAGS.poor_miss,
                                        controller_calibration=load_calibration(FLAGS.calibration),
                                        ar_fallback=FLAGS.ar_fallback, **controller_costs()))
             for c in sorted({c for c, _ in parsed.values()})}

  def decode(method: str, ids):
    controller, size = parsed[method]
    engine = engines[controller]
    if isinstance(size, str):
      pol, info = policies[size]
      engine.set_policy(pol, info.block_sizes)
    return engine.generate(ids, max_new_tokens=FLAGS.max_new_tokens,
                           block_size=LEARNED if isinstance(size, str) else size)

  t0 = time.perf_counter()
  for m in tqdm(methods, desc="compiling"):
    for ids in prompts[:2]:
      decode(m, ids)
  compile_s = time.perf_counter() - t0
  best: dict[str, list] = {m: [None] * len(prompts) for m in methods}
  rng = random.Random(FLAGS.seed)
  order = list(methods)
  for r in tqdm(range(FLAGS.repeats), desc="repeats"):
    for i, ids in enumerate(prompts):
      rng.shuffle(order)
      for m in order:
        g = decode(m, ids)
        old = best[m][i]
        if old is not None and old.output_ids != g.output_ids:
          raise AssertionError(f"{m}: a repeat decoded other tokens for {keyed[i][0]}")
        if old is None or g.prefill_s + g.decode_s < old.prefill_s + old.decode_s:
          best[m][i] = g
  ar = best["ar"] if "ar" in best else None
  static = FLAGS.static_size or (
      int(policies["value"][1].block_sizes[int(policies["value"][0].static_class[...])])
      if "value" in policies else 8)
  static_name = f"backoff/{static}"
  fixed_names = [f"backoff/{b}" for b in sizes if f"backoff/{b}" in best]
  tps = lambda gs: sum(g.new_tokens for g in gs) / sum(g.prefill_s + g.decode_s for g in gs)
  hindsight = max(fixed_names, key=lambda n: tps(best[n])) if fixed_names else None
  oracle = oracle_gain = None
  if FLAGS.cost_table and os.path.isfile(FLAGS.cost_table) and ar is not None:
    with open(FLAGS.cost_table, encoding="utf-8") as f:
      table = json.load(f)
    oracle, analyses = per_cycle_oracle(target, drafter, prompts, [g.output_ids for g in ar],
                                        sizes, table, engines[next(iter(engines))])
    if static in sizes:  # the oracle against the same static size as the measured rows
      static_est = sum(a["seconds"]["fixed"][str(static)] for a in analyses)
      oracle_gain = static_est / max(oracle["seconds"]["per_cycle_oracle"], 1e-12)

  def versus(gs, base, seed):
    if base is None:
      return None
    tok_a = [g.new_tokens for g in gs]
    sec_a = [g.prefill_s + g.decode_s for g in gs]
    tok_b = [g.new_tokens for g in base]
    sec_b = [g.prefill_s + g.decode_s for g in base]
    ratio, lo, hi = bootstrap_speedup(tok_a, sec_a, tok_b, sec_b, seed=seed)
    return [round(ratio, 4), round(lo, 4), round(hi, 4)]

  rows = []
  for m in methods:
    gs = best[m]
    new = sum(g.new_tokens for g in gs)
    taus = [g.tau for g in gs if g.tau is not None]
    committed = sum(sum(g.forward_lengths) for g in gs)
    forwards = sum(g.target_forwards for g in gs)
    row = {"method": m, "tokens_per_s": round(tps(gs), 1),
           "decode_tokens_per_s": round(new / sum(g.decode_s for g in gs), 1),
           "tau": round(float(np.mean(taus)), 3) if taus else None,
           "tokens_per_forward": round(committed / max(forwards, 1), 3),
           "ar_step_share": round(sum(g.ar_steps for g in gs) / max(forwards, 1), 3),
           "identical_to_ar": sum(g.output_ids == a.output_ids for g, a in zip(gs, ar or gs)),
           "vs_ar": versus(gs, ar, FLAGS.seed),
           "vs_static": versus(gs, best.get(static_name), FLAGS.seed),
           "vs_best_fixed": versus(gs, best.get(hindsight), FLAGS.seed),
           "sizes_used": {str(b): n for b, n in sorted(
               {b: sum(g.block_size == b for g in gs) for b in {g.block_size for g in gs}}
               .items())}}
    verified = [k for g in gs for k in g.verified_drafts]
    if verified:
      row["mean_verified_drafts_per_cycle"] = round(float(np.mean(verified)), 3)
    if oracle_gain is not None and row["vs_static"] is not None and oracle_gain > 1:
      row["share_of_oracle_gain"] = round((row["vs_static"][0] - 1) / (oracle_gain - 1), 3)
    rows.append(row)
  meta = {"device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
          "prompts": len(prompts), "repeats": FLAGS.repeats, "sizes": sizes,
          "static_size": static, "best_fixed_in_hindsight": hindsight,
          "ar_fallback": FLAGS.ar_fallback, "max_new_tokens": FLAGS.max_new_tokens,
          "calibration": FLAGS.calibration, "poor_miss": FLAGS.poor_miss,
          "controller_costs": FLAGS.controller_costs or "measured",
          "controller_draft_cost": FLAGS.controller_draft_cost,
          "compile_and_warm_s": round(compile_s, 1),
          "policy": FLAGS.policy, "value_policy": FLAGS.value_policy,
          "per_cycle_oracle": oracle, "oracle_gain_over_static_est": oracle_gain,
          "command": common.command_line()}
  common.write_json(os.path.join(FLAGS.out, "block_choice.json"), {"meta": meta, "rows": rows})
  ci = lambda v: "" if v is None else f"{v[0]:.3f}x [{v[1]:.3f}, {v[2]:.3f}]"
  cols = ["method", "tokens/s", "decode tokens/s", "tau", "tokens/forward", "AR-step share",
          "vs AR", f"vs static b={static}", f"vs best fixed ({hindsight})", "oracle gain share",
          "identical", "sizes"]
  lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
  for r in rows:
    lines.append("| " + " | ".join(str(x) for x in (
        r["method"], r["tokens_per_s"], r["decode_tokens_per_s"], r["tau"],
        r["tokens_per_forward"], r["ar_step_share"], ci(r["vs_ar"]), ci(r["vs_static"]),
        ci(r["vs_best_fixed"]), r.get("share_of_oracle_gain", ""),
        f"{r['identical_to_ar']}/{len(prompts)}",
        " ".join(f"{b}:{n}" for b, n in r["sizes_used"].items()))) + " |")
  head = [f"`{meta['command']}` on {meta['device']} ({meta['cpu_count']} cores): "
          f"{len(prompts)} held-out HumanEval prompts, T=0, {FLAGS.max_new_tokens} new tokens, "
          f"{FLAGS.repeats} interleaved repeats (fastest kept); compile + warm-up "
          f"{compile_s:.0f} s.", ""]
  if oracle is not None:
    s = oracle["seconds"]
    head += [f"Per-cycle oracle (replay, cost table {FLAGS.cost_table}): estimated "
             f"{oracle_gain or float('nan'):.3f}x the static size b={static}; "
             f"{1 + s['gain_per_cycle_over_static']:.3f}x the best single size in hindsight "
             f"b={s['global_static_size']} (per-request oracle "
             f"{1 + s['gain_per_request_over_static']:.3f}x it).", ""]
  text = "\n".join(head + lines) + "\n"
  common.write_text(os.path.join(FLAGS.out, "block_choice.md"), text)
  interval_bars({r["method"]: tuple(r["vs_ar"]) for r in rows if r["vs_ar"]},
                os.path.join(FLAGS.out, "block_choice.png"),
                ylabel="tokens/s vs our AR (95% bootstrap interval over prompts)",
                title=f"demo, {len(prompts)} held-out HumanEval prompts, T=0")
  print(text)


if __name__ == "__main__":
  cli.run(main, __doc__)
