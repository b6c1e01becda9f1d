"""Tests for train.py's data and LM stages on a tiny corpus: tokenizer -> lm_data -> lm, the
exported target (loads with load_target, decodes with Engine), reruns, and stage errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.weights.checkpoint_io import load_checkpoint
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
from bp_jax.errors import BadInputError
from bp_jax.weights.loading import load_target
from bp_jax.models.nnx_utils import module_params
from bp_jax.train import corpus, stages
from bp_jax.train import workdir as wd
from bp_jax.train.checkpointing import TrainCheckpointer
from bp_jax.train.lm import build_target, export_target, forward_logits
from bp_jax.train.optim import make_optimizer
from configs import demo

FUNCS = ["add", "sub", "mul", "scale", "shift", "clamp", "total", "pick"]


def _write_corpus(root):
  """20 small Python files, plus folders the corpus must skip (tests/, site-packages/)."""
  for i in range(20):
    name = FUNCS[i % len(FUNCS)]
    body = "".join(f"def {name}_{j}(x, y={i}):\n    return x + y * {j}\n\n\n" for j in range(12))
    path = root / f"pkg{i % 3}" / f"mod_{i}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'"""Module {i}."""\n\nimport os\n\n\n{body}')
  for skipped in ("tests", "site-packages"):
    (root / "pkg0" / skipped).mkdir(parents=True)
    (root / "pkg0" / skipped / "test_x.py").write_text("SKIPPED = True\n")
  (root / "empty.py").write_text("\n")


def tiny_config(tmp_path):
  cfg = demo.get_config()
  cfg.workdir = str(tmp_path / "work")
  cfg.export_dir = str(tmp_path / "export")
  cfg.corpus = str(tmp_path / "corpus")
  cfg.bpe.vocab_size = 300
  cfg.lm_data.val_frac = 0.2
  m = cfg.model
  m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers = 300, 32, 64, 2
  m.num_attention_heads, m.num_key_value_heads, m.head_dim = 2, 1, 16
  m.max_position_embeddings = 128
  lm = cfg.lm
  lm.seq_len, lm.batch, lm.steps = 32, 4, 6
  lm.eval_every, lm.eval_batches, lm.checkpoint_every, lm.log_every = 3, 2, 3, 1
  lm.export_dtype = "float32"
  lm.opt.lr = 1e-2
  return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("lm_stage")
  _write_corpus(tmp_path / "corpus")
  cfg = tiny_config(tmp_path)
  cfg.stage = "tokenizer,lm_data,lm"
  stages.run_stages(cfg)
  return cfg


def test_corpus_skips_test_folders_and_empty_files(tmp_path):
  _write_corpus(tmp_path)
  ids = [p.id for p in corpus.python_sources(str(tmp_path))]
  assert len(ids) == 20 and ids == sorted(ids)
  assert not any("tests" in i or "site-packages" in i or i == "empty.py" for i in ids)


def test_stages_write_tokenizer_datasets_run_and_export(trained):
  cfg = trained
  assert os.path.isfile(os.path.join(wd.tokenizer_dir(cfg), "tokenizer.json"))
  train_ds = wd.require_dataset(cfg, corpus.LM_TRAIN, "test", "lm_data")
  val_ds = wd.require_dataset(cfg, corpus.LM_VAL, "test", "lm_data")
  assert len(train_ds) > 4 and len(val_ds) >= 1
  assert {len(r["tokens"]) for r in train_ds} == {33}
  run = wd.run_dir(cfg, "lm")
  assert os.path.isfile(os.path.join(run, "loss.png"))
  assert os.path.isfile(os.path.join(run, "metrics.jsonl"))
  # The shipped copy is a complete checkpoint with the tokenizer inside.
  shipped = os.path.join(cfg.export_dir, "target")
  assert sorted(os.listdir(shipped)) == sorted(os.listdir(wd.target_dir(cfg)))
  assert "tokenizer.json" in os.listdir(shipped)


def test_training_reduced_the_loss(trained):
  with open(os.path.join(wd.run_dir(trained, "lm"), "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  losses = [r["loss"] for r in records if "loss" in r]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(losses) == 6 and len(evals) == 2
  assert losses[-1] < losses[0] - 0.3, losses
  assert evals[-1] < evals[0], evals


def test_exported_target_equals_trained_params_and_decodes(trained):
  cfg = trained
  target = load_target(wd.target_dir(cfg))
  # Same params as the final training checkpoint.
  ckpt = TrainCheckpointer(os.path.join(wd.run_dir(cfg, "lm"), "checkpoints"))
  try:
    model = build_target(cfg.model, 0)
    params = nnx.state(model, nnx.Param)
    tx, _ = make_optimizer(cfg.lm.opt, cfg.lm.steps)
    state, meta = ckpt.restore(ckpt.latest_step(), {"params": params, "opt_state": tx.init(params),
                                                   "rng": jax.random.PRNGKey(0)})
  finally:
    ckpt.close()
  assert meta["step"] == 6
  trained_params = state["params"].to_pure_dict()
  loaded = module_params(target)
  for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Engine's greedy AR decode == a greedy loop over full causal forwards of the loaded target.
  prompt = [5, 17, 42, 9]
  engine = Engine(target, stop_ids=[], shapes=ShapeOptions(max_len=64))
  out = engine.generate(prompt, max_new_tokens=6)
  seq = np.zeros((1, len(prompt) + 6), np.int32)  # one shape: later slots are masked out
  seq[0, :len(prompt)] = prompt
  for n in range(len(prompt), seq.shape[1]):
    seq[0, n] = int(jnp.argmax(forward_logits(target, jnp.asarray(seq))[0, n - 1]))
  assert out.output_ids == seq[0, len(prompt):].tolist()


def test_rerun_skips_done_work_and_reexports(trained, capsys):
  cfg = trained
  before = os.path.getmtime(os.path.join(wd.tokenizer_dir(cfg), "tokenizer.json"))
  stages.run_stages(cfg)
  out = capsys.readouterr().out
  assert "[tokenizer] up to date" in out and "[lm_data] up to date" in out
  assert "[lm] already trained (6 steps)" in out
  assert os.path.getmtime(os.path.join(wd.tokenizer_dir(cfg), "tokenizer.json")) == before


def test_lm_run_refuses_to_resume_with_other_settings(trained, tmp_path):
  cfg = tiny_config(tmp_path)
  cfg.workdir = trained.workdir
  cfg.lm.batch = 2
  with pytest.raises(BadInputError, match="batch changed"):
    stages.load_stage("lm")(cfg)


def test_lm_stage_checks_the_tokenizer_against_the_models_vocabulary(trained, tmp_path, capsys):
  cfg = tiny_config(tmp_path)
  cfg.workdir = trained.workdir
  tok_dir = wd.tokenizer_dir(cfg)
  # A larger model: ids 300..319 cannot be decoded; the stage warns, then (other model) refuses
  # to resume the run.
  cfg.model.vocab_size = 320
  with pytest.raises(BadInputError, match="model changed"):
    stages.load_stage("lm")(cfg)
  err = capsys.readouterr().err
  assert (f"[lm] warning: --config.model.vocab_size=320 but the tokenizer in {tok_dir} has 300 "
          "ids: the model can emit 20 ids (300..319) that the tokenizer cannot decode") in err
  # A smaller model: tokenizer ids past its vocabulary are refused before anything else.
  cfg.model.vocab_size = 256
  with pytest.raises(BadInputError, match=r"has 300 ids but --config.model.vocab_size=256: its "
                     r"ids past 255 are out of the model's range; set "
                     r"--config.model.vocab_size=300"):
    stages.load_stage("lm")(cfg)
  # Equal sizes (the trained run): no warning.
  stages.load_stage("lm")(trained)
  assert "warning" not in capsys.readouterr().err


def test_bfloat16_export_is_smaller_and_loads(trained, tmp_path):
  model = load_target(wd.target_dir(trained))
  out = export_target(model, str(tmp_path / "bf16"), wd.tokenizer_dir(trained), "bfloat16")
  params, config, meta = load_checkpoint(out, expected_kind="qwen3")
  assert meta["dtype"] == "bfloat16" and config["vocab_size"] == 300
  assert wd.folder_nbytes(out) < wd.folder_nbytes(wd.target_dir(trained))
  reloaded = load_target(out, "float32")
  np.testing.assert_array_equal(np.asarray(reloaded.embed[...]),
                                np.asarray(model.embed[...].astype(jnp.bfloat16), np.float32))
  with pytest.raises(BadInputError, match="export dtype"):
    export_target(model, str(tmp_path / "f16"), None, "float16")


def test_missing_inputs_name_the_stage_that_makes_them(trained, tmp_path):
  cfg = tiny_config(tmp_path)
  with pytest.raises(BadInputError, match=r"tokenizer.*run the 'tokenizer' stage first"):
    stages.load_stage("lm")(cfg)
  with pytest.raises(BadInputError, match=r"tokenizer.*run the 'tokenizer' stage first"):
    stages.load_stage("lm_data")(cfg)
  # With a tokenizer but no datasets, the lm stage names the dataset and the lm_data stage.
  shutil.copytree(wd.tokenizer_dir(trained), wd.tokenizer_dir(cfg))
  with pytest.raises(BadInputError, match=r"dataset 'lm_train'.*run the 'lm_data' stage first"):
    stages.load_stage("lm")(cfg)


def test_stage_names_and_unavailable_stages(monkeypatch):
  assert stages.parse_stages("all") == ["tokenizer", "lm_data", "lm", "regenerate", "draft"]
  assert stages.parse_stages(" lm , tokenizer") == ["lm", "tokenizer"]
  with pytest.raises(BadInputError, match="unknown stage 'bogus'; known stages: tokenizer, "
                     "lm_data, lm, regenerate, draft"):
    stages.parse_stages("lm,bogus")
  with pytest.raises(BadInputError, match="empty"):
    stages.parse_stages(" , ")
  monkeypatch.setitem(stages.STAGE_SOURCES, "draft", ("bp_jax.train.no_such_module", "draft_stage"))
  with pytest.raises(BadInputError, match="stage 'draft' is not available"):
    stages.load_stage("draft")
  monkeypatch.setitem(stages.STAGE_SOURCES, "draft", ("bp_jax.train.lm", "no_such_function"))
  with pytest.raises(BadInputError, match="has no function no_such_function"):
    stages.STAGES["draft"](None)


def test_cli_errors_are_one_line(run_cli, tmp_path):
  result = run_cli("train.py", "--config.stage=lm,bogus", f"--config.workdir={tmp_path}")
  line = result.error_line("train.py")
  assert "unknown stage 'bogus'" in line and "regenerate, draft" in line
  result = run_cli("train.py", "--config.stage=lm", f"--config.workdir={tmp_path}")
  line = result.error_line("train.py")
  assert "run the 'tokenizer' stage first" in line
