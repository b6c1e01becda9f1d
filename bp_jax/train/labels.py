"""The `labels` stage: BlockPilot's oracle labels (docs/design.md §5).

Every prompt of the labelling set (and, separately, of the evaluation set) is decoded once per
candidate block size with the trained target and drafter (`<workdir>/target`, `<workdir>/drafter`).
Per prompt and size we record τ (committed tokens per speculative cycle), tokens per target
forward, committed and new tokens, speculative cycles, target forwards (cycles and the AR
fallback's steps), the loop's wall time and every forward's committed tokens (the fields:
`label_sets` docstring), plus the prompt's policy features from the prefill (`policy_features`,
the same jitted prefill decoding uses). Two TFDS datasets in `<workdir>/data`:

  policy_labels       labelling prompts: the policy is trained (and validated) on these only;
  policy_eval_labels  evaluation prompts: for the oracle row and analysis, never for training.

Each dataset's TFDS metadata records the decode settings it was measured with (new tokens,
temperature, chat, the loops' form: `label_sets.decode_settings`); decode.py's oracle policy
refuses a label set made with settings other than its own.

Settings: `cfg.blockpilot` (`configs/qwen3.py: blockpilot_config`). Prompt sets: the prompts
of `eval_source` (default HumanEval) are split by id with `split_ids` into a labelling part and
an evaluation part (`eval_frac`); the labelling set may add every prompt of `label_sources` and
`corpus_prompts` windows cut from the LM's training files.
Labelling and evaluation prompts never share a text (SHA-256, `policy.prompt_hash`): overlap is
refused.

Label rules, computed from the stored measurements when needed (`label_values`):
  max_tau         the size with the highest τ (the paper's label);
  max_throughput  the size with the most committed tokens per second, where a cycle of size b
                  costs the median over prompts of (loop time / cycles) at size b
                  (`cycle_costs`): one robust cost per bucket instead of one noisy timing per
                  prompt (a cycle's cost barely depends on the position: attention runs over the
                  whole static cache). Labels measured with AR fallback steps
                  (`--config.ar_fallback`) mix cycles and AR steps in proportions that vary
                  by prompt, so no per-forward cost applies: there each prompt's own measured
                  loop time is used (`decode_seconds`).
Ties go to the smaller size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any, Mapping, Sequence

import numpy as np

from bp_jax.data import tfds_io
from bp_jax.errors import BadInputError
from bp_jax.data.label_sets import (EVAL_LABELS, LABELS, SIZE_FIGURES, cycle_costs,
                                      decode_settings, label_set_costs, label_set_settings,
                                      label_values, labels_of, open_label_set, stack, usable,
                                      write_label_set)
from bp_jax.policy.mlp import LABEL_RULES, prompt_hash
from bp_jax.policy.features import FEATURE_TYPES, parse_feature_types
from bp_jax.text.prompts import HUMANEVAL, check_disjoint, load_prompts, split_ids
from bp_jax.train import cost_table as costs
from bp_jax.train import workdir as wd

STAMP_DIR = "labels"  # <workdir>/data/labels/bp_jax_stage.json


# ---- prompts ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LabelPrompt:
  """One prompt of a labelling or evaluation set."""
  key: str                        # "<source>:<id>", unique across sources
  source: str
  text: str
  ids: tuple[int, ...] | None = None  # token ids when given directly (corpus windows)

  @property
  def hash(self) -> str:
    return prompt_hash(self.text)


def _sources(text: str) -> list[str]:
  return [s.strip() for s in str(text or "").split(",") if s.strip()]


def _corpus_prompts(cfg: Any, tok: Any, num: int, prompt_tokens: int) -> list[LabelPrompt]:
  """`num` windows of `prompt_tokens` tokens from the LM's training files (as the regenerate
  stage cuts them, with another seed)."""
  from bp_jax.train.regenerate import cut_prompts, source_documents

  source, docs = source_documents(cfg)
  windows = cut_prompts(docs, tok, prompt_tokens, 4 * prompt_tokens, num,
                        int(cfg.seed) + 7_777)
  return [LabelPrompt(f"corpus:{pid}", source, tok.decode(ids), tuple(int(t) for t in ids))
          for pid, ids in windows]


def prompt_sets(cfg: Any, tok: Any = None) -> tuple[list[LabelPrompt], list[LabelPrompt]]:
  """(labelling prompts, evaluation prompts) of `cfg.blockpilot` (see the module docstring).

  Raises:
    BadInputError: a bad source or fraction, an empty part, or a labelling prompt whose text is
      also an evaluation prompt.
  """
  from bp_jax.train.regenerate import check_not_humaneval

  bp = cfg.blockpilot
  frac = float(bp.eval_frac)
  if not 0.0 < frac < 1.0:
    raise BadInputError(f"--config.blockpilot.eval_frac={frac} must lie in (0, 1)")
  source = str(bp.eval_source)
  base = load_prompts(source)
  parts = split_ids([p.id for p in base], {"label": 1.0 - frac, "eval": frac},
                    int(bp.split_seed))
  by_id = {p.id: p for p in base}
  label = [LabelPrompt(f"{source}:{i}", source, by_id[i].text) for i in sorted(parts["label"])]
  evals = [LabelPrompt(f"{source}:{i}", source, by_id[i].text) for i in sorted(parts["eval"])]
  for extra in _sources(bp.label_sources):
    prompts = load_prompts(extra)
    if source == HUMANEVAL:
      check_not_humaneval(extra, prompts, "--config.blockpilot.label_sources")
    label += [LabelPrompt(f"{extra}:{p.id}", extra, p.text) for p in prompts]
  if int(bp.corpus_prompts) > 0:
    if tok is None:
      raise BadInputError("corpus labelling prompts need the tokenizer")
    label += _corpus_prompts(cfg, tok, int(bp.corpus_prompts), int(bp.corpus_prompt_tokens))
  limit = int(bp.get("limit", 0) or 0)
  if limit > 0:  # a quick run: the first N of each part (still disjoint)
    label, evals = label[:limit], evals[:limit]
  if not label or not evals:
    raise BadInputError(f"--config.blockpilot: {len(label)} labelling and {len(evals)} "
                        "evaluation prompts; both sets must be non-empty")
  check_no_overlap(label, evals)
  return label, evals


def check_no_overlap(label: Sequence[LabelPrompt], evals: Sequence[LabelPrompt]) -> None:
  """Refuses labelling and evaluation sets that share a prompt (by key or by text)."""
  keys = {p.key for p in label}
  if len(keys) != len(label):
    raise BadInputError("labelling prompts: the same <source>:<id> appears twice")
  check_disjoint({"labelling": [p.key for p in label], "evaluation": [p.key for p in evals]})
  eval_by_hash = {p.hash: p for p in evals}
  for p in label:
    if p.hash in eval_by_hash:
      raise BadInputError(
          f"labelling prompt {p.key!r} has the same text as evaluation prompt "
          f"{eval_by_hash[p.hash].key!r}: labelling and evaluation prompts must never overlap "
          "(--config.blockpilot.label_sources / eval_source)")


def candidate_sizes(bp: Any, drafter_block_size: int) -> tuple[int, ...]:
  """`bp.candidates`, or the drafter's training size +- `bp.radius` (sizes >= 2), plus 1 (plain
  AR decoding) with `bp.include_ar`; ascending."""
  from bp_jax.decode_job.block_choice import parse_int_list

  sizes = parse_int_list(bp.candidates, "--config.blockpilot.candidates")
  if not sizes:
    r = int(bp.radius)
    sizes = tuple(range(max(2, drafter_block_size - r), drafter_block_size + r + 1))
  if len(set(sizes)) != len(sizes) or min(sizes) < 1:
    raise BadInputError(f"--config.blockpilot.candidates={list(sizes)}: give distinct sizes >= 1 "
                        "(1 = plain AR decoding)")
  if bool(bp.get("include_ar", False)) and 1 not in sizes:
    sizes = (1,) + tuple(sizes)
  if len(sizes) < 2:
    raise BadInputError("--config.blockpilot.candidates: a policy needs at least 2 sizes")
  return tuple(sorted(sizes))


# ---- measurement -----------------------------------------------------------------------------


def encode(prompt: LabelPrompt, tok: Any, chat: bool) -> list[int]:
  from bp_jax.text.tokenizer import encode_prompt

  return list(prompt.ids) if prompt.ids is not None else encode_prompt(tok, prompt.text, chat)


def _size_figures(gens: Sequence[Any]) -> dict[str, float]:
  """One size's figures over its runs (one per seed): totals, τ = committed tokens per
  speculative cycle and tokens per target forward, both pooled over the runs."""
  cycle_tokens = sum(sum(g.acceptance_lengths) for g in gens)
  committed = sum(sum(g.forward_lengths) for g in gens)
  cycles = sum(g.cycles for g in gens)
  forwards = sum(g.target_forwards for g in gens)
  return {"tau": cycle_tokens / cycles if cycles else 0.0,
          "tokens_per_forward": committed / forwards if forwards else 0.0,
          "committed": committed, "new_tokens": sum(g.new_tokens for g in gens),
          "cycles": cycles, "forwards": forwards, "decode_s": sum(g.decode_s for g in gens)}


def measure_prompt(engine: Any, ids: Sequence[int], sizes: Sequence[int], *, max_new_tokens: int,
                   temperature: float, seed: int, num_seeds: int = 1,
                   order_seed: int = 0, sampling: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
  """Decodes one prompt at every size (`num_seeds` times each, seeds `seed + 7919 * s`); the
  sizes run in a per-prompt shuffled order so that slow phases of the machine do not always
  hit the same size. `sampling`: `Engine.generate`'s top_k / top_p / min_p.

  Returns [K] arrays (`_size_figures`): "tau" (committed tokens per speculative cycle; with
  several seeds pooled over their cycles), "tokens_per_forward" (pooled likewise), and summed
  over the seeds "committed" (tokens committed by the loop: new tokens - 1 per run),
  "new_tokens", "cycles" (speculative cycles), "forwards" (target forwards: cycles and the AR
  fallback's steps), "decode_s" (loop seconds); the loops that ran: "accept_lens" (every
  forward's committed tokens) and "forward_is_cycle" (whether it was a cycle), size after size
  (in `sizes` order, seeds consecutive, forwards in loop order); "prefill_s" (mean) and
  "features": {name: [F]} (the first run's).
  """
  K = len(sizes)
  runs: list[list[Any]] = [[] for _ in range(K)]
  order = np.random.default_rng([int(order_seed) & 0xFFFFFFFF, 17]).permutation(K)
  for s in range(num_seeds):
    for k in order:
      runs[k].append(engine.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                     seed=seed + 7919 * s, block_size=int(sizes[k]),
                                     return_features=s == 0 and k == order[0],
                                     **(sampling or {})))
  per_size = [_size_figures(gens) for gens in runs]
  gens = [g for size_runs in runs for g in size_runs]
  out = {f: np.asarray([p[f] for p in per_size], t) for f, t in SIZE_FIGURES.items()}
  out["accept_lens"] = np.asarray([a for g in gens for a in g.forward_lengths], np.int32)
  out["forward_is_cycle"] = np.asarray([c for g in gens for c in g.forward_is_cycle], np.bool_)
  out["prefill_s"] = float(np.mean([g.prefill_s for g in gens]))
  out["features"] = runs[order[0]][0].features
  return out


# ---- datasets ---------------------------------------------------------------------------------


def label_record(prompt: LabelPrompt, split: str, prompt_len: int, sizes: Sequence[int],
                 m: Mapping[str, Any], ar_fallback: int = 0) -> dict[str, Any]:
  """One dataset example from `measure_prompt`'s output (`ar_fallback`: the engine's)."""
  rec = {"key": prompt.key, "source": prompt.source, "text_hash": prompt.hash, "split": split,
         "prompt_len": int(prompt_len), "prefill_s": float(m["prefill_s"]),
         "ar_fallback": int(ar_fallback),
         "block_sizes": np.asarray(sizes, np.int32),
         **{k: m[k] for k in (*SIZE_FIGURES, "accept_lens", "forward_is_cycle")}}
  for f, v in (m["features"] or {}).items():
    rec[f"feat_{f}"] = np.asarray(v, np.float32)
  return rec


def read_label_set(cfg: Any, name: str, stage: str) -> list[dict[str, Any]]:
  """All examples of label dataset `name` of the workdir (made by the labels stage)."""
  wd.require_dataset(cfg, name, stage, "labels")
  return list(open_label_set(os.path.join(wd.data_dir(cfg), name)))


def read_label_costs(cfg: Any, name: str, records: Sequence[Mapping[str, Any]]
                     ) -> Mapping[str, Any] | np.ndarray:
  """What prices label dataset `name`'s throughput labels: its cost table, or for a set made
  before cost tables the per-size cycle costs from its own timings (`cycle_costs`)."""
  table = label_set_costs(open_label_set(os.path.join(wd.data_dir(cfg), name)))
  return table if table is not None else cycle_costs(records)


# ---- the stage -------------------------------------------------------------------------------


def _stamp_of(prompts: Sequence[LabelPrompt]) -> str:
  return hashlib.sha256("\n".join(p.key + "\t" + p.hash for p in prompts).encode()).hexdigest()[:16]


def load_models(cfg: Any, stage: str) -> tuple[Any, Any, Any, str]:
  """(target, drafter, tokenizer, target fingerprint) of the workdir, checked to belong together."""
  from bp_jax.weights.loading import load_drafter, load_target
  from bp_jax.text.tokenizer import load_tokenizer
  from bp_jax.train.draft import check_drafter_target
  from bp_jax.train.regenerate import model_fingerprint

  target_path = wd.require_checkpoint(wd.target_dir(cfg), "qwen3", stage, "lm")
  drafter_path = wd.require_checkpoint(wd.drafter_dir(cfg), "dflash", stage, "draft")
  dtype = cfg.get("dtype") or None
  target = load_target(target_path, dtype)
  check_drafter_target(drafter_path, target, target_path)
  drafter = load_drafter(drafter_path, target.cfg, dtype)
  return target, drafter, load_tokenizer(target_path), model_fingerprint(target)


def build_engine(cfg: Any, target: Any, drafter: Any, tok: Any, sizes: Sequence[int],
                 prompt_lens: Sequence[int], max_new: int, **override: Any):
  """An engine with the candidate sizes, its loops in decode.py's form as labels are measured
  (`block_choice.labelling_loop_options`: `priced` as `backoff`; `override`: loop options
  replaced), so measured cycle costs are the ones decode.py pays; every request is checked
  first."""
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import LoopOptions, ShapeOptions
  from bp_jax.decode_job.block_choice import labelling_loop_options, parse_int_list
  from bp_jax.text.tokenizer import stop_token_ids

  buckets = parse_int_list(cfg.get("length_buckets", ""), "--config.length_buckets") or None
  engine = Engine(target, stop_ids=stop_token_ids(tok), drafter=drafter,
                  shapes=ShapeOptions(max_len=int(cfg.max_len), length_buckets=buckets,
                                      block_sizes=tuple(sizes)),
                  loop=LoopOptions(**{**labelling_loop_options(cfg), **override}))
  for n in prompt_lens:
    engine.check_request(n, max_new, max(sizes))
  return engine


def _made_with(data_dir: str, name: str) -> tuple[dict | None, dict | None] | None:
  """(decode settings, cost-table key) label dataset `name` records (None where it records
  none: an older set), or None when it does not exist."""
  if not tfds_io.dataset_exists(data_dir, name):
    return None
  ds = open_label_set(os.path.join(data_dir, name))
  return label_set_settings(ds), (label_set_costs(ds) or {}).get("key")


def _holds_settings(data_dir: str, name: str, settings: Mapping[str, Any],
                    table_key: Mapping[str, Any] | None = None) -> bool:
  """Whether label dataset `name` exists, records the decode settings `settings` and (with
  `table_key`) is priced by a cost table measured under that key (a set made before either was
  recorded is labelled again)."""
  made = _made_with(data_dir, name)
  return made is not None and made[0] == dict(settings) and (
      table_key is None or made[1] == dict(table_key))


def label_cost_table(cfg: Any, engine: Any, target: Any, drafter: Any, tok: Any,
                     sizes: Sequence[int], key: Mapping[str, Any],
                     label_ids: Sequence[Sequence[int]], max_new: int,
                     loop: Mapping[str, Any]) -> tuple[dict, str]:
  """(this machine's cost table, "reused" | "measured" | "given"): `cost_table` module; measured
  on the first `cost_prompts` labelling prompts (`--config.blockpilot`)."""
  from tqdm import tqdm

  bp = cfg.blockpilot
  n_prompts, reps = int(bp.get("cost_prompts", 4)), int(bp.get("cost_reps", 8))
  if n_prompts < 1 or reps < 1:
    raise BadInputError("--config.blockpilot.cost_prompts and cost_reps must be >= 1")

  def measure() -> dict:
    # Forced drafts are the perfect drafter, not draws: the table's decodes verify with `exact`
    # (at T = 0 the same computation as `rejection`, whose sampling branch never runs).
    timing = engine if engine.verify == "exact" else build_engine(
        cfg, target, drafter, tok, sizes, [len(ids) for ids in label_ids], max_new,
        verify="exact")
    bar = lambda it: tqdm(it, desc="cost table", unit="rep", dynamic_ncols=True)
    return costs.measure_cost_table(timing, list(label_ids)[:n_prompts], sizes,
                                    new_tokens=max_new, reps=reps,
                                    with_fallback=loop["ar_fallback"] > 0, progress=bar)

  return costs.obtain_table(str(bp.get("cost_table", "auto") or "auto"),
                            os.path.join(wd.data_dir(cfg), costs.TABLE_FILE), key, measure,
                            sizes, loop["ar_fallback"] > 0)


def labels_stage(cfg: Any) -> None:
  """Writes `policy_labels` and `policy_eval_labels` to `<workdir>/data` (module docstring).

  Skipped when both exist and were made with the same settings, prompts and models.
  """
  from tqdm import tqdm

  from bp_jax.decode_job.block_choice import (labelling_loop_options, sampling_form,
                                              sampling_options)
  from bp_jax.train.regenerate import model_fingerprint, read_stamp, write_stamp

  bp = cfg.blockpilot
  # The measured loops' form (cycle costs and labels depend on it): `priced` labels as backoff.
  loop = labelling_loop_options(cfg)
  if loop["controller"] == "confidence":
    raise BadInputError("--config.controller=confidence: label sets price every cycle as a "
                        "whole-block verify and replay backoff's miss rule (the cost table); "
                        "label with --config.controller=none, backoff or priced")
  sampling = sampling_options(cfg)
  target, drafter, tok, fingerprint = load_models(cfg, "labels")
  sizes = candidate_sizes(bp, drafter.cfg.block_size)
  parse_feature_types(bp.features)
  max_new, temperature = int(bp.max_new_tokens), float(bp.temperature)
  seeds = int(bp.label_seeds)
  if max_new < 2 or temperature < 0 or seeds < 1:
    raise BadInputError("--config.blockpilot: max_new_tokens must be >= 2, temperature >= 0 "
                        "and label_seeds >= 1")
  if temperature == 0:
    seeds = 1  # greedy decoding is deterministic: more seeds would only repeat it
  label, evals = prompt_sets(cfg, tok)
  encoded = {p.key: encode(p, tok, bool(cfg.get("chat", False))) for p in label + evals}
  for p in label + evals:
    if not encoded[p.key] or max(encoded[p.key]) >= target.cfg.vocab_size:
      raise BadInputError(f"prompt {p.key!r}: empty or token ids beyond the target's vocabulary")
  data, stamp_dir = wd.data_dir(cfg), os.path.join(wd.data_dir(cfg), STAMP_DIR)
  want = {"stage": "labels", "sizes": list(sizes), "max_new_tokens": max_new,
          "temperature": temperature, "label_seeds": seeds, "seed": int(cfg.seed),
          "target_fingerprint": fingerprint, "drafter": drafter.cfg.to_hf_dict(),
          "drafter_fingerprint": model_fingerprint(drafter),  # a retrained drafter relabels
          "label_prompts": _stamp_of(label), "eval_prompts": _stamp_of(evals),
          "chat": bool(cfg.get("chat", False)), "max_len": int(cfg.max_len),
          "scan_layers": loop["scan_layers"],
          "ar_fallback": [loop["ar_fallback"], loop["ar_fallback_accept"]],
          "sampling": {**sampling, "verify": loop["verify"]},
          "feature_types": list(FEATURE_TYPES),  # every available feature is stored
          "record_format": 4}  # 4: priced by a cost table (3: tau per cycle, forwards)
  settings = decode_settings(max_new, temperature, bool(cfg.get("chat", False)), loop, sampling)
  key = costs.table_key(fingerprint, want["drafter_fingerprint"], loop, int(cfg.max_len),
                        str(cfg.get("dtype") or "auto"), sizes, max_new)
  stamp = read_stamp(stamp_dir)
  reuse_table = str(bp.get("cost_table", "auto") or "auto") == "auto"
  # The decodes (counts, features) are current when the stamp and settings match; the cost
  # table that prices them may still change (another machine's, or remeasured).
  made = [_made_with(data, name) for name in (LABELS, EVAL_LABELS)]
  decoded = (stamp is not None and all(stamp.get(k) == v for k, v in want.items())
             and all(m is not None and m[0] == settings for m in made))
  if decoded and reuse_table and all(m[1] == key for m in made):
    print(f"[labels] up to date: {data}/{LABELS}, {data}/{EVAL_LABELS}")
    return
  engine = build_engine(cfg, target, drafter, tok, sizes, [len(v) for v in encoded.values()],
                        max_new)
  t0 = time.perf_counter()
  used = sorted({engine.encode_padded(ids)[1] for ids in encoded.values()})
  engine.precompile(sizes, used, forms=(sampling_form(temperature, sampling),))
  print(f"[labels] {len(label)} labelling + {len(evals)} evaluation prompts x sizes "
        f"{list(sizes)} (T={temperature}, {max_new} new tokens); compiled in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  table, how = label_cost_table(cfg, engine, target, drafter, tok, sizes, key,
                                [encoded[p.key] for p in label], max_new, loop)
  print(f"[labels] cost table ({how}, {costs.TABLE_FILE}): {costs.describe(table)}", flush=True)
  counts = {}
  for split, name, prompts in (("label", LABELS, label), ("eval", EVAL_LABELS, evals)):
    if decoded:  # only the prices changed: the same records, priced by the new table
      records = list(open_label_set(os.path.join(data, name)))
      print(f"[labels] {name}: decodes up to date, priced by the new cost table", flush=True)
    else:
      records = [label_record(p, split, len(encoded[p.key]), sizes, measure_prompt(
          engine, encoded[p.key], sizes, max_new_tokens=max_new, temperature=temperature,
          seed=int(cfg.seed) + i, num_seeds=seeds, order_seed=i, sampling=sampling),
          loop["ar_fallback"]) for i, p in enumerate(tqdm(
              prompts, desc=f"labels {split}", unit="prompt", dynamic_ncols=True))]
    write_label_set(data, name, records, f"{len(records)} {split} prompts decoded at sizes "
                    f"{list(sizes)} (T={temperature}, {max_new} new tokens)", settings, table)
    counts[split] = summarize_labels(records, sizes, table)
  write_stamp(stamp_dir, {**want, "counts": counts, "cost_table": how,
                          "seconds": round(time.perf_counter() - t0, 1)})
  for split, c in counts.items():
    print(f"[labels] {split}: mean tau by size {c['mean_tau']}; cycle cost (ms) "
          f"{c['cycle_cost_ms']}; label counts {c['label_counts']}")
  print(f"[labels] wrote {data}/{LABELS} and {data}/{EVAL_LABELS} "
        f"({time.perf_counter() - t0:.1f} s)")


def summarize_labels(records: Sequence[Mapping[str, Any]], sizes: Sequence[int],
                     table: Mapping[str, Any] | None = None) -> dict:
  """Mean τ per size (over the usable prompts: those with a cycle at every size; a request whose
  first token is a stop token runs none), cycle cost per size (from the labels' own timings)
  and how often each size is the label, per rule (priced by the cost `table`)."""
  ok = usable(records)
  kept = [r for r, u in zip(records, ok) if u]
  taus = stack(kept, "tau").mean(axis=0) if kept else [float("nan")] * len(sizes)
  out = {"prompts": len(records), "usable": int(ok.sum()),
         "mean_tau": {str(b): round(float(v), 3) for b, v in zip(sizes, taus)},
         "cycle_cost_ms": {str(b): round(1e3 * float(c), 3) for b, c in
                           zip(sizes, cycle_costs(records))}, "label_counts": {}}
  if kept:
    for rule in LABEL_RULES:
      lab = labels_of(label_values(kept, rule, table))
      out["label_counts"][rule] = {str(b): int((lab == k).sum()) for k, b in enumerate(sizes)}
  return out

