"""The `report` stage: BlockPilot against every fixed block size on the held-out prompts.

Inputs: the target and drafter of the workdir, `policy_labels` / `policy_eval_labels` (stage
labels) and the policies of `<workdir>/policies` (stage policy). Evaluation prompts are the
evaluation part of `cfg.blockpilot`'s split; the stage refuses to run when a policy was labelled
on one of them, or when the labels were made for another split.

Runs (prompt after prompt, the methods of a prompt in a shuffled order, so that slow phases of
the machine and warm caches favour no method; seed of prompt i = cfg.seed + i): AR (block size
1), every candidate size, and every trained policy (`block_size=LEARNED`: the policy runs inside
the prefill jit). With `report_repeats` R > 1 every run is repeated R times (same seed, same
tokens) and the fastest prefill and loop times are kept. Rows assembled from those runs
without decoding again (at a fixed size they are the same computation, same seed):
  best static (rule)  the size best on the labelling set under the rule (`policy_stage.best_static`)
  random              uniform over the candidates (`policy.random_block_size`,
                      seed blockpilot.random_seed)
  oracle (rule)       each prompt's best size in `policy_eval_labels` (as decode.py's
                      block_policy=oracle)

Outputs in `cfg.blockpilot.report_dir` (default `<workdir>/report`): report.md and report.json
(the table, the policy overhead, the intra-request analysis), runs.jsonl (every run), and PNGs:
tau_by_size.png, chosen_sizes.png, acceptance_hist.png. Figures have decode.py's meanings
(`eval.report`): τ is committed tokens per speculative cycle (the plots and histograms too),
tokens per target forward also count the AR fallback's steps. The label sets must have been
measured with this report's decode settings (the loop's form included: `check_label_settings`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.eval import report as rep
from bp_jax.decode_job.block_choice import sampling_form, sampling_options
from bp_jax.decoding.engine import LEARNED
from bp_jax.errors import BadInputError
from bp_jax.policy.mlp import load_policy, random_block_size
from bp_jax.policy.features import FEATURE_TYPES, feature_dims, parse_feature_types, policy_costs
from bp_jax.train import intra_request as intra
from bp_jax.data import label_sets
from bp_jax.train import labels as lab
from bp_jax.train import workdir as wd
from bp_jax.train.policy_stage import (best_static, parse_heads, parse_rules, policy_dir,
                                       policy_name, trained_kinds)

# Qwen3-4B with a b16 DFlash drafter (docs/design.md §2): vocabulary, hidden size, chosen layers,
# parameters and the drafter's block size.
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "num_layers": 5, "params": 4.02e9,
            "block_size": 16}


def _run_record(method: str, key: str, g: Any) -> dict:
  """One run (runs.jsonl): `acceptance_lengths` per speculative cycle (τ's terms);
  `forward_lengths` / `forward_is_cycle` every target forward of the loop, in order."""
  return {"method": method, "prompt": key, "block_size": int(g.block_size),
          "new_tokens": g.new_tokens, "prefill_s": g.prefill_s, "decode_s": g.decode_s,
          "acceptance_lengths": list(g.acceptance_lengths),
          "forward_lengths": list(g.forward_lengths),
          "forward_is_cycle": list(g.forward_is_cycle), "cycles": g.cycles,
          "ar_steps": g.ar_steps, "tau": g.tau, "tokens_per_forward": g.tokens_per_forward,
          "policy_probs": g.policy_probs, "output_ids": list(g.output_ids)}


def _schedule(run: Mapping[str, Any]) -> list[tuple[int, bool]]:
  """(committed tokens, is a speculative cycle) per target forward of a run."""
  return [(int(a), bool(c)) for a, c in zip(run["forward_lengths"], run["forward_is_cycle"])]


def check_label_settings(cfg: Any, max_new: int, temperature: float) -> None:
  """Refuses label sets measured with other decode settings than this report's runs (another
  loop form, e.g. with or without the AR fallback, gives other labels and cycle costs)."""
  from bp_jax.decode_job.block_choice import loop_options

  want = label_sets.decode_settings(max_new, temperature, bool(cfg.get("chat", False)),
                                    loop_options(cfg), sampling_options(cfg))
  for name in (label_sets.LABELS, label_sets.EVAL_LABELS):
    path = os.path.join(wd.data_dir(cfg), name)
    label_sets.check_decode_settings(path, label_sets.open_label_set(path), want)


def load_policies(cfg: Any, eval_texts: Sequence[str], fingerprint: str,
                  sizes: Sequence[int]) -> dict[str, tuple[Any, Any]]:
  """{`policy_name` ("feature:rule[:head]"): (policy, info)} for every configured policy, each
  checked: trained on these labels' sizes and target, and never labelled on an evaluation
  prompt."""
  bp = cfg.blockpilot
  out = {}
  for rule, head in trained_kinds(parse_rules(bp.rules), parse_heads(bp.heads)):
    for feature in parse_feature_types(bp.features):
      path = policy_dir(cfg, feature, rule, head)
      wd.require_checkpoint(path, "policy", "report", "policy")
      policy, info = load_policy(path)
      seen = info.overlap(eval_texts)
      if seen:
        raise BadInputError(f"policy {path} was labelled on {len(seen)} evaluation prompt(s): "
                            "refusing to evaluate it on them; retrain it (stage policy)")
      if tuple(info.block_sizes) != tuple(sizes):
        raise BadInputError(f"policy {path} chooses among sizes {list(info.block_sizes)} but "
                            f"the labels have {list(sizes)}: rerun the policy stage")
      made_for = (info.meta.get("labels") or {}).get("target_fingerprint")
      if made_for not in (None, fingerprint):
        raise BadInputError(f"policy {path} was trained on labels of another target "
                            f"({made_for}, not {fingerprint}): rerun the labels and policy "
                            "stages")
      out[policy_name(feature, rule, head)] = (policy, info)
  return out


def policy_overhead(engine: Any, policies: Mapping[str, tuple[Any, Any]],
                    plain_prefill_s: Sequence[float], learned_prefill_s: Mapping[str, list],
                    hidden_dim: int, depth: int, num_classes: int, repeats: int = 50) -> dict:
  """Parameters of each feature type's policy (ours and at Qwen3-4B) and the time of one
  policy forward, alone (jitted, median of `repeats`) and as the prefill's increase."""
  cfg = engine.cfg
  n_layers, b = len(engine.drafter.cfg.target_layer_ids), engine.drafter.cfg.block_size
  q = (QWEN3_4B["vocab_size"], QWEN3_4B["hidden_size"], QWEN3_4B["num_layers"])
  qb = QWEN3_4B["block_size"]
  out = {"prefill_median_ms": 1e3 * float(np.median(plain_prefill_s)), "policies": {},
         "params_ours": policy_costs(cfg.vocab_size, cfg.hidden_size, n_layers, hidden_dim,
                                     depth, num_classes, draft_block_size=b),
         "params_qwen3_4b": policy_costs(*q, hidden_dim, depth, num_classes,
                                         draft_block_size=qb),
         "params_qwen3_4b_published_mlp": policy_costs(*q, 2048, 2, num_classes,
                                                       draft_block_size=qb),
         "feature_dims_ours": feature_dims(cfg.vocab_size, cfg.hidden_size, n_layers, b),
         "feature_dims_qwen3_4b": feature_dims(*q, qb)}
  for name, (policy, _) in policies.items():
    graph, state = nnx.split(policy)
    fn = jax.jit(lambda s, x: jnp.argmax(nnx.merge(graph, s)(x), -1))
    x = jnp.zeros((1, policy.arch.input_dim), jnp.float32)
    fn(state, x).block_until_ready()
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn(state, x).block_until_ready()
      times.append(time.perf_counter() - t0)
    alone = float(np.median(times))
    with_policy = float(np.median(learned_prefill_s[name]))
    out["policies"][name] = {
        "params": policy.arch.num_params(), "forward_alone_ms": 1e3 * alone,
        "forward_alone_vs_prefill": alone / max(out["prefill_median_ms"] / 1e3, 1e-12),
        "prefill_with_policy_median_ms": 1e3 * with_policy,
        "prefill_increase": with_policy / max(out["prefill_median_ms"] / 1e3, 1e-12) - 1.0}
  return out


