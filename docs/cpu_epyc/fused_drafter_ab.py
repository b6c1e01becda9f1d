"""The demo's paper loop (fixed block size 8, one request) with the drafter's per-layer weights
k|v and gate|up fused (`DFlashDrafter.loop_layers` with docs/cpu_epyc/drafter_kv_fusion.patch
applied: `git apply docs/cpu_epyc/drafter_kv_fusion.patch`; not landed) against the same engine
code given the drafter's separate matrices (a second engine's drafter weights replaced), both
with the target's fused weights, alternated round by round in one process: the first 8 prompts of
HumanEval's evaluation half, 128 new tokens, stop ids off, 5 timed rounds after a warm-up one.

    PYTHONPATH=. python docs/cpu_epyc/fused_drafter_ab.py [block_size]

Prints whether both give the same tokens (and AR's), and fused / separate time per request
with a 95% bootstrap interval over the paired requests.
"""

import sys

from benchmarks.common import demo_prompts
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.text.tokenizer import load_tokenizer
from bp_jax.weights.loading import load_drafter, load_target
from paired_ab import paired_ratio


def main() -> None:
  b = int(sys.argv[1]) if len(sys.argv) > 1 else 8
  target = decode_form(load_target("demo/target", "float32"))
  drafter = load_drafter("demo/drafter", target.cfg, "float32")
  prompts = [ids for _, ids in demo_prompts(load_tokenizer("demo/target"), "eval", limit=8)]
  build = lambda: Engine(target, drafter=drafter, stop_ids=[],
                         shapes=ShapeOptions(max_len=1024, block_sizes=(1, b)),
                         loop=LoopOptions(controller="none"))
  fused, separate = build(), build()
  assert "kv_proj" in fused.d_weights.layers[0]
  separate.d_weights = separate.d_weights._replace(layers=tuple(drafter.layers.per_layer()))
  engines = {"fused": fused, "separate": separate}
  outs = {name: [list(e.generate(p, max_new_tokens=128, block_size=b).output_ids)
                 for p in prompts] for name, e in engines.items()}
  ar = [list(fused.generate(p, max_new_tokens=128).output_ids) for p in prompts]
  print("same tokens", outs["fused"] == outs["separate"] == ar)
  decode = {name: (lambda p, e=e: e.generate(p, max_new_tokens=128, block_size=b))
            for name, e in engines.items()}
  print(f"b={b}: " + paired_ratio(decode, prompts, rounds=5, new_tokens=128))


if __name__ == "__main__":
  main()
