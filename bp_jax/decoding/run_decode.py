"""The decode job behind decode.py: load checkpoints, decode a prompt set, write records.

Block size per request (`--config.block_policy`, mode=spec):
  fixed    `--config.block_size` for every request;
  learned  the trained policy at `--config.policy` picks a bucket from each request's prefill
           (inside the prefill jit); prompts it was labelled on are refused, or skipped with
           `--config.labelled_prompts=skip`;
  oracle   each prompt's best size under `--config.label_rule`, read from a labels dataset
           (`--config.oracle_labels`, written by train.py --config.stage=labels): analysis only;
  random   uniform over the candidate sizes, seeded by (--config.seed, prompt index): the control.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from bp_jax.decoding.engine import LEARNED, Engine, Generation
from bp_jax.errors import BadInputError
from bp_jax.weights.loading import load_drafter, load_target
from bp_jax.text.prompts import Prompt, load_prompts
from bp_jax.eval.resources import peak_rss_mb
from bp_jax.text.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

MODES = ("ar", "spec")
BLOCK_POLICIES = ("fixed", "learned", "oracle", "random")
LABELLED_PROMPTS = ("refuse", "skip")


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
  if not text:
    return ()
  try:
    return tuple(int(x) for x in str(text).split(",") if x.strip())
  except ValueError:
    raise BadInputError(f"{flag}={text!r}: expected comma-separated integers") from None


def default_block_sizes(train_block_size: int, radius: int = 4) -> tuple[int, ...]:
  """The drafter's training block size +- radius (at least 2)."""
  return tuple(range(max(2, train_block_size - radius), train_block_size + radius + 1))


POLICY_RADIUS = 3  # candidates of the random control by default: training size +- 3 (DESIGN §5)


def validate(cfg) -> None:
  if cfg.mode not in MODES:
    raise BadInputError(f"--config.mode={cfg.mode!r} is not one of {list(MODES)}")
  if cfg.block_policy not in BLOCK_POLICIES:
    raise BadInputError(f"--config.block_policy={cfg.block_policy!r} is not one of "
                        f"{list(BLOCK_POLICIES)}")
  if cfg.block_policy != "fixed" and cfg.mode != "spec":
    raise BadInputError(f"--config.block_policy={cfg.block_policy} chooses speculative block "
                        "sizes: it needs --config.mode=spec")
  if cfg.block_policy == "learned" and not cfg.policy:
    raise BadInputError("--config.block_policy=learned needs --config.policy (a policy "
                        "checkpoint written by train.py --config.stage=policy)")
  if cfg.block_policy == "oracle" and not cfg.get("oracle_labels", ""):
    raise BadInputError("--config.block_policy=oracle needs --config.oracle_labels (a labels "
                        "dataset folder written by train.py --config.stage=labels)")
  if cfg.get("labelled_prompts", "refuse") not in LABELLED_PROMPTS:
    raise BadInputError(f"--config.labelled_prompts={cfg.labelled_prompts!r} is not one of "
                        f"{list(LABELLED_PROMPTS)}")
  if not cfg.target:
    raise BadInputError("--config.target is empty: give a converted target checkpoint folder")
  if cfg.mode == "spec" and not cfg.drafter:
    raise BadInputError("--config.mode=spec needs --config.drafter (a converted DFlash drafter)")
  if cfg.temperature < 0:
    raise BadInputError(f"--config.temperature={cfg.temperature} must be >= 0")