def report_stage(cfg: Any) -> None:
  """Decodes the evaluation prompts with every method and writes the report (module docstring)."""
  from tqdm import tqdm

  bp = cfg.blockpilot
  target, drafter, tok, fingerprint = lab.load_models(cfg, "report")
  label_records = lab.read_label_set(cfg, label_sets.LABELS, "report")
  eval_records = lab.read_label_set(cfg, label_sets.EVAL_LABELS, "report")
  sizes = tuple(int(b) for b in label_records[0]["block_sizes"])
  label_prompts, evals = lab.prompt_sets(cfg, tok)
  if {p.hash for p in evals} != {r["text_hash"] for r in eval_records}:
    raise BadInputError(f"dataset {label_sets.EVAL_LABELS!r} holds other prompts than the evaluation "
                        "split of --config.blockpilot: rerun the labels stage")
  lab.check_no_overlap(label_prompts, evals)
  max_new, temperature = int(bp.max_new_tokens), float(bp.temperature)
  check_label_settings(cfg, max_new, temperature)
  policies = load_policies(cfg, [p.text for p in evals], fingerprint, sizes)
  encoded = [lab.encode(p, tok, bool(cfg.get("chat", False))) for p in evals]
  engine = lab.build_engine(cfg, target, drafter, tok, sizes, [len(e) for e in encoded], max_new)
  used = sorted({engine.encode_padded(ids)[1] for ids in encoded})
  sampling = sampling_options(cfg)
  forms = (sampling_form(temperature, sampling),)
  t0 = time.perf_counter()
  engine.precompile((1,) + sizes, used, forms=forms)
  for policy, info in policies.values():
    engine.set_policy(policy, info.block_sizes)
    engine.precompile((), used, policy=True, plain_prefill=False, forms=forms)
  compiled = engine.compiled.summary()
  print(f"[report] {len(evals)} evaluation prompts; {len(policies)} policies; compiled "
        f"{compiled['compilations']} functions in {time.perf_counter() - t0:.1f} s", flush=True)

  repeats = int(bp.get("report_repeats", 1))
  if repeats < 1:
    raise BadInputError(f"--config.blockpilot.report_repeats={repeats} must be >= 1")
  # Block size 1 (a candidate with blockpilot.include_ar) is the AR run itself.
  methods = ["AR"] + [f"b={b}" for b in sizes if b != 1] + [f"learned {n}" for n in policies]
  runs: dict[str, list[dict]] = {m: [] for m in methods}
  for i, (p, ids) in enumerate(tqdm(list(zip(evals, encoded)), desc="report", unit="prompt",
                                    dynamic_ncols=True)):
    kw = dict(max_new_tokens=max_new, temperature=temperature, seed=int(cfg.seed) + i,
              **sampling)
    done: dict[str, dict] = {}
    for r in range(repeats):
      for k in np.random.default_rng([i, r, 99]).permutation(len(methods)):
        m = methods[k]
        if m.startswith("learned "):
          policy, info = policies[m[len("learned "):]]
          engine.set_policy(policy, info.block_sizes)
          rec = _run_record(m, p.key, engine.generate(ids, block_size=LEARNED, **kw))
        else:
          b = 1 if m == "AR" else int(m[2:])
          rec = _run_record(m, p.key, engine.generate(ids, block_size=b, **kw))
        if m in done:  # same seed, same tokens: keep the fastest timings
          if rec["output_ids"] != done[m]["output_ids"]:
            raise AssertionError(f"{m}: a repeat decoded other tokens for {p.key}")
          for t in ("prefill_s", "decode_s"):
            done[m][t] = min(done[m][t], rec[t])
        else:
          done[m] = rec
    for m in methods:
      runs[m].append(done[m])
  if 1 in sizes:
    runs["b=1"] = runs["AR"]
  if engine.compiled.summary()["compilations"] != compiled["compilations"]:
    raise AssertionError("decoding compiled new functions after precompile")
  # A learned run is the fixed run of its size plus the policy (same seed): same forwards.
  mismatches = sum(_schedule(r) != _schedule(runs[f"b={r['block_size']}"][i])
                   for n in policies for i, r in enumerate(runs[f"learned {n}"]))

  label_costs = lab.read_label_costs(cfg, label_sets.LABELS, label_records)
  eval_costs = lab.read_label_costs(cfg, label_sets.EVAL_LABELS, eval_records)
  ar_tps = rep.method_row("AR", runs["AR"])["tokens_per_s"]
  rows = [rep.method_row("AR (b=1)", runs["AR"], ar_tps)]
  rows += [rep.method_row(f"fixed b={b}", runs[f"b={b}"], ar_tps) for b in sizes if b != 1]
  derived: dict[str, list[dict]] = {}
  for rule in parse_rules(bp.rules):
    ok = label_sets.usable(label_records)
    static = sizes[best_static([r for r, u in zip(label_records, ok) if u], rule, label_costs)]
    derived[f"best static ({rule}, labelling set) b={static}"] = runs[f"b={static}"]
  for name in policies:
    derived[f"learned {name}"] = runs[f"learned {name}"]
  derived["random"] = [runs[f"b={random_block_size(sizes, int(bp.random_seed), i)}"][i]
                       for i in range(len(evals))]
  for rule in parse_rules(bp.rules):
    best = label_sets.labels_of(label_sets.label_values(eval_records, rule, eval_costs))
    cls = {r["text_hash"]: int(c) for r, c in zip(eval_records, best)}
    derived[f"oracle ({rule})"] = [runs[f"b={sizes[cls[p.hash]]}"][i]
                                   for i, p in enumerate(evals)]
  notes = {"random": f"uniform over {list(sizes)}, seed {int(bp.random_seed)}"}
  rows += [rep.method_row(n, r, ar_tps, notes.get(n, "")) for n, r in derived.items()]

  out_dir = str(bp.get("report_dir", "") or wd.run_dir(cfg, "report"))
  os.makedirs(out_dir, exist_ok=True)
  tau_NK = np.asarray([[runs[f"b={b}"][i]["tau"] or 0.0 for b in sizes]
                       for i in range(len(evals))])
  rep.tau_by_size_plot(tau_NK, sizes, os.path.join(out_dir, "tau_by_size.png"),
                       f"τ per speculative cycle by block size, {len(evals)} held-out prompts")
  chosen = {n: [r["block_size"] for r in rs] for n, rs in derived.items()
            if n.startswith(("learned", "oracle", "random"))}
  rep.size_distribution_plot(chosen, sizes, os.path.join(out_dir, "chosen_sizes.png"))
  best_learned = max((rw for rw in rows if rw["method"].startswith("learned")),
                     key=lambda rw: rw["tokens_per_s"], default=None)
  shown = [n for n in derived if n.startswith("best static")][:1]
  shown += [best_learned["method"]] if best_learned else []
  shown += [n for n in derived if n.startswith("oracle")][:1]
  hist = {n: [a for r in derived[n] for a in r["acceptance_lengths"]] for n in shown}
  rep.acceptance_histograms(hist, os.path.join(out_dir, "acceptance_hist.png"))

  plain = [r["prefill_s"] for b in sizes for r in runs[f"b={b}"]]
  learned_pre = {n: [r["prefill_s"] for r in runs[f"learned {n}"]] for n in policies}
  overhead = policy_overhead(engine, policies, plain, learned_pre, int(bp.hidden_dim),
                             int(bp.depth), len(sizes))
  analysis = None
  if bool(bp.get("replay", True)):
    analysis = intra_request_analysis(engine, target, drafter, evals, encoded, runs, sizes,
                                      max_new, temperature)
  report = {"prompts": len(evals), "eval_source": str(bp.eval_source), "sizes": list(sizes),
            "temperature": temperature, "max_new_tokens": max_new,
            "ar_fallback": [engine.ar_fallback, engine.ar_fallback_accept], "rows": rows,
            "learned_vs_fixed_forward_mismatches": mismatches,
            "compilations": compiled, "policy_overhead": overhead, "intra_request": analysis,
            "labelling_prompts": len(label_records),
            "label_cycle_cost_ms": [round(1e3 * c, 4)
                                    for c in label_sets.cycle_costs(label_records)],
            "cost_table": label_costs if isinstance(label_costs, dict) else None}
  with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2, default=float)
  with open(os.path.join(out_dir, "runs.jsonl"), "w", encoding="utf-8") as f:
    for rs in runs.values():
      for r in rs:
        f.write(json.dumps(r) + "\n")
  md = render_markdown(report)
  with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
    f.write(md)
  print(md)
  print(f"[report] wrote {out_dir}/report.md, report.json, runs.jsonl and PNGs")


