"""BlockPilot's stages on a tiny random target and drafter: labels (oracle measurements +
features in TFDS), policy (per rule and head, for two feature types; shipped), report (table, overhead,
intra-request analysis, plots), decode.py's learned / oracle / random block policies, and the
refusals: labelling and evaluation prompts never overlap."""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bp_jax.text.bpe import MASK_ID, train_bpe
from bp_jax.weights.checkpoint_io import save_checkpoint
from bp_jax.models.config import Qwen3Config
from bp_jax.data import open_dataset
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.errors import BadInputError
from bp_jax.models.nnx_utils import module_params
from bp_jax.policy.mlp import load_policy, prompt_hash
from bp_jax.models.qwen3 import Qwen3
from bp_jax.data import label_sets
from bp_jax.train import labels as lab
from bp_jax.train import policy_stage as ps
from bp_jax.train.draft import drafter_config, export_drafter
from configs import qwen3 as qwen3_config

SIZES = (1, 2, 3, 4)  # the drafter's size 3 +- 1, and 1 = plain AR (blockpilot.include_ar)
FEATURES = ("pooled_layers", "draft_confidence")  # the policies trained
MAX_NEW = 10


def _snippet(i: int) -> str:
  return (f"def task_{i}(values):\n    \"\"\"Return the total of item {i}.\"\"\"\n"
          f"    total = 0\n    for v in values:\n        total += v * {i}\n")


def _jsonl(path, prompts) -> str:
  with open(path, "w", encoding="utf-8") as f:
    for pid, text in prompts:
      f.write(json.dumps({"id": pid, "prompt": text}) + "\n")
  return str(path)


def _config(root, workdir: str) -> ml_collections.ConfigDict:
  cfg = qwen3_config.get_config()
  cfg.workdir, cfg.seed, cfg.dtype, cfg.export_dir = workdir, 0, "float32", str(root / "ship")
  cfg.max_len, cfg.corpus = 128, str(root / "corpus")
  cfg.ar_fallback = 2  # the loops with AR fallback steps (labels use measured loop times)
  cfg.lm_data = ml_collections.ConfigDict({"val_frac": 0.2})
  cfg.regenerate = ml_collections.ConfigDict({"source": ""})
  cfg.blockpilot = qwen3_config.blockpilot_config(
      radius=1, eval_source=str(root / "eval.jsonl"), eval_frac=0.5,
      label_sources=str(root / "extra.jsonl"), corpus_prompts=3, corpus_prompt_tokens=24,
      max_new_tokens=MAX_NEW, hidden_dim=16, steps=20, batch=4, eval_every=5, patience=3,
      val_frac=0.25, cost_prompts=2, cost_reps=3)
  # Two of the four feature types (every type's features are stored and checked in the labels;
  # one policy per type trains the same way): 2 types x 2 rules x 2 heads = 8 policies.
  cfg.blockpilot.features = ",".join(FEATURES)
  return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A workdir with a tokenizer, a random target and a drafter trained against it (export only),
  a JSONL 'evaluation source' of 8 prompts, 6 extra labelling prompts and a small corpus."""
  root = tmp_path_factory.mktemp("blockpilot")
  corpus = root / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"mod_{i}.py").write_text("".join(_snippet(100 * i + j) for j in range(6)))
  texts = [_snippet(i) for i in range(40)]
  tok_dir = str(root / "tok")
  tok = train_bpe(texts, 300, tok_dir)
  workdir = str(root / "work")
  tcfg = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256)
  target = Qwen3(tcfg, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  extra = {n: os.path.join(tok_dir, n) for n in os.listdir(tok_dir)}
  save_checkpoint(os.path.join(workdir, "target"), module_params(target), tcfg.to_hf_dict(),
                  {"kind": "qwen3"}, extra_files=extra)
  dcfg = drafter_config(tcfg, ml_collections.ConfigDict(
      {"num_layers": 1, "block_size": 3, "target_layer_ids": (1, 2)}), MASK_ID)
  export_drafter(DFlashDrafter(dcfg, rngs=nnx.Rngs(3)), os.path.join(workdir, "drafter"), target)
  _jsonl(root / "eval.jsonl", [(f"e{i}", _snippet(1000 + i)) for i in range(8)])
  _jsonl(root / "extra.jsonl", [(f"x{i}", _snippet(2000 + i)) for i in range(6)])
  return {"root": root, "cfg": _config(root, workdir), "tok": tok, "target": target}


# ---- pure pieces -----------------------------------------------------------------------------


def _rec(tau, cycles, new, secs):
  """Labels of the paper's loop: every target forward is a cycle."""
  return {"tau": np.asarray(tau, np.float32), "cycles": np.asarray(cycles, np.int32),
          "forwards": np.asarray(cycles, np.int32),
          "tokens_per_forward": np.asarray(tau, np.float32),
          "new_tokens": np.asarray(new, np.int32), "decode_s": np.asarray(secs, np.float32),
          "committed": np.rint(np.asarray(tau) * np.asarray(cycles)).astype(np.int32),
          "block_sizes": np.asarray((2, 3, 4), np.int32)}