@dataclasses.dataclass
class BlockChoice:
  """How each request's block size is chosen (see the module docstring)."""
  name: str                               # fixed | learned | oracle | random
  fixed: int = 1                          # the size of `fixed`
  sizes: tuple[int, ...] = ()             # candidates of learned / oracle / random
  seed: int = 0                           # random: seeds the draws with the request index
  oracle: dict[str, int] | None = None    # oracle: prompt hash -> best size
  policy: Any = None                      # learned: the BlockPolicy ...
  info: Any = None                        # ... and its PolicyInfo

  def block_size(self, index: int, prompt: Prompt) -> int | str:
    """The engine's `block_size` argument for request `index`."""
    from bp_jax.policy.mlp import prompt_hash, random_block_size

    if self.name == "learned":
      return LEARNED
    if self.name == "random":
      return random_block_size(self.sizes, self.seed, index)
    if self.name == "oracle":
      size = self.oracle.get(prompt_hash(prompt.text))
      if size is None:
        raise BadInputError(f"prompt {prompt.id!r} is not in the oracle labels "
                            "(--config.oracle_labels); label it first")
      return size
    return self.fixed

  def largest(self) -> int:
    return max(self.sizes) if self.sizes else self.fixed


def resolve_block_choice(cfg, drafter_block_size: int | None) -> BlockChoice:
  """The `BlockChoice` of `cfg`; a learned policy whose folder is absent falls back to fixed
  (with a message) when `--config.policy_fallback` is set."""
  name = cfg.block_policy
  fixed = cfg.block_size if cfg.mode == "spec" else 1
  if name == "learned" and cfg.get("policy_fallback", False) and not os.path.isdir(cfg.policy):
    print(f"note: no trained block-size policy at {cfg.policy} (make one with train.py "
          "--config.stage=labels,policy); decoding with the fixed block size "
          f"{cfg.block_size} instead")
    name = "fixed"
  if name == "learned":
    from bp_jax.policy.mlp import load_policy
    policy, info = load_policy(cfg.policy)
    return BlockChoice(name, fixed, info.block_sizes, cfg.seed, policy=policy, info=info)
  if name == "oracle":
    from bp_jax.policy.label_sets import oracle_table
    table, sizes = oracle_table(cfg.oracle_labels, cfg.get("label_rule", "max_tau"))
    return BlockChoice(name, fixed, sizes, cfg.seed, oracle=table)
  if name == "random":
    sizes = parse_int_list(cfg.block_sizes, "--config.block_sizes")
    if not sizes and drafter_block_size is None:
      raise BadInputError("--config.block_policy=random needs --config.block_sizes or a drafter")
    sizes = sizes or default_block_sizes(drafter_block_size, POLICY_RADIUS)
    return BlockChoice(name, fixed, tuple(sizes), cfg.seed)
  return BlockChoice("fixed", fixed)


def loop_options(cfg) -> dict[str, Any]:
  """The decode loops' form set by a config, as `Engine` keyword arguments: `scan_layers`,
  `ar_fallback`, `ar_fallback_accept` (configs/qwen3.py)."""
  return {"scan_layers": bool(cfg.get("scan_layers", False)),
          "ar_fallback": int(cfg.get("ar_fallback", 0)),
          "ar_fallback_accept": int(cfg.get("ar_fallback_accept", 1))}


def build_engine(cfg, extra_sizes: Sequence[int] = ()) -> tuple[Engine, Any]:
  """Loads target, drafter and tokenizer and builds the engine described by `cfg`; the buckets
  are `--config.block_sizes` (or the drafter's size +- 4) plus `extra_sizes`."""
  target = load_target(cfg.target, cfg.dtype)
  tok = load_tokenizer(cfg.tokenizer or cfg.target)
  drafter = None
  block_sizes = parse_int_list(cfg.block_sizes, "--config.block_sizes")
  if cfg.mode == "spec":
    drafter = load_drafter(cfg.drafter, target.cfg, cfg.dtype)
    block_sizes = block_sizes or default_block_sizes(drafter.cfg.block_size)
  sizes = tuple(sorted(set(block_sizes or (cfg.block_size,)) | {b for b in extra_sizes if b > 1}))
  engine = Engine(target, max_len=cfg.max_len, stop_ids=stop_token_ids(tok),
                  length_buckets=parse_int_list(cfg.length_buckets, "--config.length_buckets")
                  or None, drafter=drafter, block_sizes=sizes, **loop_options(cfg))
  return engine, tok