def _ar_step_seconds(ar_runs: Sequence[Mapping[str, Any]]) -> float:
  """Median seconds per step of this report's plain AR runs."""
  per_step = [r["decode_s"] / len(r["forward_lengths"]) for r in ar_runs if r["forward_lengths"]]
  return float(np.median(per_step)) if per_step else 0.0


def _seconds_per_cycle(size_runs: Sequence[Mapping[str, Any]], ar_step: float) -> float:
  """Median over a size's runs of the loop seconds spent in speculative cycles per cycle: the
  AR fallback's steps (the run's own count) are charged at `ar_step` seconds each."""
  per_run = [(r["decode_s"] - r["ar_steps"] * ar_step) / r["cycles"]
             for r in size_runs if r["cycles"]]
  return float(np.median(per_run)) if per_run else 1.0


def intra_request_analysis(engine: Any, target: Any, drafter: Any, prompts: Sequence[Any],
                           encoded: Sequence[Sequence[int]], runs: Mapping[str, list],
                           sizes: Sequence[int], max_new: int, temperature: float) -> dict:
  """`intra_request` over the evaluation prompts (greedy outputs; at T > 0 an extra greedy AR
  decode per prompt gives them), for the loop this report's runs ran (the engine's AR fallback),
  with seconds per cycle and per AR step measured by this report's runs. At T=0 the replayed
  schedule of every fixed run (each forward's committed tokens, cycle or AR step) is compared
  with the run's (`replay_agrees_with_decode`)."""
  accs = []
  for i, ids in enumerate(encoded):
    if temperature == 0:
      out = runs["AR"][i]["output_ids"]
    else:
      out = engine.generate(ids, max_new_tokens=max_new, temperature=0.0, block_size=1).output_ids
    accs.append(intra.replay_acceptance(target, drafter, ids, out, sizes, max_new,
                                        engine.length_buckets))
  fb, fb_accept = int(engine.ar_fallback), int(engine.ar_fallback_accept)
  ar_step = _ar_step_seconds(runs["AR"])
  spc = {b: _seconds_per_cycle(runs[f"b={b}"], ar_step) for b in sizes}
  agree = [intra.forward_schedule(accs[i][b], fb if b > 1 else 0, fb_accept) == _schedule(r)
           for b in sizes for i, r in enumerate(runs[f"b={b}"])] if temperature == 0 else []
  analyses = [intra.analyse_request(acc, spc, ar_step, fb, fb_accept) for acc in accs]
  out = intra.summarize(analyses)
  out["ar_fallback"] = [fb, fb_accept]
  out["seconds_per_cycle_ms"] = {str(b): 1e3 * s for b, s in spc.items()}
  out["ar_step_ms"] = 1e3 * ar_step
  out["replay_agrees_with_decode"] = float(np.mean(agree)) if agree else None
  out["per_request"] = [{"prompt": p.key, **a} for p, a in zip(prompts, analyses)]
  return out