def test_label_rules():
  # Per-cycle cost of sizes 2/3/4: 1, 2, 4 ms (medians over the three prompts).
  recs = [_rec([2.0, 2.5, 2.5], [10, 8, 8], [20, 20, 20], [0.010, 0.016, 0.032]),
          _rec([1.5, 2.0, 3.8], [12, 10, 5], [18, 20, 19], [0.012, 0.020, 0.020]),
          _rec([1.0, 1.0, 1.0], [9, 9, 9], [9, 9, 9], [0.0095, 0.0170, 0.0400])]
  np.testing.assert_allclose(label_sets.cycle_costs(recs), [0.001, 0.002, 0.004], rtol=1e-5)
  # max_tau: ties go to the smaller size (prompt 0: 3 over 4; prompt 2: 2).
  assert label_sets.labels_of(label_sets.label_values(recs, "max_tau")).tolist() == [1, 2, 0]
  # max_throughput: tokens / (cycles * cost): prompt 0: 20/10, 20/16, 20/32 ms -> size 2;
  # prompt 1: 18/12, 20/20, 19/20 -> size 2 (1.5 > 1.0 > 0.95).
  thr = label_sets.label_values(recs, "max_throughput")
  np.testing.assert_allclose(thr[0], [2000.0, 1250.0, 625.0], rtol=1e-4)
  assert label_sets.labels_of(thr).tolist() == [0, 0, 0]
  # Labels measured with AR fallback steps: each prompt's own loop time (prompt 1: 18/12,
  # 20/20, 19/20 ms -> size 2; prompt 0: 20/10, 20/16, 20/32 -> size 2), not cycles * cost.
  fb = [{**r, "ar_fallback": 16} for r in recs]
  np.testing.assert_allclose(label_sets.decode_seconds(fb), label_sets.stack(recs, "decode_s"))
  np.testing.assert_allclose(label_sets.label_values(fb, "max_throughput")[1], [1500, 1000, 950],
                             rtol=1e-4)
  assert label_sets.labels_of(label_sets.label_values(fb, "max_throughput")).tolist() == [0, 0, 0]
  m = ps.choice_metrics(fb[:2], np.array([2, 0]), label_sets.cycle_costs(recs))
  assert m["est_tokens_per_s"] == pytest.approx((20 + 18) / (0.032 + 0.012))
  # A prompt with no cycle (its first token was a stop token) cannot be labelled.
  assert label_sets.usable(recs + [_rec([0, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0])]).tolist() == [
      True, True, True, False]
  with pytest.raises(BadInputError, match="unknown label rule"):
    label_sets.label_values(recs, "max_speed")
  # Choice metrics: tau = mean over prompts of each prompt's tau (decode.py's figure); pooled
  # over cycles = committed / cycles over the chosen sizes.
  m = ps.choice_metrics(recs[:2], np.array([2, 2]), label_sets.cycle_costs(recs))
  assert m["tau"] == pytest.approx((2.5 + 3.8) / 2)
  assert m["tau_pooled_over_cycles"] == pytest.approx((20 + 19) / 13)
  assert ps.best_static(recs[:2], "max_tau", label_sets.cycle_costs(recs)) == 2
  assert ps.best_static(recs[:2], "max_throughput", label_sets.cycle_costs(recs)) == 0


