"""The confidence controller's costs, measured where the engine runs (`decoding/costs.py`):
the measurement on toy shapes, the table it gives the controller, the per-machine cache, the
pair rule of given costs, the engine's use of measured costs and the decode summary's lines."""

from __future__ import annotations

import json
import os
import re

import ml_collections
import pytest

from bp_jax.decode_job import records as rec
from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding import controller as control
from bp_jax.decoding import costs
from bp_jax.decoding.controllers import controller_of
from bp_jax.decoding import engine as engine_module
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.errors import BadInputError, named_as_flags

V, MAX_LEN, B = 64, 128, 4


def test_verify_lengths_are_the_controllers_choices():
  assert costs.verify_lengths(8) == (1, 2, 4, 8)
  assert costs.verify_lengths(6) == (1, 2, 4, 6)
  assert costs.verify_lengths(2) == (1, 2)
  for b in (2, 5, 8, 12, 16):
    assert costs.verify_lengths(b) == tuple(k + 1 for k in control.verify_buckets(b))


def test_relative_costs_read_back_the_measured_ones():
  c = costs.ForwardCosts((0.5e-3, 1.0e-3, 1.25e-3, 2.0e-3), 0.75e-3, 1, 8)
  assert c.relative() == ((1.0, 2.0, 2.5, 4.0), 1.5)
  # b = 6: the table adds 8 tokens so that it reads the measured cost at 6 tokens exactly.
  c6 = costs.ForwardCosts((1.0, 2.0, 2.5, 3.0), 0.5, 2, 6)
  table, draft = c6.relative()
  assert table == (1.0, 2.0, 2.5, 3.5) and draft == 0.5
  for n, s in zip(c6.lengths, c6.verify_s):
    assert control.verify_cost(n, table) == pytest.approx(s)
  # Noise making a longer forward cheaper is not believed: costs never decrease with length.
  noisy = costs.ForwardCosts((1.0, 1.3, 1.2, 1.1), 0.3, 1, 8)
  assert noisy.relative() == ((1.0, 1.3, 1.3, 1.3), 0.3)
  # The one-token forward (the AR step, the unit) stays as measured when longer ones are
  # cheaper, as on an H200 at Qwen3-4B shapes: a full cycle then costs under one AR step.
  h200 = costs.ForwardCosts((5.390e-3, 3.317e-3, 3.395e-3, 3.491e-3, 3.639e-3), 0.738e-3, 1, 16)
  table, draft = h200.relative()
  assert table == (1.0, 0.6154, 0.6299, 0.6477, 0.6751) and draft == 0.1369
  assert control.break_even(15, table, draft) == pytest.approx(0.812, abs=1e-3)
  line = c.describe()
  assert "1/2/4/8 tokens" in line and "0.500/1.000/1.250/2.000 ms" in line
  assert "drafter pass 0.750 ms (1.50 AR steps)" in line and "batch 1, block 8" in line
  assert costs.ForwardCosts.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_measurement_on_toy_shapes(zeros_models):
  target, drafter = zeros_models
  c = costs.measure_forward_costs(target, drafter, 2, B, MAX_LEN, reps=4, repeats=3)
  assert c.batch_size == 2 and c.block_size == B and len(c.verify_s) == len(c.lengths) == 3
  assert all(s > 0 for s in c.verify_s) and c.draft_s > 0
  # No assertion compares the timings themselves: on a loaded 2-core machine a toy forward's
  # time is noise (a 4-token forward once timed at under half a 1-token one); the table the
  # controller reads is made monotone by relative(), checked here.
  table, draft = c.relative()
  assert table[0] == 1.0 and list(table[1:]) == sorted(table[1:]) and draft > 0
  # and one row's one-token forward beside the batch's: what a batch's tail would save
  assert c.one_row_s > 0 and c.rows_cost() == c.verify_s[0] / c.one_row_s
  assert costs.ForwardCosts.from_json(json.loads(json.dumps(c.to_json()))) == c
  LoopOptions(controller="confidence", controller_costs=table, controller_draft_cost=draft)
  # A smaller block's drafter pass, timed beside the rest (what a block-size policy's sizes
  # pay); the one-row forward still last.
  c2 = costs.measure_forward_costs(target, drafter, 2, B, MAX_LEN, reps=4, repeats=3,
                                   draft_blocks=(2, B, 1))
  assert [b for b, _ in c2.draft_by_block] == [2] and c2.draft_by_block[0][1] > 0
  assert c2.one_row_s > 0 and len(c2.verify_s) == 3
  assert costs.ForwardCosts.from_json(json.loads(json.dumps(c2.to_json()))) == c2


