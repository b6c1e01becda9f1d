"""The regenerate and draft stages (bp_jax/train/regenerate.py, bp_jax/train/draft.py) on a tiny
random target: regenerate -> TFDS -> read back, drafter training through the loop, export, load,
lossless speculative decoding with the exported drafter, and the refusals."""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bp_jax.text.bpe import MASK_ID, train_bpe
from bp_jax.weights.checkpoint_io import save_checkpoint
from bp_jax.models.config import Qwen3Config
from bp_jax.data import open_dataset
from bp_jax.errors import BadInputError
from bp_jax.models.nnx_utils import module_params
from bp_jax.text.prompts import load_prompts
from bp_jax.models.qwen3 import Qwen3
from bp_jax.train import draft as draft_stage_mod
from bp_jax.train import regenerate as regen
from bp_jax.optim_config import opt_config

PROMPT_TOKENS, MAX_NEW, BLOCK = 12, 20, 4


def _python_files(folder) -> None:
  os.makedirs(folder, exist_ok=True)
  for i in range(8):
    body = "".join(f"    total_{i}_{j} = value * {j} + {i}\n" for j in range(12))
    text = (f"def function_{i}(value):\n    \"\"\"Docstring number {i}.\"\"\"\n{body}"
            f"    return total_{i}_0\n\n\nclass Thing{i}:\n    pass\n")
    with open(os.path.join(folder, f"mod_{i}.py"), "w", encoding="utf-8") as f:
      f.write(text)


def _tiny_target(vocab: int, seed: int = 0) -> Qwen3:
  cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(seed))
  target.embed[...] = jax.random.normal(jax.random.key(seed + 1), target.embed.shape)
  return target


def _save_target(target: Qwen3, out_dir: str, tok_dir: str) -> None:
  extra = {n: os.path.join(tok_dir, n) for n in os.listdir(tok_dir)}
  save_checkpoint(out_dir, module_params(target), target.cfg.to_hf_dict(),
                  {"kind": "qwen3"}, extra_files=extra, overwrite=True)


