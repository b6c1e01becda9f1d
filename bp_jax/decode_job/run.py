"""The decode job behind decode.py: load checkpoints, decode a prompt set, write records.

How each request's block size is chosen: `block_choice` (--config.block_policy; with mode=ar the
policy is not used and every request decodes plainly). Methods compared in the same run:
`compare` (--config.compare, --config.repeats). Records and the summary: `records`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Sequence

from tqdm import tqdm

from bp_jax.decode_job.block_choice import (BLOCK_POLICIES, BlockChoice, batch_options,
                                          block_policy_of, default_block_sizes, loop_options,
                                          online_costs,
                                          parse_int_list, resolve_block_choice,
                                          sampling_form, sampling_options)
from bp_jax.decode_job.compare import (against_best_fixed, best_fixed, check_repeats_agree,
                                     fastest_of, method_choice, method_of, paired_speedup,
                                     parse_methods, run_order)
from bp_jax.decoding.call_tally import tally_json
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import OPTION_NAMES, BatchOptions, LoopOptions, ShapeOptions
from bp_jax.decoding.generation import Generation
from bp_jax.decode_job.records import figures, print_summary, record_of, summarize  # noqa: F401
from bp_jax.decoding.requests import check_block_sizes, check_sampling
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.decoding.verify import same_tokens_as_ar
from bp_jax.gc_freeze import freeze_after_startup
from bp_jax.errors import BadInputError, named_as_flags
from bp_jax.models.precision import matmul_precision, precision_of
from bp_jax.text.prompts import Prompt, load_prompts
from bp_jax.text.tokenizer import encode_prompt, load_tokenizer, stop_token_ids, tokenizer_size
from bp_jax.parallel.mesh import describe, make_mesh
from bp_jax.weights.loading import load_drafter, load_target

MODES = ("ar", "spec")
LABELLED_PROMPTS = ("refuse", "skip")
# What each record's `policy_probs` holds, per policy head (`BlockPolicy.decide`).
POLICY_SCORES = {"classify": "class probabilities",
                 "value": "shrunk value ratios lam*rhat+(1-lam)*prior",
                 "priced": "1 / cost: estimated tokens per AR step's time at the prices in effect"}


def prompt_limit(num_prompts: int) -> int | None:
  """--config.num_prompts as a limit: 0 or -1 = all prompts (None), N > 0 = the first N."""
  n = int(num_prompts or 0)
  if n < -1:
    raise BadInputError(f"--config.num_prompts={n}: give N > 0, or 0 / -1 for all prompts")
  return n if n > 0 else None


def validate(cfg) -> None:
  if cfg.mode not in MODES:
    raise BadInputError(f"--config.mode={cfg.mode!r} is not one of {list(MODES)}")
  if cfg.block_policy not in BLOCK_POLICIES:
    raise BadInputError(f"--config.block_policy={cfg.block_policy!r} is not one of "
                        f"{list(BLOCK_POLICIES)}")
  policy = block_policy_of(cfg)
  if policy == "learned" and not cfg.policy:
    raise BadInputError("--config.block_policy=learned needs --config.policy (a policy "
                        "checkpoint written by train.py --config.stage=policy)")
  if policy == "oracle" and not cfg.get("oracle_labels", ""):
    raise BadInputError("--config.block_policy=oracle needs --config.oracle_labels (a labels "
                        "dataset folder written by train.py --config.stage=labels)")
  if cfg.get("labelled_prompts", "refuse") not in LABELLED_PROMPTS:
    raise BadInputError(f"--config.labelled_prompts={cfg.labelled_prompts!r} is not one of "
                        f"{list(LABELLED_PROMPTS)}")
  if not cfg.target:
    raise BadInputError("--config.target is empty: give a converted target checkpoint folder")
  if cfg.mode == "spec" and not drafter_path(cfg):
    raise BadInputError("--config.mode=spec needs --config.drafter (a converted DFlash drafter)")
  check_sampling(cfg.temperature)
  sampling_options(cfg)
  loop_options(cfg)
  online_costs(cfg)
  batch_options(cfg)
  prompt_limit(cfg.num_prompts)
  check_block_sizes(parse_int_list(cfg.block_sizes, "--config.block_sizes"))
  if cfg.mode == "spec":
    check_block_sizes([cfg.block_size], "--config.block_size")
  if int(cfg.get("repeats", 1)) < 1:
    raise BadInputError(f"--config.repeats={cfg.repeats} must be >= 1")
  parse_methods(cfg.get("compare", ""))
  precision_of(cfg)


def drafter_path(cfg) -> str:
  """The drafter this run decodes with: at T > 0 the sampling drafter
  (--config.drafter_sampling) when the config names one, else --config.drafter."""
  sampling = str(cfg.get("drafter_sampling", "") or "")
  return sampling if float(cfg.temperature) > 0 and sampling else str(cfg.drafter or "")


def needs_drafter(cfg) -> bool:
  """mode=spec, or a comparison method that drafts."""
  return cfg.mode == "spec" or any(m != "ar" for m in parse_methods(cfg.get("compare", "")))


def build_engine(cfg, extra_sizes: Sequence[int] = ()) -> tuple[Engine, Any, Any]:
  """Loads target, drafter and tokenizer and builds the engine described by `cfg`; the buckets
  are `--config.block_sizes` (or the drafter's size +- 4), `--config.block_size` and
  `extra_sizes`. A drafter trained for another target is refused (`provenance`). Returns
  (engine, tokenizer, the run's `provenance.Fingerprints`)."""
  from bp_jax.weights import provenance
  from bp_jax.weights.checkpoint_io import read_checkpoint_meta

  mesh = make_mesh(str(cfg.get("mesh", "") or ""))
  target = load_target(cfg.target, cfg.dtype, mesh=mesh)
  tok = load_tokenizer(cfg.tokenizer or cfg.target)
  drafter = None
  block_sizes = parse_int_list(cfg.block_sizes, "--config.block_sizes")
  if needs_drafter(cfg):
    if not drafter_path(cfg):
      raise BadInputError("--config.compare lists speculative methods: they need "
                          "--config.drafter (a converted DFlash drafter)")
    drafter = load_drafter(drafter_path(cfg), target.cfg, cfg.dtype, mesh=mesh)
  prints = provenance.Fingerprints(target, cfg.target, drafter, drafter_path(cfg))
  if drafter is not None:
    _, meta = read_checkpoint_meta(drafter_path(cfg), expected_kind="dflash")
    if meta.get("target_fingerprint"):
      provenance.check_drafter_made_for(meta, drafter_path(cfg), prints.get("target"),
                                        cfg.target,
                                        bool(cfg.get("allow_foreign_drafter", False)))
    block_sizes = block_sizes or default_block_sizes(drafter.cfg.block_size)
    block_sizes = tuple(block_sizes) + (cfg.block_size,)  # any size can be a bucket
  sizes = tuple(sorted(set(block_sizes or (cfg.block_size,)) | {b for b in extra_sizes if b > 1}))
  buckets = parse_int_list(cfg.length_buckets, "--config.length_buckets") or None
  with named_as_flags(OPTION_NAMES):  # the library names its parameters, decode.py its flags
    engine = Engine(target, stop_ids=stop_token_ids(tok), drafter=drafter, mesh=mesh,
                    shapes=ShapeOptions(max_len=cfg.max_len, length_buckets=buckets,
                                        block_sizes=sizes),
                    loop=LoopOptions(**loop_options(cfg), online_costs=online_costs(cfg),
                                     start_backoff=bool(cfg.get("controller_start_backoff",
                                                                True)),
                                     start_plain=bool(cfg.get("controller_start_plain", True))),
                    batching=BatchOptions(**batch_options(cfg)),
                    cost_cache=str(cfg.get("controller_cost_cache", "default")))
  return engine, tok, prints


def _drafter_block_size(cfg) -> int | None:
  path = drafter_path(cfg)
  if not needs_drafter(cfg) or not path:
    return None
  from bp_jax.models.config import DFlashConfig, read_config_json
  return DFlashConfig.from_hf_dict(read_config_json(path), f"{path}/config.json").block_size


def prompt_tail(text: str, limit: int = 300) -> str:
  """The end of a prompt to show before its completion: whole when it has at most `limit`
  characters, else from the first line start within the last `limit` characters (the last line
  whole when it alone is longer), after a line saying how many lines were left out."""
  if len(text) <= limit:
    return text
  cut = text.find("\n", len(text) - limit - 1)
  start = text.rfind("\n", 0, len(text) - 1) + 1 if cut < 0 else cut + 1
  if start <= 0:
    return text
  return f"[... {text.count(chr(10), 0, start)} earlier prompt lines]\n" + text[start:]


def select_prompts(cfg, choice: BlockChoice) -> list[Prompt]:
  """The prompts to decode: with a learned policy, those it was labelled on are refused (or
  skipped with --config.labelled_prompts=skip) before --config.num_prompts is applied."""
  limit = prompt_limit(cfg.num_prompts)
  if choice.name != "learned":
    return load_prompts(cfg.prompts, limit)
  prompts = load_prompts(cfg.prompts)
  seen = set(choice.info.overlap(p.text for p in prompts))
  if seen:
    ids = [prompts[i].id for i in sorted(seen)]
    if cfg.get("labelled_prompts", "refuse") != "skip":
      raise BadInputError(
          f"{len(ids)} prompt(s) of {cfg.prompts!r} (e.g. {ids[0]!r}) were used to label the "
          f"policy {cfg.policy}: never evaluate a policy on its labelling prompts "
          "(--config.labelled_prompts=skip drops them)")
    print(f"note: skipping {len(ids)} prompt(s) of {cfg.prompts!r} that labelled the policy")
    prompts = [p for i, p in enumerate(prompts) if i not in seen]
  if not prompts:
    raise BadInputError(f"no prompt of {cfg.prompts!r} is left after removing the policy's "
                        "labelling prompts")
  return prompts[:limit]


# ---- the job ------------------------------------------------------------------------------------


def _bind_policy(engine: Engine, choice: "BlockChoice", cfg, prints) -> None:
  """Binds a learned choice's policy to the engine, checking it was made for these models."""
  from bp_jax.weights import provenance

  if choice.info.target_layer_ids and engine.drafter is not None and (
      tuple(engine.drafter.cfg.target_layer_ids) != choice.info.target_layer_ids):
    raise BadInputError(f"{cfg.policy}: the policy was trained on features of target layers "
                        f"{list(choice.info.target_layer_ids)} but the drafter {drafter_path(cfg)} "
                        f"uses {list(engine.drafter.cfg.target_layer_ids)}")
  labels = choice.info.meta.get("labels") or {}
  if labels.get("target_fingerprint") or labels.get("drafter_fingerprint"):
    provenance.check_policy_made_for(choice.info.meta, cfg.policy, prints.get("target"),
                                     prints.get("drafter"),
                                     bool(cfg.get("allow_foreign_drafter", False)))
  try:
    engine.set_policy(choice.policy, choice.info.block_sizes)
  except BadInputError as e:
    raise BadInputError(f"{cfg.policy}: {e}") from None


def _precompile(engine: Engine, choices: Sequence["BlockChoice"],
                request_lengths: Sequence[int], form: SamplingForm) -> None:
  """Compiles the programs the run's requests (prompt + max_new_tokens each, sampling in
  `form`) will use, and at batch 1 runs each once (`Engine.precompile(warm=True)`): no request
  then pays a program's first run in its wall time or its prefill seconds."""
  sizes = sorted({b for c in choices for b in ((c.fixed,) if c.name == "fixed" else
                                              engine.learned_sizes if c.name == "learned"
                                              else c.sizes)})
  learned = any(c.name == "learned" for c in choices)
  comp = engine.precompile(sizes, policy=learned,
                           plain_prefill=any(c.name != "learned" for c in choices),
                           request_lengths=request_lengths, forms=(form,), warm=True)
  for key, secs in comp["per_key_s"].items():
    print(f"  compiled {key}: {secs:.2f} s")


def _decode_batched(engine: Engine, cfg, choices: dict, prompts: Sequence[Prompt],
                    encoded: Sequence[Sequence[int]], repeats: int, sampling: dict,
                    desc: str) -> dict[str, list[Generation]]:
  """Every method decodes all prompts through `Engine.generate_batch`, `repeats` times, the
  methods' order alternating between repeats; per method, the repeat with the least total time
  is kept (the repeats' outputs must agree). Returns method -> one Generation per prompt."""
  runs: dict[str, list[list[Generation]]] = {m: [] for m in choices}
  methods = list(choices)
  with tqdm(total=repeats * len(methods), desc=desc + f", batches of {engine.batch_size}",
            unit="pass") as bar:
    for r in range(repeats):
      for m in (methods if r % 2 == 0 else methods[::-1]):
        runs[m].append(engine.generate_batch(
            encoded, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            seeds=[cfg.seed + i for i in range(len(encoded))],
            block_size=[choices[m].block_size(i, p) for i, p in enumerate(prompts)],
            **sampling))
        bar.update(1)
  out = {}
  for m, reps in runs.items():
    for i in range(len(encoded)):
      check_repeats_agree([rep[i] for rep in reps])
    out[m] = min(reps, key=lambda rep: sum(g.prefill_s + g.decode_s for g in rep))
  return out


def run(cfg) -> tuple[list[dict], dict]:
  """The decode job, its programs compiled with --config.matmul_precision."""
  with matmul_precision(precision_of(cfg)):
    return _run(cfg)


def _run(cfg) -> tuple[list[dict], dict]:
  from bp_jax import compile_cache

  validate(cfg)
  cache_dir = compile_cache.enable(cfg.get("compile_cache", ""))
  if cfg.get("about", ""):
    print(cfg.about)
  if cfg.mode != "spec" and cfg.block_policy != "fixed":
    print(f"note: --config.mode={cfg.mode} decodes plainly; --config.block_policy="
          f"{cfg.block_policy} is not used")
  drafter_b = _drafter_block_size(cfg)
  choice = resolve_block_choice(cfg, drafter_b)
  main = method_of(cfg, choice)
  others = [m for m in parse_methods(cfg.get("compare", "")) if m != main]
  choices = {main: choice, **{m: method_choice(m, choice, cfg, drafter_b) for m in others}}
  extra = {b for c in choices.values() for b in c.sizes + (c.fixed,)}
  engine, tok, prints = build_engine(cfg, tuple(extra))
  learned = next((c for c in choices.values() if c.name == "learned"), None)
  if learned is not None:
    _bind_policy(engine, learned, cfg, prints)
  for c in choices.values():
    if c.name == "fixed":
      engine.check_block_size(c.fixed)
  if tokenizer_size(tok) < engine.cfg.vocab_size:
    print(f"note: the tokenizer decodes {tokenizer_size(tok)} ids but the model emits "
          f"{engine.cfg.vocab_size}: records count generated ids it cannot decode "
          "(ids_beyond_tokenizer)")
  prompts = select_prompts(cfg, choice)
  encoded = [encode_prompt(tok, p.text, cfg.chat) for p in prompts]
  largest = max(c.largest() for c in choices.values())
  for p, ids in zip(prompts, encoded):  # fail before decoding anything
    try:
      engine.check_request(len(ids), cfg.max_new_tokens, largest)
    except BadInputError as e:
      raise BadInputError(f"prompt {p.id!r}: {e}") from None
  sampling = sampling_options(cfg)
  if cfg.precompile:
    _precompile(engine, list(choices.values()),
                [len(ids) + cfg.max_new_tokens for ids in encoded],
                sampling_form(cfg.temperature, sampling))
    freeze_after_startup()  # later garbage collections skip what start-up made
  repeats = int(cfg.get("repeats", 1))
  os.makedirs(os.path.dirname(os.path.abspath(cfg.output)), exist_ok=True)
  per_method: dict[str, list[dict]] = {m: [] for m in choices}
  tmp_out = cfg.output + ".partial"
  t0 = time.perf_counter()
  desc = f"decoding ({main}" + (f" vs {','.join(others)}" if others else "") + ")"
  try:
    with open(tmp_out, "w") as f:
      if engine.batch_size > 1:
        for m, gens in _decode_batched(engine, cfg, choices, prompts, encoded, repeats,
                                       sampling, desc).items():
          per_method[m] = [record_of(i, p, g, tok, choices[m].name)
                           for i, (p, g) in enumerate(zip(prompts, gens))]
        for r in per_method[main]:
          f.write(json.dumps(r) + "\n")
      else:
        for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc=desc,
                                          unit="prompt")):
          gens: dict[str, list[Generation]] = {m: [] for m in choices}
          for m in run_order(list(choices), repeats, cfg.seed, i):
            gens[m].append(engine.generate(
                ids, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                seed=cfg.seed + i, block_size=choices[m].block_size(i, p), **sampling))
          for m, gs in gens.items():
            per_method[m].append(record_of(i, p, fastest_of(gs), tok, choices[m].name))
          f.write(json.dumps(per_method[main][-1]) + "\n")
    os.replace(tmp_out, cfg.output)
  except BaseException:
    if os.path.exists(tmp_out):
      os.remove(tmp_out)  # never leave a half-written output behind
    raise
  records = per_method[main]
  summary = summarize(records, engine, cfg, time.perf_counter() - t0)
  summary["block_policy"] = choice.name
  summary.update(batch_size=engine.batch_size, sync_cycles=engine.sync_cycles,
                 shrink_batches=engine.shrink, join_learned_sizes=engine.join_learned,
                 move_plain_after=engine.move_plain_after,
                 mesh=describe(engine.mesh))
  if engine.slot_use is not None:  # batched: the share of slot time holding a decoding row
    summary["slot_use"] = round(engine.slot_use, 4)
  summary["loop_calls"] = tally_json(engine.loop_calls)  # every method's, by shape
  summary["plain_probes"] = engine.plain_probes  # (counted in loop_calls too)
  summary["compile_cache"] = cache_dir
  if engine.drafter is not None:
    summary["drafter"] = drafter_path(cfg) + (
        " (the sampling drafter, --config.drafter_sampling, at T > 0)"
        if drafter_path(cfg) != cfg.drafter else "")
  summary["matmul_precision"] = precision_of(cfg)
  if choice.name != "fixed":
    summary["candidate_block_sizes"] = list(choice.sizes)
  if choice.name == "learned":
    decision, source = engine.policy.decision(), engine.policy_prices_source
    summary["policy"] = {"path": cfg.policy, "feature_type": choice.policy.arch.feature_type,
                         "label_rule": choice.info.label_rule,
                         "num_params": choice.policy.arch.num_params(),
                         "head": choice.policy.arch.head,
                         "policy_probs_are": POLICY_SCORES[choice.policy.arch.head],
                         **({"decision": decision} if decision else {}),
                         **({"prices_from": source} if source else {})}
  if others:
    ar_out = [r["output_ids"] for r in per_method["ar"]] if "ar" in per_method else None
    same_tokens = same_tokens_as_ar(engine.verify, cfg.temperature)

    def entry(m: str) -> dict:
      recs = per_method[m]
      same = (None if ar_out is None or not (same_tokens or m == "ar") else
              sum(r["output_ids"] == a for r, a in zip(recs, ar_out)))
      keep = ("decode_tokens_per_s", "tokens_per_s", "tau", "tokens_per_forward", "prompts")
      got = figures(recs)
      # Paired over prompts where each request was timed alone (interleaved per request); a
      # batch's requests share their loop calls, so their times are not the prompts' own.
      paired = "ar" in per_method and m != "ar" and engine.batch_size == 1
      interval = lambda whole: (paired_speedup(recs, per_method["ar"], end_to_end=whole)
                                if paired else None)
      return {"method": m, **{k: got[k] for k in keep}, "identical_to_ar": same,
              "speedup_vs_ar": interval(False), "end_to_end_vs_ar": interval(True)}

    summary["main"] = entry(main)
    summary["compare"] = {m: entry(m) for m in others}
    summary["repeats"] = repeats
    best = best_fixed(main, summary["compare"])
    if best is not None:
      summary["main_vs_best_fixed"] = against_best_fixed(
          summary["main"], summary["compare"][best], per_method[main], per_method[best],
          engine.batch_size)
  with open(cfg.output + ".summary.json", "w") as f:
    json.dump(summary, f, indent=2)
  if cfg.report:
    from bp_jax.eval.plots import acceptance_histogram
    os.makedirs(cfg.report, exist_ok=True)
    what = f"b={choice.fixed}" if choice.name == "fixed" else f"block_policy={choice.name}"
    acceptance_histogram([a for r in records for a in r["acceptance_lengths"]],
                         os.path.join(cfg.report, "acceptance_hist.png"),
                         title=f"acceptance lengths per speculative cycle ({cfg.mode}, {what})")
    if choice.name != "fixed":
      from bp_jax.eval.report import size_distribution_plot
      size_distribution_plot({choice.name: [r["block_size"] for r in records]}, choice.sizes,
                             os.path.join(cfg.report, "chosen_sizes.png"))
  bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
  for r in records[:cfg.show]:
    tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
    print(f"--- {r['id']} ({r['new_tokens']} tokens, tau {tau})\n{prompt_tail(r['prompt'])}"
          f"{bold}{r['text']}{plain}")
  return records, summary
