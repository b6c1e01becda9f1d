"""Methods compared inside one decode.py run (--config.compare, --config.repeats): each prompt
is decoded by every method, all interleaved per request in a shuffled order, N times each, the
fastest decode kept. Two runs of one command differ by tens of percent on a shared CPU, so a
speedup means something only inside one such run."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Mapping, Sequence

from bp_jax.decode_job.block_choice import BlockChoice, learned_choice, random_candidates
from bp_jax.decoding.generation import Generation
from bp_jax.errors import BadInputError
from bp_jax.eval.bootstrap import speedup_entry


def _size_of(method: str) -> int | None:
  """k of a method named `b<k>` (any k written in digits); None for any other name."""
  return int(method[1:]) if method[:1] == "b" and method[1:].isdigit() else None


def fixed_size(method: str) -> int | None:
  """k of a fixed-size speculative method `b<k>` (k > 1); None for ar, learned and random."""
  k = _size_of(method)
  return k if k is not None and k > 1 else None


def parse_methods(text: str) -> tuple[str, ...]:
  """--config.compare: comma-separated `ar`, `b<k>` (fixed block size k), `learned`, `random`."""
  out = []
  for m in (x.strip() for x in str(text or "").split(",")):
    if not m:
      continue
    ok = m in ("ar", "learned", "random") or (_size_of(m) or 0) >= 1
    if not ok:
      raise BadInputError(f"--config.compare: unknown method {m!r}; give comma-separated ar, "
                          "b<k> (a fixed block size k, e.g. b8), learned or random")
    out.append("ar" if m == "b1" else m)
  return tuple(dict.fromkeys(out))


def method_of(cfg, choice: "BlockChoice") -> str:
  """The name of the run's own method in comparisons: ar, b<k>, learned, oracle or random."""
  if cfg.mode != "spec":
    return "ar"
  return f"b{choice.fixed}" if choice.name == "fixed" else choice.name


def method_choice(method: str, main: "BlockChoice", cfg, drafter_block_size: int | None
                  ) -> "BlockChoice":
  """The BlockChoice of a comparison method (learned reuses the run's policy when it has one)."""
  if method == "ar":
    return BlockChoice("fixed", 1)
  if method.startswith("b"):
    return BlockChoice("fixed", int(method[1:]))
  if method == "learned":
    if main.name == "learned":
      return main
    if not cfg.policy or not os.path.isdir(cfg.policy):
      raise BadInputError(f"--config.compare=learned needs a policy at --config.policy "
                          f"({cfg.policy!r} is not a folder)")
    return learned_choice(cfg, main.fixed)
  sizes = main.sizes or random_candidates(cfg, drafter_block_size)
  return BlockChoice("random", main.fixed, sizes, cfg.seed)


def run_order(methods: Sequence[str], repeats: int, seed: int, index: int) -> list[str]:
  """Every method `repeats` times, shuffled per request (seeded: reproducible)."""
  order = [m for m in methods for _ in range(repeats)]
  random.Random(f"{seed}:{index}").shuffle(order)
  return order


def check_repeats_agree(gens: Sequence[Generation]) -> None:
  """Repeats of one request must give the same output (decoding is deterministic)."""
  first = gens[0].output_ids
  if any(g.output_ids != first for g in gens[1:]):
    raise RuntimeError("repeats of one request gave different outputs: decoding is not "
                       "deterministic here (please report this)")


def fastest_of(gens: Sequence[Generation]) -> Generation:
  """The repeat with the fastest decode (outputs of repeats are identical: checked)."""
  check_repeats_agree(gens)
  best = min(gens, key=lambda g: g.decode_s)
  return dataclasses.replace(best, prefill_s=min(g.prefill_s for g in gens))


def best_fixed(main: str, figures: Mapping[str, dict]) -> str | None:
  """The fixed block size in hindsight among the compared methods other than the run's own
  (`main`): the `b<k>` with the most decode tokens per second (`figures`: method -> its
  summary entry); None where no other fixed size was compared."""
  fixed = [m for m in figures if m != main and fixed_size(m) is not None]
  return max(fixed, key=lambda m: figures[m]["decode_tokens_per_s"], default=None)


def paired_speedup(records: Sequence[dict], base_records: Sequence[dict],
                   end_to_end: bool = False) -> dict | None:
  """A method's speed over another's on the same prompts (AR's, or the best fixed size's;
  records in prompt order, each request's fastest repeat: `new_tokens`, `decode_s`, and with
  `end_to_end` its `prefill_s`), with its 95% paired bootstrap interval over the prompts
  (`bp_jax.eval.bootstrap.speedup_entry`): {"ratio", "lo", "hi"}. `end_to_end`: over each
  request's prefill and decode seconds, what a user waits for (a drafting request's prefill
  also builds the drafter's context, which a plain one skips); else over its decode alone. None
  for one prompt, where a resample is the prompt itself and says nothing of the spread."""
  if len(records) != len(base_records):
    raise ValueError(f"{len(records)} records against {len(base_records)}: the same prompts "
                     "are compared")
  if len(records) < 2:
    return None
  seconds = lambda rs: [r["decode_s"] + (r["prefill_s"] if end_to_end else 0.0) for r in rs]
  return speedup_entry([r["new_tokens"] for r in records], seconds(records),
                       [r["new_tokens"] for r in base_records], seconds(base_records))


def against_best_fixed(main: dict, best: dict, main_records: list[dict],
                       best_records: list[dict], batch_size: int) -> dict:
  """The run's own method against the best fixed block size in hindsight (`best_fixed`), in
  decode time and end to end: paired over the prompts where each request was timed alone
  (interleaved per request), the ratio of tokens per second alone in a batch, whose requests
  share their loop calls (their times are not the prompts' own)."""
  def ratio(whole: bool) -> dict | None:
    if batch_size == 1:
      return paired_speedup(main_records, best_records, end_to_end=whole)
    speed = "tokens_per_s" if whole else "decode_tokens_per_s"
    return {"ratio": round(main[speed] / best[speed], 4), "lo": None, "hi": None}
  return {"method": best["method"], "decode": ratio(False), "end_to_end": ratio(True)}