def _config(workdir: str, corpus: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir, c.corpus, c.seed, c.dtype, c.export_dir = workdir, corpus, 0, "float32", ""
  c.lm_data = ml_collections.ConfigDict({"val_frac": 0.2})
  c.regenerate = ml_collections.ConfigDict({
      "num_prompts": 6, "prompt_tokens": PROMPT_TOKENS, "max_new_tokens": MAX_NEW,
      "temperature": 0.0, "source": "", "num_val_prompts": 2, "val_frac": 0.3})
  c.draft = ml_collections.ConfigDict({
      "num_layers": 2, "block_size": BLOCK, "gamma": 0.0, "anchors_per_seq": 4, "batch": 2,
      "steps": 4, "opt": opt_config(lr=3e-3, warmup_frac=0.0, clip=1.0),
      "target_layer_ids": (), "export_dtype": "float32", "eval_every": 2,
      "checkpoint_every": 2, "log_every": 1, "drop_short": True})
  return c


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A workdir holding a tiny random target (with a BPE tokenizer) and a small corpus."""
  root = tmp_path_factory.mktemp("draft_stage")
  corpus = str(root / "corpus")
  _python_files(corpus)
  texts = [open(os.path.join(corpus, n), encoding="utf-8").read()
           for n in sorted(os.listdir(corpus))]
  tok_dir = str(root / "tok")
  tok = train_bpe(texts, 300, tok_dir)
  workdir = str(root / "work")
  target = _tiny_target(300)
  _save_target(target, os.path.join(workdir, "target"), tok_dir)
  return {"cfg": _config(workdir, corpus), "tok": tok, "target": target, "root": root,
          "tok_dir": tok_dir}


def test_regenerate_round_trip_and_draft_stage(setup, capsys):
  cfg, tok = setup["cfg"], setup["tok"]
  regen.regenerate_stage(cfg)
  data_dir = os.path.join(cfg.workdir, "data")
  train, val = open_dataset(data_dir, regen.REGEN_TRAIN), open_dataset(data_dir, regen.REGEN_VAL)
  assert len(train) == 6 and len(val) == 2
  train_files = {r["id"].rsplit("@", 1)[0] for r in train}
  val_files = {r["id"].rsplit("@", 1)[0] for r in val}
  assert not train_files & val_files  # disjoint prompts (by file)
  target = setup["target"]
  recs = list(train) + list(val)
  padded = np.zeros((len(recs), PROMPT_TOKENS + MAX_NEW), np.int32)
  for i, rec in enumerate(recs):
    padded[i, :len(rec["tokens"])] = rec["tokens"]
  # One causal forward over all sequences: greedy argmax after every position.
  greedy = np.asarray(jnp.argmax(target(jnp.asarray(padded),
                                        target.init_cache(*padded.shape)).logits, -1))
  for i, rec in enumerate(recs):
    name, start = rec["id"].rsplit("@", 1)
    ids = tok.encode(open(os.path.join(cfg.corpus, name), encoding="utf-8").read(),
                     add_special_tokens=False)
    p, n = rec["prompt_len"], len(rec["tokens"])
    assert p == PROMPT_TOKENS
    assert rec["tokens"][:p].tolist() == ids[int(start):int(start) + p]
    assert p < n <= p + MAX_NEW
    # Greedy: every response token is the target's argmax after the preceding tokens.
    assert rec["tokens"][p:].tolist() == greedy[i, p - 1:n - 1].tolist()
  # A second run with the same settings is skipped.
  capsys.readouterr()
  regen.regenerate_stage(cfg)
  assert "up to date" in capsys.readouterr().out

  draft_stage_mod.draft_stage(cfg)
  out = os.path.join(cfg.workdir, "drafter")
  from bp_jax.weights.loading import load_drafter, load_target
  loaded_target = load_target(os.path.join(cfg.workdir, "target"))
  drafter = load_drafter(out, loaded_target.cfg)
  assert drafter.cfg.block_size == BLOCK and drafter.cfg.mask_token_id == MASK_ID == 1
  assert drafter.cfg.target_layer_ids == (1, 2)  # DFlash's default [1, 1] repeats a layer
  summary = json.load(open(os.path.join(cfg.workdir, "draft", "summary.json")))
  assert summary["steps"] == 4 and 1.0 <= summary["eval_acceptance_length"] <= BLOCK
  records = [json.loads(l) for l in open(os.path.join(cfg.workdir, "draft", "metrics.jsonl"))]
  assert any("eval_acceptance_length" in r for r in records)
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)

  # The exported drafter decodes losslessly with the engine (spec output == AR output).
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import ShapeOptions
  engine = Engine(loaded_target, drafter=drafter,
                  shapes=ShapeOptions(max_len=64, length_buckets=(16,), block_sizes=(BLOCK,)))
  prompt = train[0]["tokens"][:PROMPT_TOKENS].tolist()
  ar = engine.generate(prompt, max_new_tokens=16, block_size=1)
  spec = engine.generate(prompt, max_new_tokens=16, block_size=BLOCK)
  assert spec.output_ids == ar.output_ids

  # The drafter refuses another target with the same sizes but other weights.
  draft_stage_mod.check_drafter_target(out, loaded_target)
  other = _tiny_target(300, seed=5)
  with pytest.raises(BadInputError, match="trained against a target with fingerprint"):
    draft_stage_mod.check_drafter_target(out, other, "other target")

  # Resuming the run against a changed target is refused before any training.
  _save_target(other, os.path.join(cfg.workdir, "target"), setup["tok_dir"])
  try:
    with pytest.raises(BadInputError, match="regenerated by a target"):
      draft_stage_mod.draft_stage(cfg)
  finally:
    _save_target(target, os.path.join(cfg.workdir, "target"), setup["tok_dir"])


def test_distilling_from_a_trained_drafter(setup, tmp_path):
  """--config.draft.init_from starts from a trained drafter (lr 1e-30: the export equals it), a soft
  objective reports 1 - TV, and a drafter of another config is refused by name."""
  import shutil
  from bp_jax.weights.loading import load_drafter, load_target
  cfg = setup["cfg"]
  regen.regenerate_stage(cfg)
  draft_stage_mod.draft_stage(cfg)
  start = os.path.join(cfg.workdir, "drafter")
  work = str(tmp_path / "work")
  for name in ("target", "data"):
    shutil.copytree(os.path.join(cfg.workdir, name), os.path.join(work, name))
  ft = copy.deepcopy(cfg)
  ft.workdir = work
  ft.draft.update({"loss": "mix", "init_from": start, "steps": 2,
                   "opt": opt_config(lr=1e-30, warmup_frac=0.0, clip=1.0)})
  draft_stage_mod.draft_stage(ft)
  target = load_target(os.path.join(work, "target"))
  a = jax.tree.leaves(nnx.state(load_drafter(start, target.cfg)))
  b = jax.tree.leaves(nnx.state(load_drafter(os.path.join(work, "drafter"), target.cfg)))
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  summary = json.load(open(os.path.join(work, "draft", "summary.json")))
  assert summary["loss"]["kind"] == "mix" and -1e-6 <= summary["eval_tv_acceptance"] <= 1
  other = copy.deepcopy(ft)
  other.workdir = str(tmp_path / "other")
  shutil.copytree(work, other.workdir, ignore=shutil.ignore_patterns("draft", "drafter"))
  other.draft.block_size = BLOCK + 1
  with pytest.raises(BadInputError, match="init_from.*block_size"):
    draft_stage_mod.draft_stage(other)
  other.draft.update({"block_size": BLOCK, "loss": "l1"})
  with pytest.raises(BadInputError, match="--config.draft.loss"):
    draft_stage_mod.draft_stage(other)


def test_humaneval_is_refused_for_training(setup, tmp_path):
  cfg = ml_collections.ConfigDict(setup["cfg"].to_dict())
  cfg.regenerate.source = "humaneval"
  with pytest.raises(BadInputError, match="must never be used for training"):
    regen.regenerate_stage(cfg)
  # A copy of HumanEval under another name is caught by its function signatures.
  problem = load_prompts("humaneval")[3]
  path = tmp_path / "copy.jsonl"
  path.write_text(json.dumps({"id": "innocent", "prompt": problem.text}) + "\n"
                  + json.dumps({"id": "other", "prompt": "x = 1\n"}) + "\n", encoding="utf-8")
  with pytest.raises(BadInputError, match="HumanEval function signature"):
    regen.check_not_humaneval(str(path), load_prompts(str(path)), "test")
  regen.check_not_humaneval("pysrc:x", [regen.Prompt("a", "def f(x):\n  return x\n")], "test")


def test_short_sequences_are_refused_with_a_clear_error():
  records = [{"id": "ok", "tokens": np.arange(20), "prompt_len": 8},
             {"id": "short", "tokens": np.arange(11), "prompt_len": 8}]
  with pytest.raises(BadInputError, match=r"'short'.*shorter than a block of 4"):
    draft_stage_mod.check_sequences(records, "regen_train", 4, 64)
  kept = draft_stage_mod.check_sequences(records, "regen_train", 4, 64, drop_short=True)
  assert [r["id"] for r in kept] == ["ok"]
  # Exactly room for one block: anchor 8, labels 9..11 < 12 tokens.
  draft_stage_mod.check_sequences([{"id": "edge", "tokens": np.arange(12), "prompt_len": 8}],
                                  "x", 4, 64)
  # Cut to seq_len first.
  with pytest.raises(BadInputError):
    draft_stage_mod.check_sequences(records[:1], "x", 4, 11)


def test_target_layer_ids_choice():
  choose = draft_stage_mod.choose_target_layer_ids
  assert choose(36, 5, ()) == (1, 9, 17, 25, 33)
  assert choose(4, 2, None) == (1, 2)
  assert choose(4, 2, (0, 2)) == (0, 2)
  with pytest.raises(BadInputError, match="repeats"):
    choose(4, 2, (1, 1))
  with pytest.raises(BadInputError, match="out of range"):
    choose(4, 2, (1, 4))
  # Defaults never take the last layer: DFlash's formula gives [1] for L=2, n=1 (L // 2).
  assert choose(2, 1, None) == (0,)
  with pytest.raises(BadInputError, match="2 distinct target layers below the last"):
    choose(2, 2, None)


def test_target_layer_ids_refuse_the_last_layer():
  """The last layer's feature differs between bp_jax and transformers-based DFlash code
  (tests/test_qwen3.py pins it), so a drafter is never trained on it."""
  with pytest.raises(BadInputError) as err:
    draft_stage_mod.choose_target_layer_ids(4, 2, (0, 3))
  msg = str(err.value)
  assert "--config.draft.target_layer_ids=[0, 3]" in msg and "last layer 3" in msg, msg
  assert "final-normed" in msg and "1..L-3" in msg, msg


def test_docstring_prompts_end_at_a_docstring(setup):
  """`prompt_style="docstring"`: each prompt is a file's text up to the end of a function's
  docstring (HumanEval's shape), left-truncated to prompt_tokens; one per file before seconds."""
  tok = setup["tok"]
  docs = load_prompts(f"pysrc:{setup['cfg'].corpus}")
  prompts = regen.cut_docstring_prompts(docs, tok, 10_000, 5, seed=0)
  assert len(prompts) == 5 and len({pid.rsplit(":", 1)[0] for pid, _ in prompts}) == 5
  for pid, ids in prompts:
    name, line = pid.rsplit(":", 1)
    assert line == "2"  # `def function_i(value):` then its one-line docstring
    text = tok.decode(ids)
    assert text.rstrip().endswith('"""Docstring number ' + name[4:-3] + '."""')
    assert text.endswith("\n") and text.startswith("def function_")
  short = regen.cut_docstring_prompts(docs, tok, 6, 3, seed=0)
  assert [len(ids) for _, ids in short] == [6, 6, 6]
  full = dict(prompts)
  assert all(ids == full[pid][-6:] for pid, ids in short)
  # Files without a documented function give nothing; a file that does not parse is skipped.
  bad = [regen.Prompt("broken.py", "def f(:\n  '''x'''\n  pass\n"),
         regen.Prompt("plain.py", "x = 1\n")]
  assert regen.cut_docstring_prompts(bad, tok, 64, 4) == []
  with pytest.raises(BadInputError, match="prompt_style"):
    regen.cut_style_prompts("lines", docs, tok, 8, 8, 2, 0)