def _drafter_block_size(cfg) -> int | None:
  if cfg.mode != "spec" or not cfg.drafter:
    return None
  from bp_jax.models.config import DFlashConfig, read_config_json
  return DFlashConfig.from_hf_dict(read_config_json(cfg.drafter),
                                   f"{cfg.drafter}/config.json").block_size


def select_prompts(cfg, choice: BlockChoice) -> list[Prompt]:
  """The prompts to decode: with a learned policy, those it was labelled on are refused (or
  skipped with --config.labelled_prompts=skip) before --config.num_prompts is applied."""
  if choice.name != "learned":
    return load_prompts(cfg.prompts, cfg.num_prompts or None)
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
  return prompts[:cfg.num_prompts] if cfg.num_prompts else prompts


def record_of(i: int, prompt, g: Generation, tok, block_policy: str = "fixed") -> dict:
  return {"id": prompt.id, "index": i, "prompt": prompt.text, "prompt_tokens": g.prompt_len,
          "output_ids": g.output_ids, "text": tok.decode(g.output_ids, skip_special_tokens=False),
          "new_tokens": g.new_tokens, "prefill_s": round(g.prefill_s, 6),
          "decode_s": round(g.decode_s, 6), "block_size": g.block_size,
          "block_policy": block_policy, "policy_probs": g.policy_probs,
          "acceptance_lengths": g.acceptance_lengths, "target_forwards": g.target_forwards,
          "tau": round(g.tau, 4)}


def summarize(records: list[dict], engine: Engine, cfg, wall_s: float) -> dict:
  new = sum(r["new_tokens"] for r in records)
  prefill = sum(r["prefill_s"] for r in records)
  decode = sum(r["decode_s"] for r in records)
  accepts = [a for r in records for a in r["acceptance_lengths"]]
  hist = collections.Counter(accepts)
  comp = engine.compiled.summary()
  return {
      "mode": cfg.mode, "block_policy": cfg.block_policy, "temperature": cfg.temperature,
      "prompts": len(records), "new_tokens": new,
      "tokens_per_s": round(new / max(prefill + decode, 1e-9), 3),
      "decode_tokens_per_s": round(new / max(decode, 1e-9), 3),
      "prefill_s": round(prefill, 4), "decode_s": round(decode, 4), "wall_s": round(wall_s, 3),
      "tau": round(float(np.mean(accepts)), 4) if accepts else 0.0,
      "mean_request_tau": round(float(np.mean([r["tau"] for r in records])), 4) if records else 0.0,
      "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
      "block_sizes_used": dict(collections.Counter(str(r["block_size"]) for r in records)),
      "compilations": comp["compilations"], "compilations_by_function": comp["by_function"],
      "compile_s": comp["compile_s"], "compile_s_per_bucket": comp["per_key_s"],
      "loop_warmup_s": round(sum(engine.warmup_seconds.values()), 3),
      "peak_rss_mb": peak_rss_mb(),
  }


def print_summary(s: dict) -> None:
  rows = [("mode", s["mode"]), ("block policy", s["block_policy"]),
          ("block sizes used", s["block_sizes_used"]), ("prompts", s["prompts"]),
          ("new tokens", s["new_tokens"]),
          ("tokens/s (prefill+decode)", s["tokens_per_s"]),
          ("decode tokens/s", s["decode_tokens_per_s"]), ("tau", s["tau"]),
          ("compilations", f"{s['compilations']} {s['compilations_by_function']}"),
          ("compile time (s)", s["compile_s"]), ("loops' first runs (s)", s["loop_warmup_s"]),
          ("peak RSS (MB)", s["peak_rss_mb"])]
  width = max(len(k) for k, _ in rows)
  print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))


