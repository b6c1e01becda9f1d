"""Batched decoding on the demo: tokens/s and memory for batch sizes B x (AR, speculative b,
learned block size), on the held-out HumanEval prompts (the BlockPilot evaluation half).

  python -m benchmarks.batch_decode                       # B = 1, 4, 16; 32 prompts
  python -m benchmarks.batch_decode --batch_sizes 1,8 --methods ar --num_prompts 16

In one process, on the same prompts and weights (T = 0): every (B, method) decodes all prompts
`--repeats` times, the (B, method) pairs in a shuffled order per repeat, and the repeat with the
least wall time is kept. B = 1 is the one-request path decode.py takes at --config.batch_size=1
(`Engine.generate` per prompt); B > 1 is `Engine.generate_batch` (continuous batching,
--sync_cycles). Figures, one meaning each:
  tokens/s         all new tokens / wall time of the pass (prefills included)
  decode tokens/s  all new tokens / time in decode loops (prefills, insertions excluded)
  tau              mean over prompts of committed tokens per speculative cycle
  slot MB          the KV-cache (and drafter context cache) memory of the B slots of one bucket,
                   and per request: what batching costs in memory on any device
  peak RSS MB      the process's peak resident memory after the pass (monotone: an upper bound)
Every output must equal the B = 1 output of its method (checked). Writes <out>/batch_decode.json,
<out>/batch_decode.md and <out>/batch_decode.png.
"""

from __future__ import annotations

import os
import random
import time

import jax
from absl import flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.engine import LEARNED, Engine
from bp_jax.decoding.options import BatchOptions, ShapeOptions
from bp_jax.eval.plots import line_plot
from bp_jax.eval.resources import peak_rss_mb
from bp_jax.policy.mlp import load_policy

common.define_flags("target", "drafter", "block_size", "max_new_tokens", "max_len", "repeats",
                    num_prompts=32)
flags.DEFINE_string("policy", "demo/policy", "Block-size policy folder (method 'learned').")
flags.DEFINE_string("batch_sizes", "1,4,16", "Comma-separated batch sizes B.")
flags.DEFINE_string("methods", "ar,spec,learned", "Methods: ar, spec (fixed --block_size), "
                    "learned (the policy's size per request; in a batch, one size for all: "
                    "Engine.joint_size), learned_split (each pick in its own "
                    "bucket: BatchOptions.join_learned=False).")
flags.DEFINE_integer("sync_cycles", 16, "Cycles between the host's slot refills (B > 1).")
flags.DEFINE_string("out", "out/batch_decode", "Output folder (JSON, Markdown, PNG).")
FLAGS = flags.FLAGS


def _slot_mb(engine: Engine, block_size: int) -> float:
  carry = jax.eval_shape(lambda: engine.slot_carry(block_size))
  caches = [carry.cache] + ([carry.draft_cache] if carry.draft_cache is not None else [])
  return sum(x.size * x.dtype.itemsize for c in caches for x in jax.tree.leaves(c)) / 2**20


def _pass(engine: Engine, prompts, block_size) -> tuple[list, float]:
  t0 = time.perf_counter()
  if engine.batch_size == 1:
    gens = [engine.generate(p, max_new_tokens=FLAGS.max_new_tokens, block_size=block_size)
            for p in prompts]
  else:
    gens = engine.generate_batch(prompts, max_new_tokens=FLAGS.max_new_tokens,
                                 block_size=block_size, seeds=0)
  return gens, time.perf_counter() - t0


