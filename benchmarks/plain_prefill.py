"""What prefilling without the drafter saves: the demo's AR requests (block size 1) on an
engine that has a drafter (`Engine.plain_prefill`), or with --policy its learned-size requests
(`Engine.defers_context`: the target's forward and the policy, the drafter's context built
afterwards only for a request that drafts), prefilled with the drafter's context (as before
2026-11-28, learned sizes before 2026-11-29) or without, in one process, the two arms
alternated pass by pass (the first pass compiles and is not counted).

  python -m benchmarks.plain_prefill --batch_size 4 --repeats 4 --out out/plain_prefill.json
  python -m benchmarks.plain_prefill --policy demo/policy --controller priced --batch_size 4

Each pass decodes the evaluation half's prompts through `generate_batch` in groups of
--group_size (streamed, as benchmarks/controllers.py's groups). Reported per arm: the
requests' prefill seconds (`Generation.prefill_s`: the prefill, a learned request's drafter
context where built after it and, in a batch, its insertion) and each pass's wall time; the
ratios without / with the drafter: prefill seconds summed over the passes, with a paired 95%
bootstrap interval over requests, and the fastest pass's wall time. Both arms must give the
same tokens (checked). With --policy, also each arm's requests that drafted and that decoded
plain (a learned request's route follows the start rule, which both arms share).

The "with" arm overrides the engine's own choice on its instance (`plain_prefill`, or
`defers_context`, returning False), the only difference between the arms.
"""

from __future__ import annotations

import json
import time

from absl import flags

from benchmarks import common
from bp_jax import cli

common.define_flags("target", "drafter", "max_len", "max_new_tokens", "repeats",
                    num_prompts=0, repeats=4,
                    helps={"repeats": "Timed passes per arm, after one that compiles."})
flags.DEFINE_integer("batch_size", 4, "Rows decoded together (1: one request at a time).")
flags.DEFINE_integer("group_size", 8, "Requests per generate_batch call.")
flags.DEFINE_string("policy", "", "A block-size policy checkpoint (demo/policy): its learned "
                    "sizes' requests are compared (their drafter context built in the prefill "
                    "or after it); '' compares block size 1's.")
flags.DEFINE_enum("controller", "none", ["none", "backoff", "priced"],
                  "The verify-length controller (priced: a learned request may start plain).")
flags.DEFINE_string("out", "", "Optional JSON output path.")
FLAGS = flags.FLAGS

ARMS = ("with_drafter", "target_only")


def main(argv):
  del argv
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
  from bp_jax.errors import BadInputError
  from bp_jax.eval.bootstrap import bootstrap_ratio_ci
  if FLAGS.repeats < 1 or FLAGS.batch_size < 1 or FLAGS.group_size < FLAGS.batch_size:
    raise BadInputError("--repeats and --batch_size must be >= 1, --group_size >= --batch_size")
  models = common.load_models(FLAGS)
  prompts = [ids for _, ids in common.demo_prompts(models.tokenizer, "eval",
                                                   limit=FLAGS.num_prompts)]
  policy, policy_sizes, sizes, block_size = None, (), (1, 8), 1
  if FLAGS.policy:
    from bp_jax.decoding.engine import LEARNED
    from bp_jax.policy.mlp import load_policy
    policy, info = load_policy(FLAGS.policy)
    policy_sizes, block_size = tuple(info.block_sizes), LEARNED
    sizes = tuple(sorted({1, *policy_sizes}))
  engine = Engine(models.target, drafter=models.drafter, stop_ids=models.stop_ids,
                  shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=sizes),
                  loop=LoopOptions(controller=FLAGS.controller),
                  batching=BatchOptions(batch_size=FLAGS.batch_size), policy=policy,
                  policy_sizes=policy_sizes)
  choice = "defers_context" if policy is not None else "plain_prefill"
  own_choice = getattr(engine, choice)
  routes = {arm: {"drafted": 0, "plain": 0} for arm in ARMS}
  prefill_s = {arm: [0.0] * len(prompts) for arm in ARMS}
  walls = {arm: [] for arm in ARMS}
  outputs = {}
  for rep in range(FLAGS.repeats + 1):  # pass 0 compiles; not counted
    for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
      setattr(engine, choice, own_choice if arm == "target_only" else (lambda *a, **k: False))
      t0 = time.perf_counter()
      gens = []
      for start in range(0, len(prompts), FLAGS.group_size):
        gens += engine.generate_batch(prompts[start:start + FLAGS.group_size],
                                      max_new_tokens=FLAGS.max_new_tokens,
                                      block_size=block_size)
      wall = time.perf_counter() - t0
      got = [g.output_ids for g in gens]
      if outputs.setdefault("tokens", got) != got:
        raise RuntimeError(f"pass {rep}, {arm}: tokens differ from the first pass's")
      if rep:
        walls[arm].append(wall)
        for i, g in enumerate(gens):
          prefill_s[arm][i] += g.prefill_s
          routes[arm]["plain" if g.plain_start or g.block_size == 1 else "drafted"] += 1
      print(f"  pass {rep} {arm}: wall {wall:.2f} s, prefill "
            f"{sum(g.prefill_s for g in gens):.2f} s{'' if rep else ' (compiles; not counted)'}",
            flush=True)
  ratio = bootstrap_ratio_ci(prefill_s["target_only"], prefill_s["with_drafter"])
  result = {"date": time.strftime("%Y-%m-%d"), "command": common.command_line(),
            "prompts": len(prompts), "batch_size": FLAGS.batch_size,
            "requests": "learned sizes" if policy is not None else "block size 1",
            "controller": FLAGS.controller,
            "group_size": FLAGS.group_size, "repeats": FLAGS.repeats,
            "prefill_s": {arm: round(sum(v), 3) for arm, v in prefill_s.items()},
            "walls_s": {arm: [round(w, 3) for w in v] for arm, v in walls.items()},
            "prefill_ratio_target_only_over_with": [round(x, 3) for x in ratio],
            "fastest_wall_ratio": round(min(walls["target_only"]) / min(walls["with_drafter"]),
                                        3),
            "routes": routes if policy is not None else None,
            "compiled_prefills": sorted("/".join(map(str, k)) for k in engine.compiled.seconds
                                        if k[0] == "prefill")}
  print(json.dumps(result, indent=1))
  if FLAGS.out:
    common.write_json(FLAGS.out, result, indent=1)


if __name__ == "__main__":
  cli.run(main, __doc__)