def run(cfg) -> tuple[list[dict], dict]:
  validate(cfg)
  choice = resolve_block_choice(cfg, _drafter_block_size(cfg))
  engine, tok = build_engine(cfg, choice.sizes)
  if choice.name == "learned":
    if choice.info.target_layer_ids and engine.drafter is not None and (
        tuple(engine.drafter.cfg.target_layer_ids) != choice.info.target_layer_ids):
      raise BadInputError(f"{cfg.policy}: the policy was trained on features of target layers "
                          f"{list(choice.info.target_layer_ids)} but the drafter {cfg.drafter} "
                          f"uses {list(engine.drafter.cfg.target_layer_ids)}")
    try:
      engine.set_policy(choice.policy, choice.info.block_sizes)
    except BadInputError as e:
      raise BadInputError(f"{cfg.policy}: {e}") from None
  if choice.name == "fixed":
    engine.check_block_size(choice.fixed)
  if cfg.precompile:
    if cfg.mode != "spec":
      sizes = (1,)
    elif choice.name == "fixed":
      sizes = engine.block_sizes
    else:
      sizes = choice.sizes
    comp = engine.precompile(sizes, policy=choice.name == "learned",
                             plain_prefill=choice.name != "learned")
    for key, secs in comp["per_key_s"].items():
      print(f"  compiled {key}: {secs:.2f} s")
  prompts = select_prompts(cfg, choice)
  encoded = [encode_prompt(tok, p.text, cfg.chat) for p in prompts]
  for p, ids in zip(prompts, encoded):  # fail before decoding anything
    try:
      engine.check_request(len(ids), cfg.max_new_tokens, choice.largest())
    except BadInputError as e:
      raise BadInputError(f"prompt {p.id!r}: {e}") from None
  sizes_of = [choice.block_size(i, p) for i, p in enumerate(prompts)]
  os.makedirs(os.path.dirname(os.path.abspath(cfg.output)), exist_ok=True)
  records, t0 = [], time.perf_counter()
  tmp_out = cfg.output + ".partial"
  with open(tmp_out, "w") as f:
    for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc=f"decoding ({cfg.mode})",
                                      unit="prompt")):
      g = engine.generate(ids, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          seed=cfg.seed + i, block_size=sizes_of[i])
      rec = record_of(i, p, g, tok, choice.name)
      records.append(rec)
      f.write(json.dumps(rec) + "\n")
  os.replace(tmp_out, cfg.output)
  summary = summarize(records, engine, cfg, time.perf_counter() - t0)
  summary["block_policy"] = choice.name
  if choice.name != "fixed":
    summary["candidate_block_sizes"] = list(choice.sizes)
  if choice.name == "learned":
    summary["policy"] = {"path": cfg.policy, "feature_type": choice.policy.arch.feature_type,
                         "label_rule": choice.info.label_rule,
                         "num_params": choice.policy.arch.num_params()}
  with open(cfg.output + ".summary.json", "w") as f:
    json.dump(summary, f, indent=2)
  if cfg.report:
    from bp_jax.eval.plots import acceptance_histogram
    os.makedirs(cfg.report, exist_ok=True)
    what = f"b={choice.fixed}" if choice.name == "fixed" else f"block_policy={choice.name}"
    acceptance_histogram([a for r in records for a in r["acceptance_lengths"]],
                         os.path.join(cfg.report, "acceptance_hist.png"),
                         title=f"acceptance lengths ({cfg.mode}, {what})")
    if choice.name != "fixed":
      from bp_jax.eval.report import size_distribution_plot
      size_distribution_plot({choice.name: [r["block_size"] for r in records]}, choice.sizes,
                             os.path.join(cfg.report, "chosen_sizes.png"))
  for r in records[:cfg.show]:
    print(f"--- {r['id']} ({r['new_tokens']} tokens, tau {r['tau']:.2f})\n{r['prompt'][-300:]}"
          f"\033[1m{r['text']}\033[0m")
  return records, summary
