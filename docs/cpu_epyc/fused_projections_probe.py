"""Synthetic: one AR step's projections of the demo's 4 layers (D 256, F 768, q 256, k / v 128),
100 steps in a `fori_loop`, as separate products (q, k, v, gate, up: how bp_jax runs them) or
fused (one [D, 512] q|k|v product and one [D, 1536] gate|up product), M = 1 and 8 rows.

    python docs/cpu_epyc/fused_projections_probe.py

Prints microseconds per step of each form and fused / separate (medians of 15 alternated runs).
The weights here (8.4 MB) stay in cache, unlike a decode loop's.
"""
import time, numpy as np, jax, jax.numpy as jnp
k = jax.random.split(jax.random.key(0), 8)
D, F, L = 256, 768, 4
Wq = [jax.random.normal(k[0], (D, 256)) for _ in range(L)]; Wk = [jax.random.normal(k[1], (D, 128)) for _ in range(L)]
Wv = [jax.random.normal(k[2], (D, 128)) for _ in range(L)]; Wg = [jax.random.normal(k[3], (D, F)) for _ in range(L)]
Wu = [jax.random.normal(k[4], (D, F)) for _ in range(L)]
Wqkv = [jnp.concatenate([a, b, c], 1) for a, b, c in zip(Wq, Wk, Wv)]; Wgu = [jnp.concatenate([a, b], 1) for a, b in zip(Wg, Wu)]
def sep(x, Wq, Wk, Wv, Wg, Wu):
  def body(i, x):
    for l in range(L):
      q, kk, v = x @ Wq[l], x @ Wk[l], x @ Wv[l]
      g, u = x @ Wg[l], x @ Wu[l]
      x = x + 1e-3 * (q.sum() + kk.sum() + v.sum()) + 1e-3 * (jax.nn.silu(g) * u)[:, :D]
    return x
  return jax.lax.fori_loop(0, 100, body, x)
def fused(x, Wqkv, Wgu):
  def body(i, x):
    for l in range(L):
      qkv = x @ Wqkv[l]; q, kk, v = qkv[:, :256], qkv[:, 256:384], qkv[:, 384:]
      gu = x @ Wgu[l]; g, u = gu[:, :F], gu[:, F:]
      x = x + 1e-3 * (q.sum() + kk.sum() + v.sum()) + 1e-3 * (jax.nn.silu(g) * u)[:, :D]
    return x
  return jax.lax.fori_loop(0, 100, body, x)
fs, ff = jax.jit(sep), jax.jit(fused)
for M in (1, 8):
  x = jnp.ones((M, D)) * 0.01
  fs(x, Wq, Wk, Wv, Wg, Wu).block_until_ready(); ff(x, Wqkv, Wgu).block_until_ready()
  ts, tf = [], []
  for r in range(15):
    t0 = time.perf_counter(); fs(x, Wq, Wk, Wv, Wg, Wu).block_until_ready(); ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); ff(x, Wqkv, Wgu).block_until_ready(); tf.append(time.perf_counter() - t0)
  print(f"M={M}: separate {1e4*np.median(ts):.1f} us/iter, fused {1e4*np.median(tf):.1f} us/iter, ratio {np.median(tf)/np.median(ts):.3f}")
