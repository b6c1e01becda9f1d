"""The demo's held-out prompts, shared by the benchmarks."""

from __future__ import annotations


def heldout_prompts(tok, limit: int = 0) -> list[tuple[str, list[int]]]:
  """(key, token ids) of the BlockPilot evaluation half of HumanEval (configs/demo.py's split:
  never labelled on), the first `limit` (0 = all)."""
  from configs import demo
  from bp_jax.text.tokenizer import encode_prompt
  from bp_jax.train.labels import prompt_sets
  _, evals = prompt_sets(demo.get_config(), tok)
  evals = evals[:limit] if limit > 0 else evals
  return [(p.key, encode_prompt(tok, p.text, False)) for p in evals]
