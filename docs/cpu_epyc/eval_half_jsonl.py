"""Writes the demo's BlockPilot evaluation half of HumanEval (82 prompts, never labelled on) as
a decode.py prompts file, so that the shipped default can be compared on the prompts the
benchmarks use:

  PYTHONPATH=. python docs/cpu_epyc/eval_half_jsonl.py /tmp/eval_half.jsonl
  python decode.py --config.prompts=/tmp/eval_half.jsonl --config.num_prompts=0 \
    --config.compare=ar,b8 --config.repeats=3
"""

from __future__ import annotations

import json
import sys

from benchmarks.common import demo_prompt_set
from configs import demo
from bp_jax.text.tokenizer import load_tokenizer


def main(path: str) -> None:
  chosen = demo_prompt_set(load_tokenizer(demo.get_config().target), "eval")
  with open(path, "w", encoding="utf-8") as f:
    for p in chosen:
      f.write(json.dumps({"id": p.key, "prompt": p.text}) + "\n")
  print(f"wrote {len(chosen)} prompts to {path}")


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: PYTHONPATH=. python docs/cpu_epyc/eval_half_jsonl.py OUT.jsonl")
  main(sys.argv[1])
