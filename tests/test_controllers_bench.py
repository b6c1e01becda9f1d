"""benchmarks/controllers.py on the demo at a tiny size: the comparison issue 19's figures come
from cannot rot. At T = 1 (the sampling drafter, verify exact) every method gives AR's tokens
for each prompt's seed, here 3 prompts streamed through 2 slots (prompt i sampled with seed i,
whichever slot and batch-mates it gets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report_costs(out) -> dict:
  return json.loads((out / "controllers.json").read_text())["controller_costs"]


def test_sampled_comparison_gives_ar_tokens_for_each_seed(tmp_path):
  out = tmp_path / "bench"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.controllers", "--num_prompts=3", "--repeats=2",
       "--max_new_tokens=12", "--methods=priced_online", "--half=eval",
       "--temperature=1", "--top_k=20", "--drafter=demo/drafter_sampling",
       "--batch_size=2", "--controller_costs=1,1.1,1.3,1.6", "--controller_draft_cost=0.8",
       "--bootstrap_reps=50", "--warmup_groups=1",
       f"--out={out}"],  # costs given: no measurement's compiles
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "3 HumanEval eval-half prompts, T=1, top_k 20, verify exact" in proc.stdout
  assert report_costs(out) == {"controller_costs": [1.0, 1.1, 1.3, 1.6],
                               "controller_draft_cost": 0.8, "source": "given"}
  report = json.loads((out / "controllers.json").read_text())
  assert (report["temperature"], report["top_k"], report["verify"]) == (1.0, 20, "exact")
  assert report["drafter"] == "demo/drafter_sampling" and report["batch_size"] == 2
  assert report["group_size"] == 8 and "batch 2 (groups of 8 streamed)" in proc.stdout
  assert set(report["methods"]) == {"ar", "priced_online"}
  for name, row in report["methods"].items():
    assert row["identical_to_ar"] == 3, name  # AR's tokens for each prompt's seed
    assert row["new_tokens"] > 2
  assert report["methods"]["priced_online"]["drafter_passes"] > 0
  assert set(report["intervals"]) == {"priced_online/ar"}
  # A batch's requests share their group's loop calls: the interval resamples groups, and one
  # group gives a ratio without one.
  assert report["intervals_over"] == "1 group of up to 8 requests"
  assert report["intervals"]["priced_online/ar"]["lo"] is None
  assert "(one unit: no interval)" in proc.stdout
  # and the mean of the repeats beside the fastest of each
  assert set(report["intervals_mean_of_repeats"]) == {"priced_online/ar"}
  assert "(mean of the repeats)" in proc.stdout
  assert report["cost_estimates"]["priced_online"]["by_batch_size"]["2"]["calls"] >= 1
  # priced_online has no start rule: every request of every repeat drafted
  assert report["drafted_every_repeat"] == {"priced_online": 3 * report["repeats"]}
  # the group decoded once by every method before the timed runs, untimed and not tallied
  assert report["warmup_groups"] == 1 and "warm-up: 1 group(s)" in proc.stdout


def test_simulated_drafts_at_a_model_shape_with_an_identical_twin(tmp_path):
  """--shape: random weights of a Qwen3 shape (here the tiny test shape), every speculative
  method drafting the SIMULATED acceptance profile as forced drafts: issue 19's accelerator
  row. Every method still gives AR's tokens; the report says which verify lengths each ran,
  ar_twin (an engine identical to ar) gives the run's noise floor, and priced_default_twin
  (one identical to the default, its own prices and history) what two defaults differ by."""
  out = tmp_path / "bench"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.controllers", "--shape=tiny", "--prompt_len=16",
       "--num_prompts=3", "--repeats=2", "--max_new_tokens=20", "--block_size=4",
       "--methods=none,priced_default,ar_twin,priced_default_twin", "--batch_size=2",
       "--group_size=2",
       f"--cost_cache={tmp_path / 'costs'}", "--bootstrap_reps=50", "--profile",
       "--idle_gaps=0,0.1",
       f"--out={out}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("3 random 16-token prompts (tiny shapes, SIMULATED drafts: tau 6.5 at b=16), T=0"
          in proc.stdout)
  report = json.loads((out / "controllers.json").read_text())
  assert (report["shape"], report["sim_tau"]) == ("tiny", 6.5)
  # The simulated drafts run past the requests' last tokens by a block's drafts (--block_size
  # 4): a request's last cycles draft them as every other cycle does, not the random drafter's.
  assert report["sim_tokens_past_max_new"] == 3
  for name, row in report["methods"].items():
    assert row["identical_to_ar"] == 3, name
  # the paper's loop drafts the simulated profile (τ 2.8 at b = 4), not the random drafter's
  # guesses (τ about 1)
  assert report["methods"]["none"]["tau_per_cycle"] > 2
  # The default's choices follow this machine's timings, and the table's row is each group's
  # fastest repeat, which may be one that decoded plain throughout (a CI run: no drafter pass
  # in it). Its first group's first repeat drafts on any machine: no request has finished, so
  # there is no τ to weigh a cycle's price against (`StartBackoff`).
  spec = report["methods"]["priced_default"]
  lengths = spec["verify_lengths"]
  assert sum(lengths.values()) == spec["target_forwards"]
  assert spec["drafter_passes"] == sum(c for k, c in lengths.items() if k != "ar")
  first_group = report["repeats_per_group"]["priced_default"][0]
  assert first_group[0][2] == 2  # both requests of the blind first run drafted
  assert report["methods"]["ar_twin"]["verify_lengths"] == {"ar": sum(
      report["methods"]["ar_twin"]["verify_lengths"].values())}
  assert "priced_default target forwards by verify length:" in proc.stdout
  assert set(report["intervals"]) == {"none/ar", "priced_default/ar", "ar_twin/ar",
                                      "priced_default_twin/ar", "priced_default/none",
                                      "priced_default/ar_twin",
                                      "priced_default_twin/priced_default",
                                      "priced_default/ar_both"}
  # Over our AR measured twice (each unit at the two AR engines' mean seconds per new token, the
  # same tokens at T = 0): the mean of its speedups over each.
  pair = [report["intervals"][f"priced_default/{ar}"]["ratio"] for ar in ("ar", "ar_twin")]
  assert abs(report["intervals"]["priced_default/ar_both"]["ratio"] - sum(pair) / 2) <= 2e-4
  # The twin: the default's engine again (its blind first run drafts too), its own prices.
  assert report["repeats_per_group"]["priced_default_twin"][0][0][2] == 2
  assert report["cost_estimates"]["priced_default_twin"] != {}
  # Every method's timed loop calls, and its first against its later calls of the same forwards
  # (a static method replays the first group's first call in its second repeat).
  assert set(report["call_logs"]) == set(report["methods"])
  ar_first = report["first_calls"]["ar"]
  assert ar_first["peers"] >= 1 and ar_first["first_s"] > 0 < ar_first["peers_median_s"]
  assert "first timed loop call against the later calls of the same forwards" in proc.stdout
  # Our AR's first loop call after each idle gap, twice each
  assert list(report["idle_gaps"]) == ["0", "0.1"]
  assert all(len(xs) == 2 and min(xs) > 0 for xs in report["idle_gaps"].values())
  assert "our AR's first loop call of the first group after an idle host" in proc.stdout
  # Python's collections inside each method's timed loop calls
  assert set(report["gc_in_calls"]) == set(report["methods"])
  assert "Python GC collections inside timed loop calls" in proc.stdout
  # End to end: each group's fastest whole wall time (prefill and the host's work between calls
  # included) is at least the loop calls' share of it, and gives its own intervals.
  assert set(report["intervals_end_to_end"]) == set(report["intervals"])
  assert "(end to end: each group's fastest wall time" in proc.stdout
  for name, groups_ in report["repeats_per_group"].items():
    for rep in (r for g in groups_ for r in g):
      assert rep[4] >= rep[1] > 0, (name, rep)
  # The default's engine holds a measurement as a user's does (the run's, measured once here)
  # and decides from it whether a batch's tail shrinks.
  assert report["engine_costs"] == {"priced_default": "measured",
                                    "priced_default_twin": "measured"}
  assert set(report["tails_shrink"]) == {"none", "priced_default", "priced_default_twin"}
  assert "batch tails shrink: none " in proc.stdout
  assert report["intervals"]["ar_twin/ar"]["lo"] is not None  # 2 groups: an interval
  # The forwards as the batches ran them (a forward of 2 slots counts once), every repeat, and
  # their cost in AR steps of the run's table: an AR step costs one.
  batched = report["batch_forwards"]
  (steps,) = batched["ar"]["by_verify_length"].values()
  assert set(batched["ar"]["by_verify_length"]) == {"ar"} and batched["ar"]["cost"] == steps
  assert set(batched["none"]["by_verify_length"]) == {"k=3"}
  for name in ("ar", "none", "ar_twin"):  # the same path every repeat: per row, 2 repeats
    ran, rows = sum(batched[name]["by_verify_length"].values()), report["methods"][name]
    assert rows["target_forwards"] <= ran <= 2 * rows["target_forwards"], name
  assert batched["priced_default"]["cost"] > 0
  assert batched["priced_default"]["by_verify_length"].get("k=3", 0) > 0  # the blind run's
  assert "the batches' target forwards, every repeat" in proc.stdout
  # The profiler pass: each method's first group once more, its batches' forwards counted; a
  # CPU's trace has no device stream lines, so there are no kernels or copies to count.
  assert set(report["profile"]) == set(report["methods"])
  for name, p in report["profile"].items():
    assert p["cycles"] > 0 and p["kernels_per_cycle"] is None, name
  assert "profile priced_default: " in proc.stdout and "no device stream lines" in proc.stdout
  # each group's repeats, in the order run: (new tokens, seconds, requests that drafted,
  # requests moved to the plain bucket)
  groups = report["repeats_per_group"]
  assert len(groups["ar"]) == 2 and all(len(g) == 2 for g in groups["ar"])
  assert all(rep[2] == 0 for g in groups["ar_twin"] for rep in g)
  assert ([rep[0] for rep in groups["priced_default"][0]]
          == [rep[0] for rep in groups["ar"][0]])  # the same tokens, every repeat


def test_gc_collections_are_counted_inside_the_calls_they_started_in():
  """`benchmarks/gc_pauses.GcPauses`: every collection between start and stop is recorded, and a
  method's count holds those that started inside one of its booked calls."""
  import gc
  import time
  from benchmarks.gc_pauses import GcPauses
  from bp_jax.decoding.call_tally import LoopCall
  gc.disable()  # the explicit collections only
  try:
    pauses = GcPauses().start()
    t0 = time.perf_counter()
    gc.collect()
    t1 = time.perf_counter()
    gc.collect(0)
    pauses.stop()
    gc.collect()  # after stop: not recorded
  finally:
    gc.enable()
  assert [g for _, _, g in pauses.events] == [2, 0]
  call = LoopCall(end_s=t1, seconds=t1 - t0, block_size=4, rows=2, forwards_N=(0, 3))
  got = pauses.inside([call])
  assert got["count"] == 1 and got["oldest"] == 1 and got["ms"] == got["max_ms"] > 0, got
  assert pauses.inside([])["count"] == 0



