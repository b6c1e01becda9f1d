"""benchmarks/arrivals.py on the demo at a tiny size: requests arriving over time (Poisson
traces) served through the scheduler on a simulated device's clock without noise. At a load so
light that no two requests meet, each of our AR's requests takes exactly its own AR steps (an
idle engine's clock jumps to the next arrival, no request waits); at a heavy load they queue.
Every method gives AR's tokens at every load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
AR_MS = 3.0


def test_light_and_heavy_load_on_a_simulated_clock(tmp_path):
  out = tmp_path / "arrivals"
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.arrivals", "--num_prompts=4", "--half=eval",
       "--max_new_tokens=12", "--methods=priced_default", "--batch_size=2",
       "--loads=0.001,16", f"--sim_clock_ms={AR_MS}", "--sim_clock_noise=0",
       "--controller_costs=1,1.1,1.3,1.6", "--controller_draft_cost=0.8",
       "--bootstrap_reps=50", "--repeats=1", "--warmup_groups=1", f"--out={out}"],
      cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "arrivals.json").read_text())
  assert report["clock"] == "simulated" and report["ar_step_s"] == pytest.approx(AR_MS * 1e-3)
  assert set(report["loads"]) == {"0.001", "16"}
  light, heavy = report["loads"]["0.001"], report["loads"]["16"]
  for load in (light, heavy):
    assert set(load["methods"]) == {"ar", "priced_default"}
    for row in load["methods"].values():
      assert row["requests"] == 4 and row["identical_to_ar"] == 4
    assert load["methods"]["ar"]["split_calls"] == 0  # one bucket only
  # Light: each request alone, from its arrival; its first token comes from the prefill (free
  # on this clock), each other one from an AR step (the warm-up's forwards before it charged
  # apart: `SimClock` after `Engine.clear_tallies`).
  ar = light["methods"]["ar"]
  assert ar["latencies_s"] == pytest.approx([(n - 1) * AR_MS * 1e-3 for n in ar["new_tokens"]])
  assert ar["makespan_s"] >= light["arrivals_s"][-1]  # it idled until the last arrival
  # Heavy: 4 requests at once in 2 slots; the last two wait for a slot.
  heavy_ar = heavy["methods"]["ar"]
  assert heavy_ar["latency_max_s"] > max(ar["latencies_s"]) * 1.5
  assert heavy_ar["makespan_s"] < sum(ar["latencies_s"])  # two rows share each step
  assert "load 16 (" in proc.stdout and "split" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--loads=0"], "--loads='0': give comma-separated loads > 0"),
    (["--loads=1", "--methods=learned_fixed"], "a trace needs an engine of its own"),
])
def test_bad_flags_name_themselves(args, message):
  proc = subprocess.run([sys.executable, "-m", "benchmarks.arrivals", *args], cwd=REPO,
                        env=ENV, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]


def test_host_clock_serves_a_trace_in_wall_time(tmp_path):
  """Without --sim_clock_ms the trace runs on the host's clock: the load's unit is our AR's
  timed step, the host sleeps until each arrival, and latencies are wall time (prefills
  included); --repeats passes alternate the methods' order and give the same tokens."""
  out = tmp_path / "arrivals"
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.arrivals", "--num_prompts=3", "--half=eval",
       "--max_new_tokens=8", "--methods=priced_default", "--batch_size=2", "--loads=0.5",
       "--controller_costs=1,1.1,1.3,1.6", "--controller_draft_cost=0.8",
       "--bootstrap_reps=50", "--repeats=2", f"--out={out}"],
      cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "arrivals.json").read_text())
  assert report["clock"] == "host" and report["ar_step_s"] > 0
  load = report["loads"]["0.5"]
  for row in load["methods"].values():
    assert row["identical_to_ar"] == 3
    assert all(x > 0 for x in row["latencies_s"])
    # the host slept until the last arrival: no request ended before it came
    assert row["makespan_s"] >= load["arrivals_s"][-1]
