"""Runs benchmarks.controllers with each compile logged: key, seconds, maps before/after."""
import sys, time
from bp_jax.decoding import compiled
orig = compiled.CompiledCache.get
log = open(sys.argv[1], "w")
def get(self, key, make, args, *a, **kw):
  if key in self._fns:
    return orig(self, key, make, args, *a, **kw)
  m0 = compiled.maps_in_use()[0]; t0 = time.perf_counter()
  fn = orig(self, key, make, args, *a, **kw)
  m1 = compiled.maps_in_use()[0]
  log.write(f"{time.perf_counter()-t0:7.2f}s maps {m0}->{m1} (+{m1-m0}) {key!r}\n"[:400]); log.flush()
  return fn
compiled.CompiledCache.get = get
from absl import app
from benchmarks import controllers
sys.argv = ["controllers"] + sys.argv[2:]
app.run(controllers.main)
