"""Benchmark: our AR decode, our speculative decode per block size, and transformers' generate,
in one run on the same random weights and prompts (CPU).

  python -m benchmarks.bench_decode --sizes tiny,100m --out out/bench_decode.json

For each model size it reports tokens/s of transformers `generate` (greedy, torch CPU), of our
AR loop, and per block size b: spec decoding with a random drafter (tau ~ 1: the cost of
rejection), spec decoding with a perfect drafter (every draft accepted: the engine's ceiling),
the cost of one cycle split into draft and verify relative to one AR step, and compile times
(tau: the mean over prompts of committed tokens per speculative cycle, as decode.py reports it).
Also the peak RSS of converting the checkpoint (convert_weights.py) relative to its size.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from absl import app, flags
from flax import nnx

from benchmarks import common
from bp_jax import cli
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
from bp_jax.weights.loading import load_target

flags.DEFINE_list("sizes", ["tiny", "100m"], "Model sizes to run (tiny, 100m).")
flags.DEFINE_list("block_sizes", ["2", "4", "8", "16"], "Speculative block sizes to measure.")
flags.DEFINE_integer("prompts", 3, "Number of random prompts.")
flags.DEFINE_integer("prompt_len", 64, "Prompt length in tokens.")
common.define_flags("max_new_tokens")
flags.DEFINE_integer("draft_layers", 2, "Layers of the random drafter.")
flags.DEFINE_bool("hf", True, "Also time transformers' generate.")
flags.DEFINE_string("out", "out/bench_decode.json", "Where to write the JSON results.")
FLAGS = flags.FLAGS

SIZES = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 tie_word_embeddings=True),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                 tie_word_embeddings=False),
}


def make_hf_checkpoint(size: str, path: str) -> transformers.Qwen3ForCausalLM:
  cfg = transformers.Qwen3Config(**SIZES[size], rms_norm_eps=1e-6, rope_theta=10000.0,
                                 max_position_embeddings=4096)
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  model.save_pretrained(path)
  return model


def convert_with_rss(hf_dir: str, out_dir: str) -> dict:
  """Runs convert_weights.py in a child process; its peak RSS vs the checkpoint's size."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  t0 = time.perf_counter()
  subprocess.run([sys.executable, "convert_weights.py", f"--hf_dir={hf_dir}",
                  f"--out_dir={out_dir}"], check=True, capture_output=True)
  secs = time.perf_counter() - t0
  peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  size = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
  # ru_maxrss of children is the max over all children so far; the first is the largest here.
  return {"convert_s": round(secs, 2), "checkpoint_mb": round(size / 2**20, 1),
          "convert_peak_rss_mb": round(max(peak, before) / 1024, 1),
          "rss_over_checkpoint": round(max(peak, before) * 1024 / size, 2)}


def time_hf(model, prompts, max_new: int) -> float:
  torch.set_num_threads(os.cpu_count() or 1)
  total, secs = 0, 0.0
  with torch.no_grad():
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm up
    for p in prompts:
      t0 = time.perf_counter()
      out = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False)
      secs += time.perf_counter() - t0
      total += out.shape[1] - len(p)
  return total / secs


def run_engine(engine: Engine, prompts, max_new: int, block_size: int, forced=None) -> dict:
  """Decodes every prompt twice (the first run may compile); reports the second."""
  gens = []
  for i, p in enumerate(prompts):
    kw = dict(max_new_tokens=max_new, block_size=block_size,
              forced_continuation=None if forced is None else forced[i])
    engine.generate(p, **kw)
    gens.append(engine.generate(p, **kw))
  new = sum(g.new_tokens for g in gens)
  dec = sum(g.decode_s for g in gens)
  cycles = sum(g.cycles for g in gens)  # no AR fallback here: every target forward is a cycle
  taus = [g.tau for g in gens if g.tau is not None]
  # tau: decode.py's figure, the mean over prompts of committed tokens per speculative cycle
  return {"tokens_per_s": new / dec, "tau": float(np.mean(taus)) if taus else 0.0,
          "s_per_cycle": dec / max(cycles, 1), "outputs": [g.output_ids for g in gens]}