def test_prompt_split_is_deterministic_disjoint_and_overlap_is_refused(setup, tmp_path):
  cfg = setup["cfg"]
  label, evals = lab.prompt_sets(cfg, setup["tok"])
  label2, evals2 = lab.prompt_sets(cfg, setup["tok"])
  assert [p.key for p in label] == [p.key for p in label2]
  assert [p.key for p in evals] == [p.key for p in evals2]
  assert len(evals) == 4 and len(label) == 4 + 6 + 3
  assert not {p.hash for p in label} & {p.hash for p in evals}
  assert sum(p.key.startswith("corpus:") for p in label) == 3
  # An extra labelling source holding an evaluation prompt's text (under another id) is refused.
  leak = _jsonl(tmp_path / "leak.jsonl", [("fresh", _snippet(5000)), ("copy", evals[1].text)])
  bad = ml_collections.ConfigDict(cfg.to_dict())
  bad.blockpilot.label_sources = leak
  with pytest.raises(BadInputError, match="must never overlap"):
    lab.prompt_sets(bad, setup["tok"])
  with pytest.raises(BadInputError, match="overlap"):
    lab.check_no_overlap(label, evals + [label[0]])


# ---- the stages ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stages_done(setup):
  cfg = setup["cfg"]
  lab.labels_stage(cfg)
  ps.policy_stage(cfg)
  from bp_jax.train.report_stage import report_stage
  report_stage(cfg)
  return cfg


def test_labels_datasets(setup, stages_done, capsys):
  cfg = stages_done
  data = os.path.join(cfg.workdir, "data")
  label, evals = open_dataset(data, label_sets.LABELS), open_dataset(data, label_sets.EVAL_LABELS)
  assert len(label) == 13 and len(evals) == 4
  assert not {r["text_hash"] for r in label} & {r["text_hash"] for r in evals}
  want_keys = [p.key for p in lab.prompt_sets(cfg, setup["tok"])[0]]
  assert [r["key"] for r in label] == want_keys
  dims = {"last_logits": 300, "last_hidden": 32, "pooled_layers": 2 * 2 * 32,
          "draft_confidence": 2 * 3}
  for r in list(label) + list(evals):
    assert r["block_sizes"].tolist() == list(SIZES)
    for f, d in dims.items():
      assert r[f"feat_{f}"].shape == (d,)
    # accept_lens / forward_is_cycle: every target forward, size after size; tau counts the
    # speculative cycles only, tokens_per_forward every forward (AR fallback steps too).
    fwd = r["forwards"]
    assert r["accept_lens"].size == r["forward_is_cycle"].size == fwd.sum()
    assert (r["accept_lens"] >= 1).all() and (r["committed"] == r["new_tokens"] - 1).all()
    parts = np.split(r["accept_lens"], np.cumsum(fwd)[:-1])
    flags = np.split(r["forward_is_cycle"], np.cumsum(fwd)[:-1])
    assert [int(p.max(initial=1)) <= b for p, b in zip(parts, SIZES)] == [True] * len(SIZES)
    assert [int(f.sum()) for f in flags] == r["cycles"].tolist()
    np.testing.assert_allclose(r["tau"], [p[f].mean() for p, f in zip(parts, flags)], rtol=1e-6)
    np.testing.assert_allclose(r["tokens_per_forward"], r["committed"] / fwd, rtol=1e-6)
  # Each label set records the settings it was measured with: the loops' form with AR fallback.
  from bp_jax.decode_job.block_choice import loop_options
  made = label_sets.label_set_settings(evals)
  assert made == label_sets.label_set_settings(label)
  assert made == label_sets.decode_settings(MAX_NEW, 0.0, False, loop_options(cfg))
  assert made["ar_fallback"] == 2 and made["scan_layers"] is False
  # The stored measurements and features are the engine's: one prompt re-decoded here in the
  # loop form and with the settings the label set records.
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import LoopOptions, ShapeOptions
  from bp_jax.weights.loading import load_drafter, load_target
  target = load_target(os.path.join(cfg.workdir, "target"))
  drafter = load_drafter(os.path.join(cfg.workdir, "drafter"), target.cfg)
  prompt = lab.prompt_sets(cfg, setup["tok"])[1][0]
  ids = lab.encode(prompt, setup["tok"], made["chat"])
  engine = Engine(target, stop_ids=[0], drafter=drafter,
                  shapes=ShapeOptions(max_len=128, block_sizes=SIZES),
                  loop=LoopOptions(**{k: made[k] for k in ("scan_layers", "ar_fallback",
                                                           "ar_fallback_accept")}))
  rec = next(r for r in evals if r["key"] == prompt.key)
  accepts = np.split(rec["accept_lens"], np.cumsum(rec["forwards"])[:-1])
  flags = np.split(rec["forward_is_cycle"], np.cumsum(rec["forwards"])[:-1])
  for k, b in enumerate(SIZES):
    g = engine.generate(ids, max_new_tokens=made["max_new_tokens"],
                        temperature=made["temperature"], seed=0, block_size=b,
                        return_features=True)
    assert g.target_forwards == rec["forwards"][k] and g.cycles == rec["cycles"][k]
    assert g.new_tokens == rec["new_tokens"][k]
    assert g.forward_lengths == accepts[k].tolist()
    assert g.forward_is_cycle == flags[k].tolist()
  np.testing.assert_allclose(g.features["last_logits"], rec["feat_last_logits"], rtol=1e-5)
  # Rerunning with the same settings does nothing; the stamp names the drafter's weights, so a
  # retrained drafter of the same architecture is labelled again.
  from bp_jax.train.regenerate import model_fingerprint, read_stamp
  stamp = read_stamp(os.path.join(data, lab.STAMP_DIR))
  assert stamp["drafter_fingerprint"] == model_fingerprint(drafter)
  assert stamp["scan_layers"] is False
  capsys.readouterr()
  lab.labels_stage(cfg)
  assert "[labels] up to date" in capsys.readouterr().out


