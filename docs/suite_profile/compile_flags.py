"""One fresh process compiling and running a toy engine's programs (the tests' zeros-drafter
pair: one-request AR and b=4 loops, a batch of 3 in 4 slots at T = 0 and T = 1), printing the
seconds JAX reports for tracing, lowering and XLA's backend compilation, and an md5 of the
tokens. Run under the suite's XLA flags (tests/conftest.py; compile_flags.txt was measured
under the first two, before the third joined them) plus one candidate flag, alternating:

  BASE="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false \
        --xla_cpu_parallel_codegen_split_count=1"
  JAX_PLATFORMS=cpu XLA_FLAGS="$BASE --xla_cpu_use_thunk_runtime=false" \
    python docs/suite_profile/compile_flags.py
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]

import jax  # noqa: E402
from jax_times import EVENTS  # noqa: E402  (this folder: the suite plugin's event names)

SECONDS = dict.fromkeys(EVENTS.values(), 0.0)


def _listener(event: str, duration: float, **_) -> None:
  name = EVENTS.get(event.rsplit("/", 1)[-1])
  if name:
    SECONDS[name] += duration


def main() -> None:
  jax.monitoring.register_event_duration_secs_listener(_listener)
  from toy_models import zeros_drafter_pair

  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import BatchOptions, ShapeOptions
  started = time.perf_counter()
  target, drafter = zeros_drafter_pair(64)
  shapes = ShapeOptions(max_len=64, length_buckets=(32,), block_sizes=(1, 4))
  one = Engine(target, drafter=drafter, shapes=shapes)
  outs = [one.generate([5, 17, 3, 9], max_new_tokens=20, block_size=b).output_ids for b in (1, 4)]
  many = Engine(target, drafter=drafter, shapes=shapes,
                batching=BatchOptions(batch_size=4, sync_cycles=3))
  prompts = [[5, 17, 3], [9, 8, 7, 6], [1, 2]]
  outs += [g.output_ids for g in many.generate_batch(prompts, max_new_tokens=16, block_size=4)]
  outs += [g.output_ids for g in many.generate_batch(prompts, max_new_tokens=16, block_size=4,
                                                     temperature=1.0, seeds=1)]
  print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""),
                    "wall_s": round(time.perf_counter() - started, 2),
                    **{k: round(v, 2) for k, v in SECONDS.items()},
                    "tokens_md5": hashlib.md5(str(outs).encode()).hexdigest()[:8]}))


if __name__ == "__main__":
  main()
