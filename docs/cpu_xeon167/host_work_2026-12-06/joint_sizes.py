"""The demo's joint size per batch size (`Engine.joint_size`) and what its prior expects per size.

  PYTHONPATH=. python docs/cpu_xeon167/host_work_2026-12-06/joint_sizes.py

At this machine's start-up prices (measured, or read from the cost cache), and at an
accelerator's kind of given costs (a verify of 1/2/4/8 tokens at 1/1.02/1.05/1.1 AR steps, the
drafter pass at 0.05), batch 8.
"""
import numpy as np

from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.policy.mlp import load_policy
from bp_jax.weights.loading import load_drafter, load_target


def main() -> None:
  target = decode_form(load_target("demo/target"))
  drafter = load_drafter("demo/drafter", target.cfg)
  policy, info = load_policy("demo/policy")
  sizes = tuple(int(b) for b in info.block_sizes)
  prior = np.asarray(policy.value_prior[...], np.float64)
  C = len(sizes)
  cases = [(B, {}) for B in (4, 8, 16)] + [
      (8, dict(controller_costs="1,1.02,1.05,1.1", controller_draft_cost=0.05))]
  for batch, given in cases:
    engine = Engine(target, drafter=drafter, policy=policy, policy_sizes=sizes,
                    shapes=ShapeOptions(max_len=640, block_sizes=tuple(sorted({1, 8, *sizes}))),
                    loop=LoopOptions(controller="priced", ar_fallback=64, online_costs=True,
                                     start_backoff=True, start_plain=True, **given),
                    batching=BatchOptions(batch_size=batch))
    cycle, step = engine.policy_prices()
    per_token = prior[:C] * cycle + prior[C:] * step
    spec = {b: per_token[i] for i, b in enumerate(sizes) if b > 1}
    best = min(spec, key=spec.get)
    print(f"batch {batch} ({'given' if given else engine.costs_source} costs): cycle prices "
          f"{np.round(cycle[1:], 2).tolist()}; cheapest by the prior {best} "
          f"({100 * (1 - spec[best] / spec[8]):.2f}% under 8); joint size {engine.joint_size}")


if __name__ == "__main__":
  main()
