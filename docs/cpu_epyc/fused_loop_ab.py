"""The demo target's one-request AR loop with the per-layer weights an engine takes
(`Engine._loop_weights`: q|k|v and gate|up fused, one product each) against the same engine
code given the separate matrices (a second engine's per-layer weights replaced), alternated
round by round in one process: 4 random 100-token prompts, 128 new tokens, 7 timed rounds.

    PYTHONPATH=. python docs/cpu_epyc/fused_loop_ab.py

Prints whether both give the same tokens, and fused / separate time per request with a 95%
bootstrap interval over the paired requests.
"""

import numpy as np

from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import ShapeOptions
from bp_jax.weights.loading import load_target
from paired_ab import paired_ratio


def main() -> None:
  target = decode_form(load_target("demo/target", "float32"))
  build = lambda: Engine(target, stop_ids=[], shapes=ShapeOptions(max_len=512,
                                                                   length_buckets=(128,)))
  fused, separate = build(), build()
  assert "qkv_proj" in fused.t_weights.layers[0]
  separate.t_weights = separate.t_weights._replace(layers=tuple(target.layers.per_layer()))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(10, 4000, size=100)) for _ in range(4)]
  same = all(list(fused.generate(p, max_new_tokens=128).output_ids)
             == list(separate.generate(p, max_new_tokens=128).output_ids) for p in prompts)
  print("same tokens", same)
  engines = {"fused": fused, "separate": separate}
  decode = {name: (lambda p, e=e: e.generate(p, max_new_tokens=128))
            for name, e in engines.items()}
  print(paired_ratio(decode, prompts, rounds=7, new_tokens=128))


if __name__ == "__main__":
  main()