def test_cost_table_prices_the_labels_and_two_labelling_runs_agree(setup, stages_done, tmp_path,
                                                                  capsys):
  cfg = stages_done
  from bp_jax.train import cost_table as costs
  data = os.path.join(cfg.workdir, "data")
  table = json.load(open(os.path.join(data, costs.TABLE_FILE)))
  assert table["key"]["machine"] == costs.machine_fingerprint()
  assert table["ar_step_s"] > 0 and sorted(table["cycle_s"]) == ["2", "3", "4"]
  assert sorted(table["fallback_step_s"]) == ["2", "3", "4"]  # the loops take fallback steps
  ds = open_dataset(data, label_sets.LABELS)
  assert label_sets.label_set_costs(ds) == table
  records = list(ds)
  # Throughput labels are the runs' counts priced by the table, not their own timings.
  r = records[0]
  steps = r["forwards"] - r["cycles"]
  want = [r["forwards"][0] * table["ar_step_s"]] + [
      r["cycles"][k] * table["cycle_s"][str(b)] + steps[k] * table["fallback_step_s"][str(b)]
      for k, b in enumerate(SIZES) if b > 1]
  np.testing.assert_allclose(label_sets.decode_seconds(records, table)[0], want, rtol=1e-9)
  # A second labelling run on this machine (a fresh workdir with the same models) reuses the
  # stored table and gives the same labels under both rules.
  cfg2 = ml_collections.ConfigDict(cfg.to_dict())
  cfg2.workdir = str(tmp_path / "work2")
  for part in ("target", "drafter"):
    shutil.copytree(os.path.join(cfg.workdir, part), os.path.join(cfg2.workdir, part))
  os.makedirs(os.path.join(cfg2.workdir, "data"))
  shutil.copy(os.path.join(data, costs.TABLE_FILE), os.path.join(cfg2.workdir, "data"))
  capsys.readouterr()
  lab.labels_stage(cfg2)
  assert "cost table (reused" in capsys.readouterr().out
  again = list(open_dataset(os.path.join(cfg2.workdir, "data"), label_sets.LABELS))
  for rule in ("max_tau", "max_throughput"):
    np.testing.assert_array_equal(
        label_sets.labels_of(label_sets.label_values(records, rule, table)),
        label_sets.labels_of(label_sets.label_values(again, rule, table)))
  # Remeasuring the table re-prices the stored decodes without decoding them again.
  cfg2.blockpilot.cost_table = "remeasure"
  capsys.readouterr()
  lab.labels_stage(cfg2)
  out = capsys.readouterr().out
  assert "cost table (measured" in out and "decodes up to date, priced by the new" in out
  repriced = open_dataset(os.path.join(cfg2.workdir, "data"), label_sets.LABELS)
  assert label_sets.label_set_costs(repriced) != table
  np.testing.assert_array_equal(label_sets.stack(list(repriced), "cycles"),
                                label_sets.stack(again, "cycles"))
  # A table measured under another key is measured again; a given table that cannot price a
  # size is refused, naming the file and the missing size.
  key = dict(table["key"], target="another model")
  fresh, how = costs.obtain_table("auto", os.path.join(data, costs.TABLE_FILE), key,
                                  lambda: {**{k: table[k] for k in table if k != "key"}}, SIZES,
                                  True)
  assert how == "measured" and fresh["key"] == key
  bad = tmp_path / "bad_table.json"
  bad.write_text(json.dumps({**table, "cycle_s": {"2": 0.001}}))
  with pytest.raises(BadInputError, match="bad_table.json: no cost for '3'"):
    costs.obtain_table(str(bad), "", key, dict, SIZES, True)