def render_markdown(report: Mapping[str, Any]) -> str:
  """report.md: the table, then the overhead and the intra-request analysis in words."""
  lines = [f"# BlockPilot on {report['prompts']} held-out prompts ({report['eval_source']})", "",
           f"Candidate sizes {report['sizes']}; T={report['temperature']}; "
           f"{report['max_new_tokens']} new tokens; {_loop_words(report['ar_fallback'])}; "
           f"policies trained on {report['labelling_prompts']} labelling prompts (disjoint "
           "from these).", "",
           "τ is committed tokens per speculative cycle (draft + verify; 1 for AR), the "
           "papers' figure; tokens per target forward also count the AR fallback's steps.", "",
           rep.markdown_table(report["rows"]), ""]
  table = report.get("cost_table")
  if table:
    from bp_jax.train.cost_table import describe
    lines += ["Throughput labels and static sizes are priced by this machine's cost table "
              f"(medians of repeated timings): {describe(table)}.", ""]
  mm = report.get("learned_vs_fixed_forward_mismatches")
  if mm is not None:
    lines += [f"Learned runs whose target forwards differ from the fixed run at the chosen "
              f"size: {mm} (expected 0: the same computation with the same seed).", ""]
  o = report["policy_overhead"]
  lines += ["## Policy overhead", "",
            f"Median prefill (no policy): {o['prefill_median_ms']:.2f} ms.", "",
            "| policy | params | forward alone (ms) | alone / prefill | prefill with policy "
            "(ms) | prefill increase |", "|---|---:|---:|---:|---:|---:|"]
  for name, p in o["policies"].items():
    lines.append(f"| {name} | {p['params']:,} | {p['forward_alone_ms']:.3f} | "
                 f"{100 * p['forward_alone_vs_prefill']:.2f}% | "
                 f"{p['prefill_with_policy_median_ms']:.2f} | {100 * p['prefill_increase']:.1f}% |")
  lines += ["", "Parameters per feature type (this MLP's width/depth; and the published 2x2048 "
            "MLP) on Qwen3-4B (V=151,936, D=2,560, 5 drafter layers), and as a share of "
            "Qwen3-4B's ~4.0B parameters (a single-request prefill is memory-bound and reads "
            "each weight once, so this share estimates the policy's relative cost there):", ""]
  for f in FEATURE_TYPES:
    if f in o["params_qwen3_4b"]:
      q, pub = o["params_qwen3_4b"][f], o["params_qwen3_4b_published_mlp"][f]
      lines.append(f"- {f}: ours {o['params_ours'].get(f, 0):,}; Qwen3-4B {q:,} "
                   f"({100 * q / QWEN3_4B['params']:.3f}%; published MLP {pub:,}, "
                   f"{100 * pub / QWEN3_4B['params']:.2f}%)")
  a = report.get("intra_request")
  if a and "forwards" in a:
    lines += ["", "## Intra-request variation (teacher-forced replay, greedy outputs)", ""]
    lines += _intra_lines(a)
  return "\n".join(lines) + "\n"


