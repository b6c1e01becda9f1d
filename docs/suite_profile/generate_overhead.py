"""Host time of `Engine.generate` for a 3-token request on the sampling tests' tiny pair (the
work the statistical test repeats 5,000 times): ms per call over N calls after 5 warm ones.

  python docs/suite_profile/generate_overhead.py 600          # from the repository root
  PROF=1 python docs/suite_profile/generate_overhead.py 300   # with cProfile's top functions

Compare versions in alternating processes (docs/results/suite.md, thirty-first session)."""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
sys.path[:0] = [".", "tests"]

from sampling_stats import PROMPT, tiny_models  # noqa: E402

from bp_jax.decoding.engine import Engine  # noqa: E402
from bp_jax.decoding.options import ShapeOptions  # noqa: E402


def main(n: int) -> None:
  _, target, drafter = tiny_models()
  eng = Engine(target, drafter=drafter,
               shapes=ShapeOptions(max_len=32, length_buckets=(8,), block_sizes=(4,)))
  forced = list(range(1, 13))
  run = lambda seed: eng.generate(PROMPT, max_new_tokens=3, temperature=1.0, seed=seed,
                                  block_size=4, forced_continuation=forced)
  for seed in range(5):
    run(seed)
  prof = cProfile.Profile() if os.environ.get("PROF") else None
  t0 = time.perf_counter()
  if prof:
    prof.enable()
  for seed in range(n):
    run(seed)
  if prof:
    prof.disable()
  print(f"{(time.perf_counter() - t0) / n * 1e3:.2f} ms per generate")
  if prof:
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