def test_policies_trained_saved_and_shipped(stages_done):
  cfg = stages_done
  summary = json.load(open(os.path.join(cfg.workdir, "policies", "summary.json")))
  names = {f"{f}:{r}{h}" for f in FEATURES
           for r in ("max_tau", "max_throughput") for h in ("", ":value")} | {
               f"{f}:max_throughput:priced" for f in FEATURES}
  assert set(summary["policies"]) == names
  assert summary["train_prompts"] + summary["val_prompts"] == 13 and summary["val_prompts"] >= 2
  records = lab.read_label_set(cfg, label_sets.LABELS, "test")
  evals = lab.read_label_set(cfg, label_sets.EVAL_LABELS, "test")
  for name, entry in summary["policies"].items():
    policy, info = load_policy(entry["checkpoint"])
    assert info.block_sizes == SIZES and info.label_rule == name.split(":")[1]
    assert policy.arch.feature_type == name.split(":")[0]
    assert info.target_layer_ids == (1, 2)
    assert info.labelled_hashes == {r["text_hash"] for r in records}
    assert not info.labelled_hashes & {r["text_hash"] for r in evals}
    assert 0.0 <= entry["val_accuracy"] <= 1.0 and entry["steps_run"] <= 20
    assert policy.arch.head == entry["head"] == (name.split(":")[2] if name.count(":") == 2
                                                 else "classify")
    if entry["head"] == "priced":  # counts prior and lam chosen; priced as labelled
      assert policy.decision()["lam"] == entry["lam"] in [g["lam"] for g in entry["lam_grid"]]
      assert np.allclose(policy.decision()["prior"], entry["prior"], atol=1e-5)
      table = label_sets.label_set_costs(label_sets.open_label_set(
          os.path.join(cfg.workdir, "data", label_sets.LABELS)))
      assert policy.prices()["cycle"][1] == round(
          table["cycle_s"]["2"] / table["ar_step_s"], 4)
    if entry["head"] == "value":  # the decision rule chosen on the validation prompts, stored
      grid = entry["lam_grid"]
      assert [g["lam"] for g in grid] == [0.0, 0.25, 0.5, 0.75, 1.0]
      assert grid[0]["vs_static"] == grid[0]["lo"] == grid[0]["hi"] == 1.0
      assert entry["lam"] in [g["lam"] for g in grid if g["lo"] >= 1.0]
      assert policy.decision()["lam"] == entry["lam"] and info.meta["lam_grid"] == grid
      assert SIZES[policy.decision()["static_class"]] == entry["static_size"]
      assert entry["val_policy"]["est_tokens_per_s"] >= 0.0
  shipped = os.path.join(cfg.export_dir, "policy")
  assert summary["shipped"][1] == os.path.abspath(shipped)
  _, info = load_policy(shipped)
  assert info.block_sizes == SIZES