def _loop_words(ar_fallback: Sequence[int]) -> str:
  steps, accept = ar_fallback
  if not steps:
    return "the paper's loop (no AR fallback)"
  drafts = "draft" if accept == 1 else "drafts"
  return (f"the loop with AR fallback (up to {steps} AR steps after a cycle accepting at most "
          f"{accept} {drafts})")


def _intra_lines(a: Mapping[str, Any]) -> list[str]:
  """The intra-request analysis in words."""
  f, s = a["forwards"], a["seconds"]
  fallback = bool(a.get("ar_fallback", [0])[0])
  loop = (f" Fixed sizes run {_loop_words(a['ar_fallback'])}, as the decodes did; the "
          "per-cycle schedule may also take an AR step at any forward." if fallback else "")
  return [
      "For every position where a cycle could start and every candidate size, the "
      "drafter's acceptance there is replayed; a dynamic program then finds the best "
      "per-cycle schedule (it knows the future: an upper bound for any per-cycle "
      "controller), compared with the best fixed size per request (the per-request "
      f"oracle BlockPilot approximates) and with the best single size for all requests.{loop}",
      "",
      f"- Replay reproduces the real decode's target forwards (each one's committed tokens, "
      f"cycle or AR step) for {100 * (a['replay_agrees_with_decode'] or 0):.1f}% of "
      "(prompt, size) pairs.",
      f"- Target forwards: best single size b={f['global_static_size']}: "
      f"{f['global_static']:.0f}; per-request oracle {f['per_request_oracle']:.0f} "
      f"({100 * f['gain_per_request_over_static']:.1f}% more tokens per target forward); "
      f"per-cycle oracle {f['per_cycle_oracle']:.0f} "
      f"({100 * f['gain_per_cycle_over_per_request']:.1f}% more than per-request)"
      + ("." if fallback else "; without the fallback these are also the gains in τ."),
      f"- {100 * f['switched_fraction']:.1f}% of the per-cycle oracle's forwards need another "
      f"size than the request's best ({f['requests_switching']} of {a['requests']} requests "
      "switch at least once).",
      f"- Estimated time (measured seconds per cycle and per AR step): per-request oracle "
      f"{100 * s['gain_per_request_over_static']:.1f}% faster than the best single size "
      f"b={s['global_static_size']}; per-cycle oracle a further "
      f"{100 * s['gain_per_cycle_over_per_request']:.1f}%."]
