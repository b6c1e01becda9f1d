"""Where the suite's time goes: a pytest plugin summing, per test file, the seconds JAX reports
for tracing, lowering and XLA's backend compilation (`jax.monitoring` duration events), and a
summary of those beside each file's setup + call time from `--durations=0`.

  PYTHONPATH=docs/suite_profile BP_JAX_JAX_TIMES=/tmp/jt python -m pytest -q tests \
    -p jax_times --durations=0 > /tmp/suite.log
  python docs/suite_profile/jax_times.py /tmp/jt /tmp/suite.log

Time inside subprocesses a test starts (decode.py, serve.py, the 8-device sharding checks, the
benchmarks' command lines) is not seen by the plugin: it shows in the summary as the rest.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys

EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile"}
_current = ["(outside tests)"]
_seconds: dict = collections.defaultdict(collections.Counter)


def _listener(event: str, duration: float, **_) -> None:
  name = EVENTS.get(event.rsplit("/", 1)[-1])
  if name:
    _seconds[_current[0]][name] += duration


def pytest_configure(config):
  import jax
  jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_runtest_logstart(nodeid, location):
  _current[0] = os.path.basename(location[0])


def write_worker_log(env_var: str, log) -> None:
  """`log` as JSON in the folder `env_var` names (nothing without it), one file per pytest-xdist
  worker (`main.json` without xdist)."""
  folder = os.environ.get(env_var)
  if folder:
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"{worker}.json"), "w") as f:
      json.dump(log, f)


def worker_logs(folder: str) -> list:
  """Every worker's log `write_worker_log` left in `folder`."""
  logs = []
  for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
    with open(path) as f:
      logs.append(json.load(f))
  return logs


def pytest_sessionfinish(session):
  write_worker_log("BP_JAX_JAX_TIMES", {k: dict(v) for k, v in _seconds.items()})


def summary(folder: str, log: str, top: int = 30) -> str:
  jax_s: dict = collections.defaultdict(collections.Counter)
  for worker in worker_logs(folder):
    for name, events in worker.items():
      jax_s[name].update(events)
  per_file: collections.Counter = collections.Counter()
  with open(log) as f:
    for line in f:
      m = re.match(r"\s*([\d.]+)s (setup|call|teardown)\s+tests/([^:]+)::", line)
      if m:
        per_file[m.group(3)] += float(m.group(1))
  rows = [f"{'file':36s} {'total':>7s} {'trace':>6s} {'lower':>6s} {'compile':>7s} {'rest':>6s}"]
  sums = collections.Counter()
  for name, total in per_file.most_common():
    s = jax_s.get(name, {})
    parts = [s.get(k, 0.0) for k in ("trace", "lower", "compile")]
    sums.update({"total": total, "trace": parts[0], "lower": parts[1], "compile": parts[2]})
    if len(rows) <= top:
      rows.append(f"{name:36s} {total:7.1f} {parts[0]:6.1f} {parts[1]:6.1f} {parts[2]:7.1f} "
                  f"{total - sum(parts):6.1f}")
  rest = sums["total"] - sums["trace"] - sums["lower"] - sums["compile"]
  rows.append(f"{'all ' + str(len(per_file)) + ' files':36s} {sums['total']:7.1f} "
              f"{sums['trace']:6.1f} {sums['lower']:6.1f} {sums['compile']:7.1f} {rest:6.1f}")
  return "\n".join(rows)


if __name__ == "__main__":
  if len(sys.argv) != 3:
    sys.exit("usage: python docs/suite_profile/jax_times.py TIMES_FOLDER SUITE_LOG")
  print(summary(sys.argv[1], sys.argv[2]))
