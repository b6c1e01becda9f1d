import gc, jax, jax.numpy as jnp
from bp_jax.decoding.compiled import maps_in_use
def mk(i):
  def f(x):
    for j in range(20):
      x = jnp.tanh(x * (i + j)) @ x + jnp.sin(x) * j
    return x
  return f
x = jnp.ones((64, 64))
m0 = maps_in_use()[0]
fns = [jax.jit(mk(i)).lower(x).compile() for i in range(30)]
m1 = maps_in_use()[0]
del fns; gc.collect()
m2 = maps_in_use()[0]
print(m0, m1, m2)