def test_a_drafter_pass_is_priced_by_its_block():
  """`draft_steps_at`: linear between the blocks timed, held beyond them, never below a
  smaller block's; one block timed prices every block alike; the summary line names them."""
  c = costs.ForwardCosts((1e-3, 1.1e-3, 1.3e-3, 1.6e-3, 2.0e-3), 2.0e-3, 1, 12,
                         draft_by_block=((4, 1.2e-3),))
  assert c.draft_steps_at(12) == pytest.approx(2.0) and c.draft_steps_at(4) == pytest.approx(1.2)
  assert c.draft_steps_at(8) == pytest.approx(1.6) and c.draft_steps_at(2) == pytest.approx(1.2)
  assert c.draft_steps_at(16) == pytest.approx(2.0)
  assert "over a block of 4 1.200 ms (1.20)" in c.describe()
  noisy = costs.ForwardCosts((1e-3,) * 5, 1.0e-3, 1, 12, draft_by_block=((4, 1.5e-3),))
  assert noisy.draft_steps_at(8) == pytest.approx(1.5)  # the larger block never cheaper
  alone = costs.ForwardCosts((1e-3,) * 5, 2.0e-3, 1, 12)
  assert alone.draft_steps_at(5) == alone.draft_steps_at(12) == pytest.approx(2.0)
  # Older cache entries (no draft_by_block) still read.
  old = {k: v for k, v in c.to_json().items() if k != "draft_by_block"}
  assert costs.ForwardCosts.from_json(old).draft_by_block == ()


def test_cache_hits_for_equal_keys_and_misses_when_shapes_change(zeros_models, tmp_path,
                                                                 monkeypatch):
  target, drafter = zeros_models
  calls = []

  def fake(target, drafter, batch_size, block_size, max_len, **kw):
    calls.append((batch_size, block_size, max_len))
    return costs.ForwardCosts(tuple(1.0 + i for i in range(len(costs.verify_lengths(
        block_size)))), 0.5, batch_size, block_size)

  monkeypatch.setattr(costs, "measure_forward_costs", fake)
  folder = str(tmp_path / "costs")
  first, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert not hit and len(calls) == 1 and len(os.listdir(folder)) == 1
  again, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert hit and again == first and len(calls) == 1
  for shapes in ((2, B, MAX_LEN), (1, 8, MAX_LEN), (1, B, 96)):  # any shape: a miss
    _, hit = costs.forward_costs(target, drafter, *shapes, cache_dir=folder)
    assert not hit
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder,
                               scan_layers=True)
  assert not hit and len(calls) == 5 and len(os.listdir(folder)) == 5
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder,
                               remeasure=True)
  assert not hit and len(calls) == 6
  # Another machine's (or a damaged) entry is not used.
  key = costs.cost_key(target, drafter, 1, B, MAX_LEN)
  path = costs._path(folder, key)
  with open(path) as f:
    entry = json.load(f)
  entry["key"]["machine"]["cpu"] = "another CPU"
  with open(path, "w") as f:
    json.dump(entry, f)
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert not hit and len(calls) == 7
  # Same model name, another generation (cloud VMs report "AMD EPYC" for several): a miss.
  with open(path) as f:
    entry = json.load(f)
  vendor, family, model, stepping = entry["key"]["machine"]["cpu_id"].split("/")
  other = str(int(model) + 16) if model.isdigit() else "1"  # never this machine's own
  entry["key"]["machine"]["cpu_id"] = "/".join((vendor, family, other, stepping))
  with open(path, "w") as f:
    json.dump(entry, f)
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert not hit and len(calls) == 8
  # Timed by other code (the models' or this module's sources changed since): a miss.
  with open(path) as f:
    entry = json.load(f)
  entry["key"]["code"] = "0" * 16
  with open(path, "w") as f:
    json.dump(entry, f)
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert not hit and len(calls) == 9
  with open(path, "w") as f:
    f.write("{not json")
  _, hit = costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir=folder)
  assert not hit and len(calls) == 10
  assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]
  # "" = no cache: measured every time, nothing written.
  for _ in range(2):
    assert not costs.forward_costs(target, drafter, 1, B, MAX_LEN, cache_dir="")[1]
  assert len(calls) == 12 and len(os.listdir(folder)) == 5
  assert key["machine"] == costs.machine_fingerprint()
  if os.path.exists("/proc/cpuinfo"):  # Linux: the CPU's generation and features are in it
    assert key["machine"]["cpu_id"].count("/") == 3 and "?" not in key["machine"]["cpu_id"]
    assert len(key["machine"]["cpu_flags"]) == 12


