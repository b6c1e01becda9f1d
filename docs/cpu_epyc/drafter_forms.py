"""One drafter pass as the speculative loop runs it (context of 8 entries added at position
300, a block of 8 drafted over a 512-slot window, 7 positions projected to the vocabulary),
32 per jitted call, 15 rounds with the four forms taking turns: the drafter's separate
matrices, k|v fused, gate|up fused, both. Needs docs/cpu_epyc/drafter_kv_fusion.patch applied
(`git apply docs/cpu_epyc/drafter_kv_fusion.patch`; not landed).

    PYTHONPATH=. python docs/cpu_epyc/drafter_forms.py [batch]
"""
import time, sys
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
from bp_jax.decoding.engine import decode_form
from bp_jax.weights.loading import load_drafter, load_target
target = decode_form(load_target("demo/target", "float32"))
dr = load_drafter("demo/drafter", target.cfg, "float32")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
b, pos, reps, max_len = 8, 300, 32, 1024
tg, ts = nnx.split(target); dg, ds = nnx.split(dr)
cache = dr.init_cache(B, max_len).per_layer()
forms = {"separate": dict(), "kv": dict(fuse_kv=True), "mlp": dict(fuse_mlp=True),
         "kv+mlp": dict(fuse_kv=True, fuse_mlp=True)}
def make(form):
  @jax.jit
  def f(ts, ds, cache, layers):
    model, d = nnx.merge(tg, ts), nnx.merge(dg, ds)
    def step(i, carry):
      acc, cache = carry
      feats = jnp.ones((2, B, b, 256)) * (i + 1.0)
      cache = d.add_context(feats, cache.with_lengths(jnp.full((B,), pos, jnp.int32)), layers)
      block = jnp.full((B, b), 1, jnp.int32).at[:, 0].set(i % 4000)
      h = d.draft(model.embed_tokens(block), cache.with_lengths(jnp.full((B,), pos + b, jnp.int32)), layers, window=512)
      logits = model.project_to_vocab(h[:, 1:])
      return acc + jnp.sum(jnp.argmax(logits, -1)), cache
    return jax.lax.fori_loop(0, reps, step, (jnp.int32(0), cache))[0]
  return f
fns = {k: (make(k), tuple(dr.layers.per_layer(**v))) for k, v in forms.items()}
for k, (f, L) in fns.items(): jax.block_until_ready(f(ts, ds, cache, L))
runs = {k: [] for k in fns}
for r in range(15):
  for k, (f, L) in fns.items():
    t0 = time.perf_counter(); jax.block_until_ready(f(ts, ds, cache, L)); runs[k].append(time.perf_counter() - t0)
base = np.median(runs["separate"])
for k, v in runs.items(): print(f"B={B} {k}: {1e3*np.median(v)/reps:.3f} ms per pass, /separate {np.median(v)/base:.3f}")
