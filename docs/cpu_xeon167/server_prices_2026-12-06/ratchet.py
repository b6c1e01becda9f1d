import numpy as np
from bp_jax.decoding.online_costs import OnlineCosts
ar, cyc = 3.52e-3, 5.535e-3
prior = lambda n: cyc/ar if n == 8 else 1.0 + 0.07*n
oc = OnlineCosts(prior, batch_prior_floor=1.0, one_prior_floor=0.5)
rng = np.random.default_rng(0)
def call(n0, n8, f=None):
  f = f if f is not None else float(np.exp(rng.normal(0, 0.03)))
  c = np.zeros(9); c[0], c[8] = n0, n8
  oc.observe((n0*ar + n8*cyc)*f, c, 8)
  fit = oc._fit(8)
  return fit.theta.copy() if fit.theta is not None else None
for i in range(5):
  print("mixed", call(3, 13) * 1e3)
for f in (0.933, 0.993, 0.963, 0.978, 0.97, 0.97, 0.97, 0.97):
  print("cyc-only", f, call(0, 16, f) * 1e3)