def test_the_code_fingerprint_follows_the_timed_sources(tmp_path):
  """The cost cache's key holds a digest of the timed code's sources: it changes with any one
  of them, and covers the models' files and this module's by default."""
  files = [tmp_path / "a.py", tmp_path / "b.py"]
  for f in files:
    f.write_text("x = 1\n")
  before = costs.code_fingerprint([str(f) for f in files])
  assert before == costs.code_fingerprint([str(f) for f in files]) and len(before) == 16
  files[1].write_text("x = 2\n")
  assert costs.code_fingerprint([str(f) for f in files]) != before
  # the default covers more than this module and the controller's: the models' files
  assert costs.code_fingerprint() != costs.code_fingerprint([costs.__file__, control.__file__])


def test_given_costs_come_as_a_pair():
  for kw in (dict(controller_costs="1,2"), dict(controller_draft_cost=0.5)):
    with pytest.raises(BadInputError, match="give both or neither") as e:
      LoopOptions(controller="confidence", **kw)
    assert "controller_costs=" in str(e.value) and "controller_draft_cost=" in str(e.value)
    with pytest.raises(BadInputError) as e:
      with named_as_flags(["controller_costs", "controller_draft_cost"]):
        LoopOptions(controller="confidence", **kw)
    assert "--config.controller_costs=" in str(e.value)
    assert "--config.controller_draft_cost=" in str(e.value)
  assert LoopOptions().controller_costs is None and LoopOptions().controller_draft_cost is None
  assert LoopOptions(controller="confidence").needs_costs()
  assert not LoopOptions(controller="backoff").needs_costs()
  with pytest.raises(BadInputError, match="has no costs"):
    controller_of(LoopOptions(controller="confidence").in_effect().for_loop(B))


@pytest.mark.parametrize("costs_flag, draft_flag, want", [
    ("measure", "measure", (None, None)),
    (None, None, (None, None)),  # absent from the config: measured
    ("1,2.5", 0.75, ((1.0, 2.5), 0.75)),
    ("1,2.5", "0.75", ((1.0, 2.5), 0.75)),  # a string field overridden on the command line
])
def test_config_reads_measure_or_values(costs_flag, draft_flag, want):
  cfg = {"controller": "confidence"}
  if costs_flag is not None:
    cfg.update(controller_costs=costs_flag, controller_draft_cost=draft_flag)
  opts = loop_options(ml_collections.ConfigDict(cfg))
  assert (opts["controller_costs"], opts["controller_draft_cost"]) == want


@pytest.mark.parametrize("kw", [dict(controller_costs="1,2", controller_draft_cost="measure"),
                                dict(controller_costs="measure", controller_draft_cost=1.0)])
