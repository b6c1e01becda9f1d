"""The decode job behind decode.py: load checkpoints, decode a prompt set, write records."""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from bp_jax.engine import Engine, Generation
from bp_jax.errors import BadInputError
from bp_jax.loading import load_drafter, load_target
from bp_jax.prompts import load_prompts
from bp_jax.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

MODES = ("ar", "spec")
BLOCK_POLICIES = ("fixed",)


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


def validate(cfg) -> None:
  if cfg.mode not in MODES:
    raise BadInputError(f"--config.mode={cfg.mode!r} is not one of {list(MODES)}")
  if cfg.block_policy not in BLOCK_POLICIES:
    raise BadInputError(f"--config.block_policy={cfg.block_policy!r} is not one of "
                        f"{list(BLOCK_POLICIES)}")
  if not cfg.target:
    raise BadInputError("--config.target is empty: give a converted target checkpoint folder")
  if cfg.mode == "spec" and not cfg.drafter:
    raise BadInputError("--config.mode=spec needs --config.drafter (a converted DFlash drafter)")
  if cfg.temperature < 0:
    raise BadInputError(f"--config.temperature={cfg.temperature} must be >= 0")


def build_engine(cfg) -> tuple[Engine, Any]:
  """Loads target, drafter and tokenizer and builds the engine described by `cfg`."""
  target = load_target(cfg.target, cfg.dtype)
  tok = load_tokenizer(cfg.tokenizer or cfg.target)
  drafter = None
  block_sizes = parse_int_list(cfg.block_sizes, "--config.block_sizes")
  if cfg.mode == "spec":
    drafter = load_drafter(cfg.drafter, target.cfg, cfg.dtype)
    block_sizes = block_sizes or default_block_sizes(drafter.cfg.block_size)
  engine = Engine(target, max_len=cfg.max_len, stop_ids=stop_token_ids(tok),
                  length_buckets=parse_int_list(cfg.length_buckets, "--config.length_buckets")
                  or None, drafter=drafter, block_sizes=block_sizes or (cfg.block_size,))
  return engine, tok


def record_of(i: int, prompt, g: Generation, tok) -> dict:
  return {"id": prompt.id, "index": i, "prompt": prompt.text, "prompt_tokens": g.prompt_len,
          "output_ids": g.output_ids, "text": tok.decode(g.output_ids, skip_special_tokens=False),
          "new_tokens": g.new_tokens, "prefill_s": round(g.prefill_s, 6),
          "decode_s": round(g.decode_s, 6), "block_size": g.block_size,
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
      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
  }


def print_summary(s: dict) -> None:
  rows = [("mode", s["mode"]), ("prompts", s["prompts"]), ("new tokens", s["new_tokens"]),
          ("tokens/s (prefill+decode)", s["tokens_per_s"]),
          ("decode tokens/s", s["decode_tokens_per_s"]), ("tau", s["tau"]),
          ("compilations", f"{s['compilations']} {s['compilations_by_function']}"),
          ("compile time (s)", s["compile_s"]), ("peak RSS (MB)", s["peak_rss_mb"])]
  width = max(len(k) for k, _ in rows)
  print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))


def run(cfg) -> tuple[list[dict], dict]:
  validate(cfg)
  engine, tok = build_engine(cfg)
  block_size = cfg.block_size if cfg.mode == "spec" else 1
  engine.check_block_size(block_size)
  if cfg.precompile:
    sizes = engine.block_sizes if cfg.mode == "spec" else (1,)
    comp = engine.precompile(sizes)
    for key, secs in comp["per_key_s"].items():
      print(f"  compiled {key}: {secs:.2f} s")
  prompts = load_prompts(cfg.prompts, cfg.num_prompts or None)
  encoded = [encode_prompt(tok, p.text, cfg.chat) for p in prompts]
  for p, ids in zip(prompts, encoded):  # fail before decoding anything
    try:
      engine.check_request(len(ids), cfg.max_new_tokens, block_size)
    except BadInputError as e:
      raise BadInputError(f"prompt {p.id!r}: {e}") from None
  os.makedirs(os.path.dirname(os.path.abspath(cfg.output)), exist_ok=True)
  records, t0 = [], time.perf_counter()
  tmp_out = cfg.output + ".partial"
  with open(tmp_out, "w") as f:
    for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc=f"decoding ({cfg.mode})",
                                      unit="prompt")):
      g = engine.generate(ids, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          seed=cfg.seed + i, block_size=block_size)
      rec = record_of(i, p, g, tok)
      records.append(rec)
      f.write(json.dumps(rec) + "\n")
  os.replace(tmp_out, cfg.output)
  summary = summarize(records, engine, cfg, time.perf_counter() - t0)
  with open(cfg.output + ".summary.json", "w") as f:
    json.dump(summary, f, indent=2)
  if cfg.report:
    from bp_jax.plots import acceptance_histogram
    os.makedirs(cfg.report, exist_ok=True)
    acceptance_histogram([a for r in records for a in r["acceptance_lengths"]],
                         os.path.join(cfg.report, "acceptance_hist.png"),
                         title=f"acceptance lengths ({cfg.mode}, b={block_size})")
  for r in records[:cfg.show]:
    print(f"--- {r['id']} ({r['new_tokens']} tokens, tau {r['tau']:.2f})\n{r['prompt'][-300:]}"
          f"\033[1m{r['text']}\033[0m")
  return records, summary