def test_report(stages_done):
  cfg = stages_done
  out = os.path.join(cfg.workdir, "report")
  for name in ("report.md", "report.json", "runs.jsonl", "tau_by_size.png", "chosen_sizes.png",
               "acceptance_hist.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0, name
  rep = json.load(open(os.path.join(out, "report.json")))
  methods = [r["method"] for r in rep["rows"]]
  # Size 1 is the AR row itself (no second AR run, no "fixed b=1" row).
  assert methods[0] == "AR (b=1)" and [f"fixed b={b}" for b in SIZES[1:]] == methods[1:4]
  assert sum(m.startswith("best static") for m in methods) == 2
  # 2 feature types x 2 rules x (classify and value heads), and x max_throughput's priced head
  assert sum(m.startswith("learned ") for m in methods) == 10
  assert "random" in methods and sum(m.startswith("oracle") for m in methods) == 2
  for r in rep["rows"]:
    assert r["prompts"] == 4 and r["tokens_per_s"] > 0
    assert 1.0 <= r["tau"] <= max(SIZES) + 1e-6 or r["tau"] == 0.0
    # AR fallback steps commit one token each: per request, tokens per forward <= τ.
    assert r["tokens_per_forward"] <= r["tau"] + 1e-9
  ar = rep["rows"][0]
  assert ar["tau"] == 1.0 and ar["speedup"] == 1.0
  # At T=0 every method decodes the same tokens; learned runs equal the fixed run of their size.
  runs = [json.loads(l) for l in open(os.path.join(out, "runs.jsonl"))]
  by_prompt = {}
  for r in runs:
    by_prompt.setdefault(r["prompt"], set()).add(tuple(r["output_ids"]))
  assert len(by_prompt) == 4 and all(len(v) == 1 for v in by_prompt.values())
  assert rep["learned_vs_fixed_forward_mismatches"] == 0
  # Compilations: per length bucket a plain prefill, one without the drafter (AR's,
  # `Engine.plain_prefill`) and one per policy architecture (2 feature types x 3 heads), one AR
  # loop and one loop per size; nothing compiled while decoding.
  comp = rep["compilations"]["by_function"]
  assert comp["spec_loop"] == len(SIZES) - 1 and comp["ar_loop"] == 1
  assert comp["prefill"] % 8 == 0
  over = rep["policy_overhead"]
  assert set(over["policies"]) == {m[len("learned "):] for m in methods if m.startswith("learned")}
  assert over["params_qwen3_4b"]["last_logits"] > 10 * over["params_qwen3_4b"]["last_hidden"]
  intra = rep["intra_request"]
  assert intra["requests"] == 4 and intra["replay_agrees_with_decode"] == 1.0
  assert intra["forwards"]["per_cycle_oracle"] <= intra["forwards"]["per_request_oracle"]
  assert intra["ar_fallback"] == [2, 1]  # the replay modelled the loop that ran
  md = open(os.path.join(out, "report.md")).read()
  assert "| fixed b=3 |" in md and "Intra-request" in md and "Policy overhead" in md
  assert "τ per spec. cycle" in md and "tokens per target forward" in md
  for r in runs:  # every target forward of the loop, the last one clipped at the output's end
    assert sum(r["forward_lengths"]) == r["new_tokens"] - 1
    assert r["acceptance_lengths"] == [a for a, c in zip(r["forward_lengths"],
                                                         r["forward_is_cycle"]) if c]


def _decode_cfg(setup, prompts: str, **kw) -> ml_collections.ConfigDict:
  cfg = qwen3_config.get_config()
  work = setup["cfg"].workdir
  cfg.update(target=os.path.join(work, "target"), drafter=os.path.join(work, "drafter"),
             prompts=prompts, mode="spec", max_new_tokens=MAX_NEW, max_len=128,
             block_sizes="2,3,4", block_size=3, dtype="float32", show=0,
             output=str(setup["root"] / "dec" / "out.jsonl"))
  cfg.update(kw)
  return cfg


def test_decode_block_policies(setup, stages_done):
  from bp_jax.decode_job import run as run_decode
  cfg = stages_done
  _, evals = lab.prompt_sets(cfg, setup["tok"])
  eval_only = _jsonl(setup["root"] / "eval_only.jsonl", [(p.key, p.text) for p in evals])
  fixed, _ = run_decode.run(_decode_cfg(setup, eval_only))
  outputs = [r["output_ids"] for r in fixed]
  policy = os.path.join(cfg.workdir, "policies", "pooled_layers-max_tau")
  learned, summary = run_decode.run(_decode_cfg(setup, eval_only, block_policy="learned",
                                                policy=policy))
  assert [r["output_ids"] for r in learned] == outputs  # lossless at T=0
  # A request the priced start rule routed plain before its prefill (it follows the run's
  # timings: `Engine.routes_learned_early`) ran no policy; every other one picked from 4 sizes.
  for r in learned:
    assert r["block_size"] in SIZES
    picked = r["policy_block_size"] is not None
    assert (len(r["policy_probs"]) == 4) if picked else (r["policy_probs"] is None
                                                         and r["plain_start"]), r
  assert summary["block_policy"] == "learned" and summary["policy"]["feature_type"] == \
      "pooled_layers"
  # One plain-or-policy prefill per length bucket, one loop per size used: no per-request code.
  # 1, and a plain start (the priced start, which follows the run's timings), run the AR loop.
  used = {r["block_size"] for r in learned if not r["plain_start"]} - {1}
  assert summary["compilations_by_function"].get("spec_loop", 0) == len(used)
  assert summary["compilations_by_function"]["prefill"] <= 3
  assert summary["policy"]["head"] == "classify"
  # A value policy: lossless, its decision rule in the summary; at lam = 0 the static size.
  value_policy = os.path.join(cfg.workdir, "policies", "pooled_layers-max_throughput-value")
  valued, summary = run_decode.run(_decode_cfg(setup, eval_only, block_policy="learned",
                                               policy=value_policy))
  assert [r["output_ids"] for r in valued] == outputs
  decision = summary["policy"]["decision"]
  assert summary["policy"]["head"] == "value" and "value ratios" in \
      summary["policy"]["policy_probs_are"]
  if decision["lam"] == 0.0:  # (those its policy picked for: not one routed plain before it)
    picks = {r["policy_block_size"] for r in valued}
    assert picks - {None} <= {SIZES[decision["static_class"]]}
  # A priced policy: lossless, priced by the costs this run's engine measured.
  priced_policy = os.path.join(cfg.workdir, "policies", "pooled_layers-max_throughput-priced")
  priced, summary = run_decode.run(_decode_cfg(setup, eval_only, block_policy="learned",
                                               policy=priced_policy))
  assert [r["output_ids"] for r in priced] == outputs
  assert summary["policy"]["head"] == "priced"
  assert summary["policy"]["prices_from"] in [
      f"the engine's costs ({how}, kept current by its loop calls)" for how in ("measured",
                                                                                 "cached")]
  assert len(summary["policy"]["decision"]["prices"]["cycle"]) == len(SIZES)
  oracle, _ = run_decode.run(_decode_cfg(
      setup, eval_only, block_policy="oracle", label_rule="max_tau", ar_fallback=2,
      oracle_labels=os.path.join(cfg.workdir, "data", label_sets.EVAL_LABELS)))
  table, _ = label_sets.oracle_table(
      os.path.join(cfg.workdir, "data", label_sets.EVAL_LABELS), "max_tau",
      label_sets.decode_settings(MAX_NEW, 0.0, False, run_decode.loop_options(cfg)))
  assert [r["block_size"] for r in oracle] == [table[prompt_hash(p.text)] for p in evals]
  assert [r["output_ids"] for r in oracle] == outputs
  rand, _ = run_decode.run(_decode_cfg(setup, eval_only, block_policy="random", seed=5))
  from bp_jax.policy.mlp import random_block_size
  assert [r["block_size"] for r in rand] == [random_block_size((2, 3, 4), 5, i) for i in range(4)]
  assert [r["output_ids"] for r in rand][:1] == outputs[:1]  # seed 5 vs 0: same greedy tokens


def test_oracle_refuses_labels_made_with_other_settings(setup, stages_done, tmp_path):
  from bp_jax.decode_job import run as run_decode
  cfg = stages_done
  labels = os.path.join(cfg.workdir, "data", label_sets.EVAL_LABELS)
  same = _decode_cfg(setup, "", block_policy="oracle", oracle_labels=labels, ar_fallback=2)
  choice = run_decode.resolve_block_choice(same, 3)
  assert choice.sizes == SIZES and len(choice.oracle) == 4
  with pytest.raises(BadInputError, match=r"ar_fallback_accept=1 but this decode uses "
                     r"ar_fallback_accept=3: decode with --config.ar_fallback_accept=1"):
    run_decode.resolve_block_choice(_decode_cfg(setup, "", block_policy="oracle",
                                                oracle_labels=labels, ar_fallback=2,
                                                ar_fallback_accept=3), 3)
  # Another loop form (the paper's loop: no AR fallback), length and temperature.
  other = _decode_cfg(setup, "", block_policy="oracle", oracle_labels=labels,
                      max_new_tokens=MAX_NEW + 6, temperature=1.0)
  with pytest.raises(BadInputError) as e:
    run_decode.resolve_block_choice(other, 3)
  msg = str(e.value)
  # The controller in effect is recorded too: `backoff` with fallback steps, `none` without.
  assert (f"was made with max_new_tokens={MAX_NEW}, temperature=0.0, ar_fallback=2, "
          f"controller=backoff but this decode uses max_new_tokens={MAX_NEW + 6}, "
          "temperature=1.0, ar_fallback=0, controller=none") in msg
  assert (f"decode with --config.max_new_tokens={MAX_NEW} --config.temperature=0.0 "
          "--config.ar_fallback=2 --config.controller=backoff") in msg
  assert "--config.blockpilot.max_new_tokens" in msg and "--config.stage=labels" in msg
  with pytest.raises(BadInputError, match=r"made with scan_layers=False"):
    run_decode.resolve_block_choice(_decode_cfg(setup, "", block_policy="oracle",
                                                oracle_labels=labels, ar_fallback=2,
                                                scan_layers=True), 3)
  # A label set made before the settings were recorded (no metadata.json) is refused, and the
  # labels stage does not count it as up to date.
  ds = label_sets.open_label_set(labels)
  old_data = tmp_path / "old"
  copy = old_data / os.path.relpath(ds.path, os.path.dirname(labels))
  shutil.copytree(ds.path, copy)
  os.remove(copy / "metadata.json")
  old = str(old_data / label_sets.EVAL_LABELS)
  with pytest.raises(BadInputError, match="does not record the decode settings it was made "
                     "with .* relabel it with train.py --config.stage=labels"):
    run_decode.resolve_block_choice(_decode_cfg(setup, "", block_policy="oracle",
                                                oracle_labels=old, ar_fallback=2), 3)
  settings, key = label_sets.label_set_settings(ds), label_sets.label_set_costs(ds)["key"]
  assert lab._holds_settings(os.path.dirname(labels), label_sets.EVAL_LABELS, settings, key)
  assert not lab._holds_settings(str(old_data), label_sets.EVAL_LABELS, settings, key)
  # Nor one priced by a table measured under another key (another machine or models).
  assert not lab._holds_settings(os.path.dirname(labels), label_sets.EVAL_LABELS, settings,
                                 {**key, "machine": {}})


def test_decode_refuses_the_policys_labelling_prompts(setup, stages_done):
  from bp_jax.decode_job import run as run_decode
  cfg = stages_done
  policy = os.path.join(cfg.workdir, "policies", "draft_confidence-max_tau")
  source = str(setup["root"] / "eval.jsonl")  # both halves: labelling and evaluation prompts
  with pytest.raises(BadInputError, match="never evaluate a policy on its labelling prompts"):
    run_decode.run(_decode_cfg(setup, source, block_policy="learned", policy=policy))
  records, _ = run_decode.run(_decode_cfg(setup, source, block_policy="learned", policy=policy,
                                          labelled_prompts="skip"))
  _, evals = lab.prompt_sets(cfg, setup["tok"])
  assert sorted(r["prompt"] for r in records) == sorted(p.text for p in evals)
  # The report stage refuses a policy labelled on an evaluation prompt.
  from bp_jax.train.report_stage import load_policies
  with pytest.raises(BadInputError, match="labelled on 1 evaluation prompt"):
    load_policies(cfg, [p.text for p in evals[:1]] + [
        lab.prompt_sets(cfg, setup["tok"])[0][0].text], "x", SIZES)


def test_missing_policy_falls_back_or_fails(setup, stages_done, capsys):
  from bp_jax.decode_job import run as run_decode
  cfg = stages_done
  _, evals = lab.prompt_sets(cfg, setup["tok"])
  eval_only = _jsonl(setup["root"] / "eval_only2.jsonl", [(p.key, p.text) for p in evals[:1]])
  missing = str(setup["root"] / "no_policy")
  records, summary = run_decode.run(_decode_cfg(setup, eval_only, block_policy="learned",
                                                policy=missing, policy_fallback=True))
  assert "no trained block-size policy" in capsys.readouterr().out
  assert summary["block_policy"] == "fixed" and records[0]["block_size"] == 3
  with pytest.raises(BadInputError, match="does not exist"):
    run_decode.run(_decode_cfg(setup, eval_only, block_policy="learned", policy=missing))
  # mode=ar decodes plainly whatever the block policy says (the policy is not used).
  records, summary = run_decode.run(_decode_cfg(setup, eval_only, block_policy="random",
                                                mode="ar"))
  assert summary["block_sizes_used"] == {"1": 1} and "is not used" in capsys.readouterr().out
  with pytest.raises(BadInputError, match="oracle_labels"):
    run_decode.run(_decode_cfg(setup, eval_only, block_policy="oracle"))


def test_candidate_sizes():
  bp = qwen3_config.blockpilot_config(radius=2)
  assert lab.candidate_sizes(bp, 3) == (1, 2, 3, 4, 5)  # 3 +- 2 (sizes >= 2), and AR
  bp.include_ar = False
  assert lab.candidate_sizes(bp, 8) == (6, 7, 8, 9, 10)
  bp.candidates = "12,4"
  assert lab.candidate_sizes(bp, 8) == (4, 12)
  bp.include_ar = True
  assert lab.candidate_sizes(bp, 8) == (1, 4, 12)
  bp.candidates = "1,4"
  assert lab.candidate_sizes(bp, 8) == (1, 4)
  for bad in ("0,4", "4,4", "4"):
    bp.candidates, bp.include_ar = bad, False
    with pytest.raises(BadInputError, match="candidates"):
      lab.candidate_sizes(bp, 8)