def test_config_refuses_half_a_pair_naming_both_flags(kw):
  with pytest.raises(BadInputError, match=re.escape("give both or neither")) as e:
    loop_options(ml_collections.ConfigDict(dict(controller="confidence", **kw)))
  assert "--config.controller_costs=" in str(e.value)
  assert "--config.controller_draft_cost=" in str(e.value)


def _engine(zeros_models, tmp_path, measured_costs=None, batching=BatchOptions(), **loop
            ) -> Engine:
  target, drafter = zeros_models
  return Engine(target, drafter=drafter, cost_cache=str(tmp_path / "costs"),
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=(16, 32, 64),
                                    block_sizes=(1, B)),
                loop=LoopOptions(**loop), batching=batching, measured_costs=measured_costs)


def test_engine_measures_caches_and_uses_its_costs(zeros_models, tmp_path, monkeypatch):
  eng = _engine(zeros_models, tmp_path, controller="confidence")
  assert eng.measured_costs is not None and eng.costs_from_cache is False
  assert eng.costs_source == "measured"
  assert eng.measured_costs.block_size == B and eng.measured_costs.batch_size == 1
  table, draft = eng.measured_costs.relative()
  assert eng.loop_options.controller_costs == table
  assert eng.loop_options.controller_draft_cost == draft
  again = _engine(zeros_models, tmp_path, controller="confidence")
  assert again.costs_from_cache is True and again.costs_source == "cached"
  assert again.measured_costs == eng.measured_costs
  # Greedy output is AR's with measured costs.
  prompt = list(range(3, 20))
  ar = eng.generate(prompt, max_new_tokens=30, block_size=1).output_ids
  assert eng.generate(prompt, max_new_tokens=30, block_size=B).output_ids == ar
  # Nothing to measure: given costs, a loop that prices nothing, or no drafter.
  given = _engine(zeros_models, tmp_path, controller="confidence", controller_costs="1,2,3",
                  controller_draft_cost=0.5)
  assert given.measured_costs is None and given.costs_source == "given"
  assert given.loop_options.controller_costs == (1.0, 2.0, 3.0)
  plain = _engine(zeros_models, tmp_path, controller="backoff", ar_fallback=4)
  assert plain.measured_costs is None and plain.costs_source is None
  alone = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN),
                 loop=LoopOptions(controller="confidence"))
  assert alone.measured_costs is None
  # A caller's measurement (a benchmark building several engines measures once): taken as it
  # is, neither measured again nor read from the cache; one of other shapes is refused.
  monkeypatch.setattr(engine_module, "forward_costs",
                      lambda *a, **k: pytest.fail("measured again"))
  shared = _engine(zeros_models, tmp_path / "other", controller="confidence",
                   measured_costs=eng.measured_costs)
  assert shared.measured_costs is eng.measured_costs and shared.costs_source == "measured"
  assert shared.loop_options.controller_costs == table
  with pytest.raises(BadInputError, match=re.escape(
      "measured_costs: measured at batch size 1 and block size 4, but the engine runs batch "
      "size 2 and block sizes up to 4")):
    _engine(zeros_models, tmp_path, controller="confidence", measured_costs=eng.measured_costs,
            batching=BatchOptions(batch_size=2))


def _record(verified: list[int]) -> dict:
  cycles = sum(v > 0 for v in verified)
  return {"new_tokens": len(verified) + 1, "prefill_s": 0.01, "decode_s": 0.1,
          "acceptance_lengths": [1] * cycles, "tau": 1.0 if cycles else None,
          "tokens_per_forward": 1.0, "cycles": cycles, "ar_steps": len(verified) - cycles,
          "forward_verified": verified, "block_size": B, "ids_beyond_tokenizer": 0}