def main(_):
  target, drafter, tok, stop_ids = common.load_models(FLAGS)
  prompts = [ids for _, ids in common.demo_prompts(tok, "eval", limit=FLAGS.num_prompts)]
  methods = [m for m in FLAGS.methods.split(",") if m]
  sizes = [int(b) for b in FLAGS.batch_sizes.split(",") if b]
  policy = sizes_of_policy = None
  if {"learned", "learned_split"} & set(methods):
    policy, info = load_policy(FLAGS.policy)
    sizes_of_policy = tuple(info.block_sizes)
  buckets = tuple(sorted({1, FLAGS.block_size} | set(sizes_of_policy or ())))
  engine = lambda B, join: Engine(
      target, stop_ids=stop_ids, drafter=drafter, policy=policy,
      policy_sizes=sizes_of_policy or (),
      shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=buckets),
      batching=BatchOptions(batch_size=B, sync_cycles=FLAGS.sync_cycles, join_learned=join))
  engines = {B: engine(B, True) for B in sizes}
  split = {B: engine(B, False) for B in sizes if "learned_split" in methods and B > 1}
  engine_of = lambda B, m: split[B] if m == "learned_split" and B in split else engines[B]
  size_of = {"ar": 1, "spec": FLAGS.block_size, "learned": LEARNED, "learned_split": LEARNED}
  # Compile and warm every (B, method) on two prompts (untimed).
  for B in tqdm(sizes, desc="compiling"):
    for m in methods:
      eng = engine_of(B, m)
      _pass_two = (prompts[:2] if B == 1 else prompts[:B])
      if B == 1:
        for p in _pass_two:
          eng.generate(p, max_new_tokens=8, block_size=size_of[m])
      else:
        eng.generate_batch(_pass_two, max_new_tokens=8, block_size=size_of[m])
  runs = {(B, m): [] for B in sizes for m in methods}
  order = list(runs)
  for r in tqdm(range(FLAGS.repeats), desc="timed passes"):
    random.Random(r).shuffle(order)
    for B, m in order:
      gens, wall = _pass(engine_of(B, m), prompts, size_of[m])
      runs[(B, m)].append((wall, gens, peak_rss_mb()))
  rows = []
  for (B, m), reps in runs.items():
    wall, gens, rss = min(reps, key=lambda x: x[0])
    ref = min(runs[(sizes[0], m)], key=lambda x: x[0])[1]
    new = sum(g.new_tokens for g in gens)
    taus = [g.tau for g in gens if g.tau is not None]
    used = sorted({g.block_size for g in gens})
    rows.append({
        "batch_size": B, "method": m, "prompts": len(gens), "new_tokens": new,
        "tokens_per_s": round(new / wall, 1),
        "decode_tokens_per_s": round(new / sum(g.decode_s for g in gens), 1),
        "tau": round(sum(taus) / len(taus), 3) if taus else None,
        "identical_to_first_batch_size": sum(g.output_ids == h.output_ids
                                             for g, h in zip(gens, ref)),
        "block_sizes_used": used,
        "slot_mb": round(sum(_slot_mb(engines[B], b) for b in used), 2),
        "slot_mb_per_request": round(sum(_slot_mb(engines[B], b) for b in used) / B, 3),
        "peak_rss_mb": rss, "wall_s": round(wall, 3)})
  for row in rows:
    base = next(r for r in rows if r["method"] == row["method"] and r["batch_size"] == sizes[0])
    row["tokens_per_s_vs_first_batch_size"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    row["decode_tokens_per_s_vs_first_batch_size"] = round(
        row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
  meta = {"device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
          "block_size": FLAGS.block_size, "sync_cycles": FLAGS.sync_cycles,
          "max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats,
          "command": common.command_line()}
  common.write_json(os.path.join(FLAGS.out, "batch_decode.json"), {"meta": meta, "rows": rows})
  cols = ("batch_size", "method", "tokens_per_s", "tokens_per_s_vs_first_batch_size",
          "decode_tokens_per_s", "decode_tokens_per_s_vs_first_batch_size", "tau",
          "identical_to_first_batch_size", "slot_mb", "slot_mb_per_request", "peak_rss_mb")
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
  common.write_text(os.path.join(FLAGS.out, "batch_decode.md"),
                    f"`{meta['command']}` on {meta['device']} ({meta['cpu_count']} cores)\n\n"
                    + "\n".join(lines) + "\n")
  line_plot({m: ([r["batch_size"] for r in rows if r["method"] == m],
                 [r["tokens_per_s"] for r in rows if r["method"] == m]) for m in methods},
            os.path.join(FLAGS.out, "batch_decode.png"), xlabel="batch size B",
            ylabel="tokens/s (prefill + decode)", title="demo, held-out HumanEval, T=0")
  print("\n".join(lines))


if __name__ == "__main__":
  cli.run(main, __doc__)