def cycle_breakdown(engine: Engine, b: int, reps: int = 20) -> dict:
  """Milliseconds of one draft pass and one verify pass at block size b (isolated jits)."""
  tg, ts, dg, ds = engine.t_graph, engine.t_state, engine.d_graph, engine.d_state
  cache = engine.cache.stacked().with_lengths(jnp.array([engine.max_len // 2], jnp.int32))
  dcache = engine.draft_cache.stacked().with_lengths(jnp.array([engine.max_len // 2],
                                                               jnp.int32))
  ids = engine.drafter.cfg.target_layer_ids

  def draft(ts, ds, toks, dcache):
    model, drafter = nnx.merge(tg, ts), nnx.merge(dg, ds)
    h = drafter.draft(model.embed_tokens(toks), dcache)
    return jnp.argmax(model.project_to_vocab(h[:, 1:]), axis=-1)

  def verify(ts, toks, cache):
    out = nnx.merge(tg, ts)(toks, cache, ids)
    return jnp.argmax(out.logits, axis=-1), out.layer_hiddens

  toks = jnp.zeros((1, b), jnp.int32)
  res = {}
  for name, fn, args in (("draft_ms", draft, (ts, ds, toks, dcache)),
                         ("verify_ms", verify, (ts, toks, cache))):
    res[name] = common.mean_ms(fn, args, reps)
  return res


def bench_size(size: str, tmp: str) -> dict:
  hf_dir, our_dir = os.path.join(tmp, f"{size}_hf"), os.path.join(tmp, f"{size}_ours")
  hf_model = make_hf_checkpoint(size, hf_dir)
  res = {"size": size, "params_m": round(sum(p.numel() for p in hf_model.parameters()) / 1e6, 1)}
  res.update(convert_with_rss(hf_dir, our_dir))
  target = load_target(our_dir)
  c = target.cfg
  dcfg = DFlashConfig(
      layers=Qwen3Config(**{**c.__dict__, "num_hidden_layers": FLAGS.draft_layers}),
      block_size=16, num_target_layers=c.num_hidden_layers, mask_token_id=c.vocab_size - 1,
      target_layer_ids=(1, c.num_hidden_layers // 2, c.num_hidden_layers - 2))
  drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(1))
  block_sizes = [int(b) for b in FLAGS.block_sizes]
  max_len = FLAGS.prompt_len + FLAGS.max_new_tokens + max(block_sizes) + 16
  engine = Engine(target, drafter=drafter,
                  shapes=ShapeOptions(max_len=max_len, block_sizes=block_sizes))
  rs = np.random.RandomState(0)
  prompts = [rs.randint(2, c.vocab_size - 1, FLAGS.prompt_len).tolist()
             for _ in range(FLAGS.prompts)]
  N = FLAGS.max_new_tokens
  if FLAGS.hf:
    res["hf_generate_tok_s"] = round(time_hf(hf_model, prompts, N), 2)
  ar = run_engine(engine, prompts, N, 1)
  res["ar_tok_s"] = round(ar["tokens_per_s"], 2)
  ar_step = ar["s_per_cycle"]
  res["ar_step_ms"] = round(ar_step * 1e3, 3)
  res["per_block"] = {}
  for b in block_sizes:
    rand = run_engine(engine, prompts, N, b)
    perf = run_engine(engine, prompts, N, b, forced=ar["outputs"])
    row = {"identical_to_ar": rand["outputs"] == ar["outputs"] == perf["outputs"],"random_tok_s": round(rand["tokens_per_s"], 2), "random_tau": round(rand["tau"], 3),
           "random_speedup": round(rand["tokens_per_s"] / ar["tokens_per_s"], 3),
           "perfect_tok_s": round(perf["tokens_per_s"], 2), "perfect_tau": round(perf["tau"], 3),
           "perfect_speedup": round(perf["tokens_per_s"] / ar["tokens_per_s"], 3),
           "cycle_over_ar_step": round(perf["s_per_cycle"] / ar_step, 3),
           "compile_s": round(engine.compiled.seconds[("spec_loop", b)], 2)}
    row.update({k: round(v, 3) for k, v in cycle_breakdown(engine, b).items()})
    res["per_block"][b] = row
    print(size, b, row, flush=True)
  res["compile"] = engine.compiled.summary()
  return res


def print_table(results: list[dict]) -> None:
  for r in results:
    print(f"\n## {r['size']} ({r['params_m']}M params)  HF generate "
          f"{r.get('hf_generate_tok_s', '-')} tok/s | our AR {r['ar_tok_s']} tok/s "
          f"(step {r['ar_step_ms']} ms) | convert peak RSS {r['convert_peak_rss_mb']} MB = "
          f"{r['rss_over_checkpoint']}x checkpoint")
    print("| b | random tok/s | τ per cycle | x AR | perfect tok/s | τ per cycle | x AR | "
          "cycle/AR step | draft ms | verify ms | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, row in r["per_block"].items():
      print(f"| {b} | {row['random_tok_s']} | {row['random_tau']} | {row['random_speedup']} | "
            f"{row['perfect_tok_s']} | {row['perfect_tau']} | {row['perfect_speedup']} | "
            f"{row['cycle_over_ar_step']} | {row['draft_ms']} | {row['verify_ms']} | "
            f"{row['compile_s']} |")


def main(argv):
  del argv
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for size in FLAGS.sizes:
      if size not in SIZES:
        raise app.UsageError(f"--sizes: unknown size {size!r}; known: {sorted(SIZES)}")
      results.append(bench_size(size, tmp))
  common.write_json(FLAGS.out, {"device": str(jax.devices()[0]), "results": results})
  print_table(results)
  print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
  cli.run(main, __doc__)
