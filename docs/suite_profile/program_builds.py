"""Which programs the suite builds: a pytest plugin logging every program an engine builds
(`compiled.CompiledCache.get` on a key it has not got: taken from another engine of the
process, loaded from the persistent cache, or compiled) and JAX's compilations by function
name, per test; and a summary of the logs.

  PYTHONPATH=docs/suite_profile BP_JAX_PROGRAM_BUILDS=/tmp/pb python -m pytest -q tests \
    -p program_builds
  python docs/suite_profile/program_builds.py /tmp/pb

The summary counts the builds by outcome, the files that compile most, and JAX's compilations
of single operations run eagerly (each compiled apart, once per shape and process: what a
reference computed op by op costs).
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_times import worker_logs, write_worker_log  # noqa: E402

EAGER_MEAN_S = 0.1  # a function whose compilations average under this: one operation, eager
_test = ["(outside tests)"]
_builds: list = []
_compiles: list = []


def _listener(event: str, duration: float, **kw) -> None:
  if event.endswith("backend_compile_duration"):
    _compiles.append((_test[0], kw.get("fun_name", "?"), duration))


def pytest_configure(config):
  import jax
  from bp_jax.decoding import compiled
  jax.monitoring.register_event_duration_secs_listener(_listener)
  get = compiled.CompiledCache.get

  def logged_get(self, key, make, args, donate_argnums=(), out_shardings=None, program=None):
    if key in self:
      return get(self, key, make, args, donate_argnums, out_shardings, program)
    shared, hits, t0 = self.shared, self.cache_hits, time.perf_counter()
    fn = get(self, key, make, args, donate_argnums, out_shardings, program)
    outcome = ("shared" if self.shared > shared else
               "loaded" if self.cache_hits > hits else "compiled")
    _builds.append((_test[0], repr(key), outcome, time.perf_counter() - t0))
    return fn

  compiled.CompiledCache.get = logged_get


def pytest_runtest_logstart(nodeid, location):
  _test[0] = nodeid


def pytest_sessionfinish(session):
  write_worker_log("BP_JAX_PROGRAM_BUILDS", {"builds": _builds, "compiles": _compiles})


def summary(folder: str, top: int = 12) -> str:
  builds, compiles = [], []
  for log in worker_logs(folder):
    builds += log["builds"]
    compiles += log["compiles"]
  file_of = lambda test: test.split("::")[0].rsplit("/", 1)[-1]
  count, secs = collections.Counter(), collections.Counter()
  by_file = collections.Counter()
  for test, _, outcome, s in builds:
    count[outcome] += 1
    secs[outcome] += s
    if outcome != "shared":
      by_file[file_of(test)] += s
  rows = ["engine programs built, by outcome (count, seconds):"]
  rows += [f"  {o:9s} {count[o]:5d} {secs[o]:8.1f}" for o in ("compiled", "loaded", "shared")]
  rows.append("files whose programs took longest to build (s):")
  rows += [f"  {name:40s} {s:6.1f}" for name, s in by_file.most_common(top)]
  per_fn = collections.defaultdict(list)
  for _, fn, s in compiles:
    per_fn[fn].append(s)
  eager = {fn for fn, v in per_fn.items() if sum(v) / len(v) < EAGER_MEAN_S}
  n_eager = sum(len(per_fn[fn]) for fn in eager)
  s_eager = sum(sum(per_fn[fn]) for fn in eager)
  rows.append(f"JAX compilations: {len(compiles)} in {sum(s for *_, s in compiles):.1f} s; of "
              f"single operations run eagerly: {n_eager} in {s_eager:.1f} s")
  return "\n".join(rows)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python docs/suite_profile/program_builds.py LOG_FOLDER")
  print(summary(sys.argv[1]))