def test_summary_says_which_costs_and_the_verify_lengths_chosen(zeros_models, tmp_path, capsys):
  eng = _engine(zeros_models, tmp_path, controller="confidence")
  cfg = ml_collections.ConfigDict(dict(mode="spec", block_policy="fixed", temperature=0.0))
  records = [_record([4, 4, 0, 1, 2]), _record([4, 1])]
  s = rec.summarize(records, eng, cfg, wall_s=1.0)
  assert s["verify_lengths_chosen"] == {"batch_size": 1, "lengths": {"1": 2, "2": 1, "4": 3}}
  c = s["controller_costs"]
  assert c["source"] == "measured" and c["verify_costs"] == list(eng.loop_options.controller_costs)
  assert c["measured"]["block_size"] == B and c["described"] == eng.measured_costs.describe()
  json.dumps(s)
  rec.print_summary(s)
  out = capsys.readouterr().out
  assert re.search(r"controller costs\s+measured: verify 1,[0-9.,]+ AR steps", out)
  assert "target forward over 1/2/4 tokens" in out
  assert re.search(r"verify length per cycle \(batch 1\)\s+1: 2 \(33%\), 2: 1 \(17%\), "
                   r"4: 3 \(50%\)", out)
  given = _engine(zeros_models, tmp_path, controller="confidence", controller_costs="1,2",
                  controller_draft_cost=0.5)
  rec.print_summary(rec.summarize(records, given, cfg, wall_s=1.0))
  assert re.search(r"controller costs\s+given: verify 1,2 AR steps \(1, 2, 4, \.\.\. tokens\), "
                   r"drafter 0\.5\n", capsys.readouterr().out)
  plain = _engine(zeros_models, tmp_path, controller="backoff", ar_fallback=4)
  s = rec.summarize(records, plain, cfg, wall_s=1.0)
  assert s["controller_costs"] is None and s["plain_starts"] == 0
  rec.print_summary(s)
  out = capsys.readouterr().out
  assert "controller costs" not in out and "decoded plain" not in out
  # A request the priced start decoded in the plain AR loop (`Engine.starts_plain`) is counted.
  s = rec.summarize(records + [dict(_record([0, 0, 0]), plain_start=True)],
                    given, cfg, wall_s=1.0)
  assert s["plain_starts"] == 1
  rec.print_summary(s)
  out = capsys.readouterr().out
  assert re.search(r"decoded plain by the priced start\s+1 of 3 requests", out)
  assert "probes" not in out
  # decode.py's summary counts the plain loop's probes (`Engine.plain_probes`) where any ran.
  rec.print_summary(dict(s, plain_probes=2))
  assert re.search(r"plain loop timed by probes\s+2 calls on copies of drafting rows",
                   capsys.readouterr().out)


def test_batch_tails_shrink_only_where_rows_cost(zeros_models, monkeypatch):
  """A batch's tail runs in fewer slots only where the measured costs say rows cost: a full
  batch's one-token forward at least `SHRINK_ROWS_COST` one-row ones (this CPU at the demo's
  shapes: ~5 at 8 rows). Where it costs less (an H200 at Qwen3-4B shapes: 16 rows 3.85 ms, one
  row 5.39 ms) the tail keeps its slots and compiles no loop per tail size; the summary says
  so. Costs not measured (given, or a cache entry from before one_row_s): shrink as set."""
  from bp_jax.decoding import engine as engine_lib
  from toy_models import toy_engine

  def engine(rows_s, one_row_s, **loop):
    measured = costs.ForwardCosts((rows_s, 1.1 * rows_s, 1.2 * rows_s), 0.5 * rows_s, 4, B,
                                  one_row_s)
    monkeypatch.setattr(engine_lib, "forward_costs", lambda *a, **k: (measured, False))
    return toy_engine(zeros_models, "priced", batch_size=4, sync_cycles=4, shrink=True, **loop)

  assert engine(5e-3, 1e-3).shrink
  flat = engine(3.85e-3, 5.39e-3)
  assert not flat.shrink
  assert "batch tails keep their slots (a full batch's step costs 0.71" in rec.costs_line(
      rec.controller_costs_of(flat))
  assert engine(3.85e-3, None).shrink  # not measured
  assert engine(1.0, 2.0, controller_costs="1,1.1,1.2", controller_draft_cost=0.5).shrink
