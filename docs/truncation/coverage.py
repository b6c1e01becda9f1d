"""How often a row's 64 largest values settle its top-k / top-p threshold (`sampling._top_threshold`)
on the demo target's own distributions: teacher-forced over prompts and their T = 1 continuations.

  PYTHONPATH=. python docs/truncation/coverage.py --num_prompts 24
"""
import sys
import jax.numpy as jnp
import numpy as np
from absl import flags
from benchmarks import common
from bp_jax.decoding import sampling
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
common.define_flags("target", "drafter", "max_len", "max_new_tokens", num_prompts=24)
F = flags.FLAGS; F(sys.argv)
m = common.load_models(F, drafter=False)
prompts = common.demo_prompts(m.tokenizer, limit=F.num_prompts)
eng = Engine(m.target, stop_ids=m.stop_ids, shapes=ShapeOptions(max_len=F.max_len))
rows = []
for _, ids in prompts:
  g = eng.generate(ids, max_new_tokens=F.max_new_tokens, temperature=1.0, seed=1)
  seq = list(ids) + list(g.output_ids)
  cache = m.target.init_cache(1, 1024)
  logits = m.target(jnp.asarray([seq], jnp.int32), cache).logits[0, len(ids) - 1:len(seq) - 1]
  rows.append(np.asarray(logits))
L = jnp.asarray(np.concatenate(rows))
print("positions", L.shape)
for t, k, p in [(1.0, 0, 0.9), (1.0, 0, 0.95), (0.6, 0, 0.95), (0.7, 0, 0.8), (1.0, 50, 0.9)]:
  found = sampling._top_threshold(L / t, jnp.int32(k), jnp.float32(p)).found
  f = np.asarray(found)[:, 0]
  n8 = len(f) // 8 * 8
  print(f"T={t} top_k={k} top_p={p}: rows found {f.mean():.3f}; groups of 8 all found {f[:n8].reshape(-1, 8).all(1).mean():.3f}")
