"""decode.py's run on the shipped demo: methods compared in one interleaved run, mode=ar on the
demo config, --config.num_prompts, bad block sizes, drafters and policies made for other
targets, and no half-written output after a failure."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bp_jax.decode_job import run as run_decode
from bp_jax.decoding.engine import Engine
from bp_jax.errors import BadInputError
from configs import demo

PROMPTS = ['def add(a, b):\n    """Return the sum of a and b."""\n',
           'def is_even(n):\n    """Return True if n is even."""\n',
           'def reverse(s):\n    """Return s reversed."""\n']


@pytest.fixture
def cfg(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                          for i, p in enumerate(PROMPTS)))
  c = demo.get_config()
  c.update(dict(prompts=str(path), num_prompts=0, max_new_tokens=12, max_len=128,
                output=str(tmp_path / "out" / "d.jsonl"), show=0, compile_cache="", compare=""))
  return c


def test_methods_compared_in_one_interleaved_run(cfg, monkeypatch, capsys):
  calls = []
  real = Engine.generate
  monkeypatch.setattr(Engine, "generate", lambda self, ids, **kw: (
      calls.append(kw["block_size"]), real(self, ids, **kw))[1])
  cfg.update(dict(compare="ar,b4", repeats=2, block_policy="fixed", block_size=8))
  records, s = run_decode.run(cfg)
  assert len(calls) == 3 * 3 * 2  # prompts x methods x repeats
  per_request = [calls[i:i + 6] for i in range(0, len(calls), 6)]  # methods x repeats each
  assert all(sorted(r) == [1, 1, 4, 4, 8, 8] for r in per_request)
  assert len({tuple(r) for r in per_request}) > 1 and per_request[0] != sorted(per_request[0])
  assert s["main"]["method"] == "b8" and set(s["compare"]) == {"ar", "b4"}
  assert s["repeats"] == 2 and s["compile_cache"] == ""  # --config.compile_cache='': off
  for entry in [s["main"], *s["compare"].values()]:
    assert entry["identical_to_ar"] == len(PROMPTS), entry
    assert entry["decode_tokens_per_s"] > 0
  assert s["compare"]["ar"]["tau"] == 1.0
  # Each method's speed over AR's with its paired interval over the prompts; AR has none.
  # End to end too (prefill and decode seconds): the ratio of the prompts' tokens per second.
  ar = s["compare"]["ar"]
  assert ar["speedup_vs_ar"] is None and ar["end_to_end_vs_ar"] is None
  for entry in (s["main"], s["compare"]["b4"]):
    for field, speed in (("speedup_vs_ar", "decode_tokens_per_s"),
                         ("end_to_end_vs_ar", "tokens_per_s")):
      got, want = entry[field], entry[speed] / ar[speed]
      assert got["lo"] <= got["ratio"] <= got["hi"] and got["ratio"] == pytest.approx(want, 1e-3)
  run_decode.print_summary(s)
  out = capsys.readouterr().out
  for field in ("speedup_vs_ar", "end_to_end_vs_ar"):
    b4 = s["compare"]["b4"][field]
    assert f"{b4['ratio']:.2f}x [{b4['lo']:.2f}, {b4['hi']:.2f}]" in out
  assert "end to end vs AR [95%]" in out
  assert "paired bootstrap over the 3 prompts" in out
  # The run's own method against the best other fixed size (here the only one, b4), paired.
  best = s["main_vs_best_fixed"]
  assert best["method"] == "b4"
  for field, speed in (("decode", "decode_tokens_per_s"), ("end_to_end", "tokens_per_s")):
    got, want = best[field], s["main"][speed] / s["compare"]["b4"][speed]
    assert got["lo"] <= got["ratio"] <= got["hi"] and got["ratio"] == pytest.approx(want, 1e-3)
  fmt = "{ratio:.2f}x [{lo:.2f}, {hi:.2f}]"
  assert (f"main: b8 against the best fixed size in hindsight (b4): {fmt.format(**best['decode'])}"
          f" in decode time, {fmt.format(**best['end_to_end'])} end to end") in out
  for r in records:  # one meaning per figure (no τ for a request that ran no cycle)
    assert r["tau"] == (pytest.approx(sum(r["acceptance_lengths"]) / r["cycles"], abs=1e-4)
                        if r["cycles"] else None)
    assert sum(r["forward_lengths"]) == r["new_tokens"] - 1
  with open(cfg.output + ".summary.json") as f:
    assert json.load(f)["compare"]["b4"]["identical_to_ar"] == len(PROMPTS)


def test_mode_ar_on_the_demo_config_decodes_plainly(cfg, capsys):
  cfg.update(dict(mode="ar"))
  assert cfg.block_policy == "learned"
  records, s = run_decode.run(cfg)
  assert s["block_sizes_used"] == {"1": len(PROMPTS)}
  assert "block_policy=learned is not used" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["fixed", "learned"])
def test_num_prompts_all_or_first_n(cfg, policy):
  """0 and -1: every prompt; n: the first n; the selection the job decodes (with the learned
  policy, after its labelling prompts would be removed), and the records of one whole run."""
  if policy == "learned" and not os.path.isdir(cfg.policy):
    pytest.skip("no shipped policy")
  cfg.block_policy = policy
  choice = run_decode.resolve_block_choice(cfg, run_decode._drafter_block_size(cfg))
  for n, want in ((0, 3), (-1, 3), (1, 1), (2, 2)):
    cfg.num_prompts = n
    assert [p.id for p in run_decode.select_prompts(cfg, choice)] == [
        f"p{i}" for i in range(want)], n
  cfg.num_prompts = 2
  records, _ = run_decode.run(cfg)
  assert [r["id"] for r in records] == ["p0", "p1"]


def test_num_prompts_below_minus_one_is_refused(cfg):
  cfg.num_prompts = -2
  with pytest.raises(BadInputError, match="--config.num_prompts=-2"):
    run_decode.run(cfg)


@pytest.mark.parametrize("field, value, flag", [("block_sizes", "0", "--config.block_sizes"),
                                                ("block_sizes", "-3,0", "--config.block_sizes"),
                                                ("block_size", 0, "--config.block_size")])
def test_block_sizes_below_one_fail_before_decoding(cfg, field, value, flag):
  cfg.update({field: value, "block_policy": "fixed"})
  with pytest.raises(BadInputError, match=f"{flag}=.*block sizes must be integers >= 1"):
    run_decode.run(cfg)
  assert not os.path.exists(os.path.dirname(cfg.output))


def _copy_with_meta(src: str, dst: str, edit) -> str:
  shutil.copytree(src, dst)
  path = os.path.join(dst, "bp_jax.json")
  with open(path) as f:
    meta = json.load(f)
  edit(meta)
  with open(path, "w") as f:
    json.dump(meta, f)
  return dst


def test_drafter_trained_for_another_target_is_refused(cfg, tmp_path, capsys):
  cfg.update(dict(block_policy="fixed", drafter=_copy_with_meta(
      cfg.drafter, str(tmp_path / "foreign"),
      lambda m: m.update(target_fingerprint="0123456789abcdef"))))
  with pytest.raises(BadInputError, match="fingerprint 0123456789abcdef.*allow_foreign_drafter"):
    run_decode.run(cfg)
  cfg.allow_foreign_drafter = True
  records, _ = run_decode.run(cfg)
  assert len(records) == len(PROMPTS)
  assert "WARNING" in capsys.readouterr().out


def test_policy_labelled_with_another_target_is_refused(cfg, tmp_path):
  if not os.path.isdir(cfg.policy):
    pytest.skip("no shipped policy")
  cfg.policy = _copy_with_meta(cfg.policy, str(tmp_path / "foreign_policy"),
                               lambda m: m["labels"].update(target_fingerprint="feedfeedfeedfeed"))
  with pytest.raises(BadInputError, match="labelled with a target of fingerprint feedfeed"):
    run_decode.run(cfg)


def test_a_failure_mid_run_leaves_no_partial_output(cfg, monkeypatch):
  real, seen = Engine.generate, []

  def fail_second(self, ids, **kw):
    seen.append(1)
    if len(seen) == 2:
      raise BadInputError("simulated failure")
    return real(self, ids, **kw)

  monkeypatch.setattr(Engine, "generate", fail_second)
  cfg.block_policy = "fixed"
  with pytest.raises(BadInputError, match="simulated"):
    run_decode.run(cfg)
  assert not os.path.exists(cfg.output + ".partial") and not os.path.exists(cfg.output)


def test_records_count_ids_the_tokenizer_cannot_decode():
  class Tok:
    def __len__(self):
      return 10

    def get_vocab(self):
      return {str(i): i for i in range(10)}

    def decode(self, ids, skip_special_tokens=False):
      return "".join(str(i) for i in ids if i < 10)

  from bp_jax.decoding.generation import Generation
  from bp_jax.text.prompts import Prompt
  g = Generation([3, 12, 15, 4], 0.0, 0.0, 1, [1, 1, 1], [True] * 3, [0] * 3, 5)
  rec = run_decode.record_of(0, Prompt("x", "text"), g, Tok())
  assert rec["ids_beyond_tokenizer"] == 2


def test_fingerprints_are_of_the_stored_weights_whatever_the_dtype(cfg):
  """The drafter records its target's fingerprint over the stored (bfloat16) weights; loading the
  target as float16 rounds them, yet the check compares the stored weights: no false refusal."""
  from bp_jax.weights import provenance
  from bp_jax.weights.checkpoint_io import read_checkpoint_meta
  from bp_jax.weights.loading import load_target

  want = read_checkpoint_meta(cfg.drafter)[1]["target_fingerprint"]
  for dtype in ("float32", "bfloat16", "float16"):
    target = load_target(cfg.target, dtype)
    assert provenance.stored_fingerprint(target, cfg.target, load_target) == want, dtype
  assert provenance.model_fingerprint(load_target(cfg.target, "float16")) != want  # rounded
  # Through decode.py: the job loads and checks the pair in float16 (the paper's loop: nothing
  # priced, so no cost measurement's compiles).
  cfg.update(dict(dtype="float16", block_policy="fixed", num_prompts=1, controller="none"))
  records, _ = run_decode.run(cfg)
  assert len(records) == 1


def test_rejection_sampling_with_truncation_through_decode(cfg, capsys):
  """--config.verify=rejection with top_k / top_p at T=1: recorded in the summary; not compared
  token-for-token with AR (same distribution, other draws). Its draws depend on where cycles
  start: with the default measured, online prices (choices that follow this machine's timings)
  the summary says a seed's outputs may differ between runs; with given prices they repeat for
  the seed. At T=0 the same config is identical to AR."""
  cfg.update(dict(compare="ar", block_policy="fixed", block_size=8, verify="rejection",
                  temperature=1.0, top_k=50, top_p=0.9))
  _, s = run_decode.run(cfg)
  assert (s["verify"], s["top_k"], s["top_p"], s["min_p"]) == ("rejection", 50, 0.9, 0.0)
  assert s["main"]["identical_to_ar"] is None
  assert s["outputs_repeat_for_seed"] is False
  run_decode.print_summary(s)
  out = capsys.readouterr().out
  assert "outputs are not compared" in out and "may differ between runs" in out
  # Every loop call of the run by shape, AR's (block 1) and the speculative loop's (block 8),
  # one request each: a line of the summary too.
  assert set(s["loop_calls"]) == {"b1x1", "b8x1"}, s["loop_calls"]
  assert all(c["calls"] >= len(PROMPTS) and c["forwards"] > 0 for c in s["loop_calls"].values())
  assert "loop calls (every method of the run)" in out and "b8x1" in out
  cfg.update(dict(controller_costs="1.0,1.2,1.5,2.2,3.6,6.5", controller_draft_cost="1.4"))
  records, s = run_decode.run(cfg)
  assert s["outputs_repeat_for_seed"] is True
  again, _ = run_decode.run(cfg)
  assert [r["output_ids"] for r in again] == [r["output_ids"] for r in records]
  cfg.update(dict(temperature=0.0))
  _, s = run_decode.run(cfg)
  assert s["main"]["identical_to_ar"] == len(PROMPTS)


@pytest.mark.parametrize("field, value, flag", [
    ("verify", "argmax", "--config.verify"), ("top_k", -2, "--config.top_k"),
    ("top_p", 0.0, "--config.top_p"), ("min_p", 1.5, "--config.min_p"),
])
def test_bad_sampling_flags_are_refused_before_decoding(cfg, field, value, flag):
  cfg.update({field: value})
  with pytest.raises(BadInputError, match=flag):
    run_decode.run(cfg)
  assert not os.path.exists(cfg.output)


def test_batched_decode_writes_the_same_records_as_one_at_a_time(cfg):
  """--config.batch_size=2 on the demo (learned policy, AR compared in the same run): the same
  outputs and policy picks per request as batch 1, in no more buckets, one record per request,
  and the batch settings in the summary. (Under the default `priced` a batch's choices follow the measured costs of its
  batch size and the calls' timings, and one request's start the requests before it: back-off
  here, whose choices depend on the tokens alone.)"""
  cfg.update(dict(compare="ar", controller="backoff"))
  one, s_one = run_decode.run(cfg)
  # Tails in fewer slots (on by default) would compile the loops again for 1 slot: their own
  # tests are tests/test_batched_decode.py's.
  cfg.update(dict(batch_size=2, sync_cycles=4, shrink_batches=False))
  many, s = run_decode.run(cfg)
  assert [r["id"] for r in many] == [r["id"] for r in one]
  assert [r["output_ids"] for r in many] == [r["output_ids"] for r in one]
  # The policy's picks are batch 1's sizes; a batch decodes them all at one size
  # (join_learned_sizes, `Engine.joint_size`): never more buckets than batch 1 used
  # (tests/test_batched_decode.py). (Its cycles are not batch 1's: a
  # batch backs off as one, with whichever requests share it.)
  assert [r["policy_block_size"] for r in many] == [r["block_size"] for r in one]
  assert s["block_sizes_picked"] == s_one["block_sizes_used"] and s["join_learned_sizes"]
  assert len(s_one["block_sizes_used"]) >= len(s["block_sizes_used"]), (s_one, s)
  assert (s["batch_size"], s["sync_cycles"], s["mesh"]) == (2, 4, "none")
  assert 0 < s["slot_use"] <= 1 and "slot_use" not in s_one  # batched calls only
  assert all(k.endswith("x2") for k in s["loop_calls"]) and "b1x2" in s["loop_calls"]
  assert all(k.endswith("x1") for k in s_one["loop_calls"]) and "b1x1" in s_one["loop_calls"]
  assert s["main"]["identical_to_ar"] == s["compare"]["ar"]["identical_to_ar"] == len(PROMPTS)
  assert s["shrink_batches"] is False and s["compilations_by_function"]["batch_ar_loop"] == 1
  with open(cfg.output) as f:
    assert len(f.readlines()) == len(PROMPTS)


@pytest.mark.parametrize("field, value, flag", [("batch_size", 0, "--config.batch_size=0"),
                                                ("sync_cycles", -2, "--config.sync_cycles=-2")])
def test_bad_batch_flags_are_refused_before_loading(cfg, field, value, flag):
  cfg[field] = value
  with pytest.raises(BadInputError, match=flag):
    run_decode.run(cfg)
  assert not os.path.exists(os.path.dirname(cfg.output))


def test_batch_switches_must_be_bools():
  """A config that is not a typed ConfigDict (whose typed fields refuse other values
  themselves): the switches must be bools, move_plain_after an integer >= 0."""
  from bp_jax.decode_job.block_choice import batch_options
  assert batch_options({"batch_size": 4})["shrink"] is True
  assert batch_options({"batch_size": 4, "shrink_batches": False})["shrink"] is False
  with pytest.raises(BadInputError, match="--config.shrink_batches='yes'"):
    batch_options({"shrink_batches": "yes"})
  assert batch_options({"batch_size": 4})["join_learned"] is True
  with pytest.raises(BadInputError, match="--config.join_learned_sizes=1"):
    batch_options({"join_learned_sizes": 1})
  assert batch_options({"batch_size": 4})["move_plain_after"] == 3
  assert batch_options({"move_plain_after": 0})["move_plain_after"] == 0
  for bad in (-1, True, 2.5, "3"):
    with pytest.raises(BadInputError, match="--config.move_plain_after=.* integer >= 0"):
      batch_options({"move_plain_after": bad})