def test_a_first_call_is_weighed_against_later_calls_of_the_same_forwards():
  from bp_jax.decoding.call_tally import LoopCall, first_call_against_peers
  call = lambda s, fwd, rows=4: LoopCall(end_s=0.0, seconds=s, block_size=16, rows=rows,
                                         forwards_N=fwd)
  full, tail = (0,) * 16 + (16,), (0,) * 16 + (7,)
  log = [call(0.114, full), call(0.048, tail), call(0.090, full), call(0.080, full),
         call(0.010, full, rows=2)]  # the last at another shape: no peer
  assert first_call_against_peers(log) == {"first_s": 0.114, "peers_median_s": 0.085,
                                           "peers": 2}
  assert first_call_against_peers([call(0.1, full), call(0.05, tail)]) is None
  assert first_call_against_peers([]) is None


def test_the_learned_default_decodes_with_the_shipped_policy(tmp_path):
  """learned_default: the default's engine with demo/policy picking each request's block size
  (what decode.py's demo config runs): AR's tokens, and the sizes used and picked reported;
  learned_fixed decodes at the fixed size in that same engine, its tallies under
  learned_default's. --precompile leaves nothing to compile in the timed runs. With --shape
  (forced drafts need a fixed size) learned_default is refused, naming the flag, and
  learned_fixed without learned_default too."""
  out = tmp_path / "bench"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "benchmarks.controllers", "--repeats=1", "--max_new_tokens=12",
       "--methods=learned_default", "--controller_costs=1,1.1,1.3,1.6,2.0",
       "--controller_draft_cost=0.8", "--bootstrap_reps=50", *args],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  proc = run("--num_prompts=2", "--half=eval", f"--out={out}",
             "--methods=learned_default,learned_fixed")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((out / "controllers.json").read_text())
  assert report["methods"]["learned_default"]["identical_to_ar"] == 2
  assert report["methods"]["learned_fixed"]["identical_to_ar"] == 2
  assert "learned_default/learned_fixed" in report["intervals"]
  # one engine for both: compiled and tallied once, under the owner's name
  assert set(report["compiles"]) == set(report["timed_compiles"]) == {"ar", "learned_default"}
  assert report["precompile_s"] == {} and report["timed_compiles"]["learned_default"] > 0
  assert report["policy"] == "demo/policy"
  sizes = report["learned_block_sizes"]
  assert sum(sizes["used"].values()) == sum(sizes["picked"].values()) == 2, sizes
  assert "learned_default block sizes (fastest decodes)" in proc.stdout
  refused = run("--shape=tiny", "--num_prompts=1")
  assert refused.returncode != 0 and "--methods: learned_default" in refused.stderr
  alone = run("--methods=learned_fixed", "--num_prompts=1")
  assert alone.returncode != 0 and "learned_fixed decodes in learned_default's" in alone.stderr
  ready = run("--num_prompts=1", "--half=eval", f"--out={tmp_path / 'ready'}", "--methods=ar",
              "--precompile")
  assert ready.returncode == 0, ready.stderr[-3000:]
  report = json.loads((tmp_path / "ready" / "controllers.json").read_text())
  assert set(report["precompile_s"]) == {"ar"} and report["timed_compiles"] == {"ar": 0}
  assert "precompiled (s): ar " in ready.stdout
