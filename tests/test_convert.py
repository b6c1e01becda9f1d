"""Weight conversion (bp_jax/weights/convert.py, convert_weights.py): sharded Hugging Face checkpoints
in, bp_jax checkpoints out and back, and clean one-line failures on bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from bp_jax.weights.checkpoint_io import PARTIAL_MARKER
from bp_jax.weights.convert import convert_from_hf, export_to_hf
from bp_jax.weights.loading import load_target
from hf_fixtures import make_hf_qwen3, save_hf_qwen3

SHARD = "100KB"  # the tiny model (~0.3 MB in float32) is written as several shards


@pytest.fixture(scope="module")
def hf_model():
  return make_hf_qwen3(seed=11)


@pytest.fixture(scope="module")
def sharded_hf_dir(hf_model, tmp_path_factory):
  path = save_hf_qwen3(str(tmp_path_factory.mktemp("hf") / "sharded"), hf_model,
                       max_shard_size=SHARD)
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
  return path


@pytest.fixture(scope="module")
def single_hf_dir(hf_model, tmp_path_factory):
  path = save_hf_qwen3(str(tmp_path_factory.mktemp("hf") / "single"), hf_model)
  assert os.path.exists(os.path.join(path, "model.safetensors"))
  return path


def _logits_ours(model, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(model(jnp.asarray(tokens), model.init_cache(*tokens.shape)).logits)


def _logits_hf(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def test_sharded_checkpoint_converts_and_matches_transformers(hf_model, sharded_hf_dir,
                                                              tmp_path):
  convert_from_hf(sharded_hf_dir, str(tmp_path / "ckpt"), show_progress=False)
  model = load_target(str(tmp_path / "ckpt"))
  assert model.cfg.num_hidden_layers == 3 and model.embed[...].dtype == jnp.float32
  tokens = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
  np.testing.assert_allclose(_logits_ours(model, tokens), _logits_hf(hf_model, tokens),
                             atol=1e-4, rtol=0)


def test_bfloat16_conversion_stores_bfloat16_and_stays_close(hf_model, single_hf_dir, tmp_path):
  convert_from_hf(single_hf_dir, str(tmp_path / "ckpt"), dtype="bfloat16", show_progress=False)
  with open(tmp_path / "ckpt" / "bp_jax.json") as f:
    assert json.load(f)["dtype"] == "bfloat16"
  model = load_target(str(tmp_path / "ckpt"))
  assert model.embed[...].dtype == jnp.bfloat16
  tokens = np.random.default_rng(1).integers(0, 128, (1, 12)).astype(np.int32)
  ref = _logits_hf(hf_model, tokens)
  assert np.abs(_logits_ours(model, tokens) - ref).max() <= 0.1 * np.abs(ref).max()


def test_export_back_to_hugging_face_reproduces_the_original_weights(hf_model, single_hf_dir,
                                                                     tmp_path):
  convert_from_hf(single_hf_dir, str(tmp_path / "ckpt"), show_progress=False)
  export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
  back = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
  want, got = hf_model.state_dict(), back.state_dict()
  assert sorted(got) == sorted(want)
  for k in want:
    torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


# -- leftovers of interrupted runs -----------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Converts argv[1] -> argv[2] in-process and is killed (SIGKILL: no cleanup runs) at the moment
# the parameters would be written: what an out-of-memory kill or a power cut leaves behind.
_KILLED_CONVERSION = """
import os, signal, sys
from bp_jax.weights import checkpoint_io, convert
checkpoint_io._save_params = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
convert.convert_from_hf(sys.argv[1], sys.argv[2], show_progress=False)
"""


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def _fake_leftover(path, marked: bool = True) -> None:
  os.makedirs(path)
  (path / "weights.bin").write_bytes(b"\0" * 64)
  if marked:
    (path / PARTIAL_MARKER).write_text("{}")


def test_rerun_removes_leftovers_of_an_interrupted_conversion(hf_model, single_hf_dir, tmp_path):
  out = tmp_path / "ckpt"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  killed = subprocess.run([sys.executable, "-c", _KILLED_CONVERSION, single_hf_dir, str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert killed.returncode == -signal.SIGKILL, killed.stderr
  leftovers = sorted(os.listdir(tmp_path))
  assert [n.split("-")[0] for n in leftovers] == ["ckpt.tmp", "ckpt.tok"], leftovers
  assert os.path.isfile(tmp_path / leftovers[0] / "config.json")  # a half-written checkpoint
  # Not removed: a folder without the marker, one whose process runs (this one), another
  # output's leftover.
  dead = _dead_pid()
  keep = [f"ckpt.tmp-{dead}-0123abcd", f"ckpt.tmp-{os.getpid()}-0123abcd",
          f"other.tmp-{dead}-0123abcd"]
  _fake_leftover(tmp_path / keep[0], marked=False)
  _fake_leftover(tmp_path / keep[1])
  _fake_leftover(tmp_path / keep[2])

  # JAX_PLATFORMS unset, as a user runs it: no absl log lines (backend probing, orbax).
  env.pop("JAX_PLATFORMS")
  res = subprocess.run([sys.executable, "convert_weights.py", "--hf_dir", single_hf_dir,
                        "--out_dir", str(out)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
  assert res.returncode == 0, res.stderr
  assert not re.findall(r"^[IWE]\d{4} ", res.stderr, re.M), res.stderr
  lines = [l for l in res.stdout.splitlines() if l.startswith("removed ")]
  assert len(lines) == 1 and all(n in lines[0] for n in leftovers), res.stdout
  assert "removed 2 leftover folder(s)" in lines[0], lines[0]
  assert sorted(os.listdir(tmp_path)) == sorted(["ckpt"] + keep)
  assert PARTIAL_MARKER not in os.listdir(out)
  tokens = np.random.default_rng(2).integers(0, 128, (1, 8)).astype(np.int32)
  np.testing.assert_allclose(_logits_ours(load_target(str(out)), tokens),
                             _logits_hf(hf_model, tokens), atol=1e-4, rtol=0)


def test_export_removes_leftovers_and_replaces_its_output(single_hf_dir, tmp_path, capsys):
  convert_from_hf(single_hf_dir, str(tmp_path / "ckpt"), show_progress=False)
  leftover = f"hf.tmp-{_dead_pid()}-0123abcd"
  _fake_leftover(tmp_path / leftover)
  capsys.readouterr()
  export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
  assert f"removed 1 leftover folder(s) of interrupted earlier runs beside {tmp_path / 'hf'}: " \
         f"{leftover}" in capsys.readouterr().out
  export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), overwrite=True)  # replaces it
  assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
  assert PARTIAL_MARKER not in os.listdir(tmp_path / "hf")
  assert "model.safetensors" in os.listdir(tmp_path / "hf")


# -- bad input through the command line ---------------------------------------------------------

def _convert_fails(run_cli, hf_dir: str, tmp_path, *extra: str, last_line: bool = True) -> str:
  """Runs convert_weights.py expecting a clean failure; returns the error line.

  `last_line`: also require the error to be the last line of stderr, on a line of its own (for
  errors raised during the conversion that is checked once, by its own test below).
  """
  out = tmp_path / "out" / "ckpt"
  res = run_cli("convert_weights.py", "--hf_dir", hf_dir, "--out_dir", str(out), *extra)
  line = res.error_line("convert_weights.py")
  if last_line:
    assert res.error_is_last_line_of_its_own("convert_weights.py"), res.stderr
  assert not (tmp_path / "out").exists(), "a failed conversion left an output folder"
  leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".tok-" in n]
  assert not leftovers
  return line


def _copy(src: str, tmp_path) -> str:
  dst = str(tmp_path / "hf")
  shutil.copytree(src, dst)
  return dst


def test_cli_missing_shard_names_the_missing_file(run_cli, sharded_hf_dir, tmp_path):
  hf_dir = _copy(sharded_hf_dir, tmp_path)
  shards = sorted(n for n in os.listdir(hf_dir) if n.startswith("model-"))
  assert len(shards) >= 3
  os.remove(os.path.join(hf_dir, shards[1]))
  line = _convert_fails(run_cli, hf_dir, tmp_path)
  assert shards[1] in line and "does not exist" in line


def test_cli_tensor_with_wrong_shape_names_the_tensor(run_cli, single_hf_dir, tmp_path):
  hf_dir = _copy(single_hf_dir, tmp_path)
  path = os.path.join(hf_dir, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  key = "model.layers.1.self_attn.k_proj.weight"
  assert tensors[key].shape == (48, 64)
  tensors[key] = np.zeros((40, 64), np.float32)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  line = _convert_fails(run_cli, hf_dir, tmp_path, last_line=False)
  assert f"'{key}'" in line and "[40, 64]" in line and "[48, 64]" in line


def _edit_config(hf_dir: str, **changes) -> None:
  path = os.path.join(hf_dir, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  with open(path, "w") as f:
    json.dump(dict(cfg, **changes), f)


@pytest.fixture(scope="module")
def narrower_mlp_run(run_cli, single_hf_dir, tmp_path_factory):
  """convert_weights.py on a config.json whose intermediate_size (80) contradicts the weights
  (96); the error is raised half-way through the conversion, with the progress bar shown."""
  root = tmp_path_factory.mktemp("narrow")
  hf_dir = _copy(single_hf_dir, root)
  _edit_config(hf_dir, intermediate_size=80)
  res = run_cli("convert_weights.py", "--hf_dir", hf_dir, "--out_dir", str(root / "out" / "c"))
  return res, hf_dir, root


def test_cli_config_json_with_other_mlp_width_names_the_tensor(narrower_mlp_run):
  res, hf_dir, root = narrower_mlp_run
  line = res.error_line("convert_weights.py")
  assert "'model.layers.0.mlp.gate_proj.weight'" in line and hf_dir in line
  assert "[96, 64]" in line and "[80, 64]" in line
  assert not (root / "out").exists()
  assert not [n for n in os.listdir(root) if ".tmp-" in n or ".tok-" in n]


def test_cli_config_json_with_fewer_layers_than_the_weights_names_the_tensor(
    run_cli, single_hf_dir, tmp_path):
  hf_dir = _copy(single_hf_dir, tmp_path)
  _edit_config(hf_dir, num_hidden_layers=2)
  line = _convert_fails(run_cli, hf_dir, tmp_path, last_line=False)
  assert "num_hidden_layers=2" in line and "'model.layers.2." in line and hf_dir in line


def test_cli_error_during_conversion_is_the_last_line_of_stderr(narrower_mlp_run):
  """An error raised while tensors are converted must not be glued to the unfinished progress
  bar, nor followed by the bar's final redraw at exit."""
  res, _, _ = narrower_mlp_run
  res.error_line("convert_weights.py")
  assert res.error_is_last_line_of_its_own("convert_weights.py"), repr(res.stderr[-400:])


def test_cli_unknown_dtype_names_the_flag(run_cli, single_hf_dir, tmp_path):
  line = _convert_fails(run_cli, single_hf_dir, tmp_path, "--dtype", "float8")
  assert "--dtype='float8'" in line and "bfloat16" in line


def test_export_honours_dtype_and_refuses_flags_it_would_ignore(run_cli, single_hf_dir,
                                                               tmp_path):
  """--to_hf --dtype float32 writes float32 tensors (the flag was ignored on export), and a
  conversion-only flag given with --to_hf is refused, naming it."""
  convert_from_hf(single_hf_dir, str(tmp_path / "ckpt"), dtype="bfloat16", show_progress=False)
  res = run_cli("convert_weights.py", "--to_hf", "--ckpt_dir", tmp_path / "ckpt", "--out_dir",
                tmp_path / "f32", "--dtype", "float32")
  assert res.rc == 0, res.stderr
  with open(tmp_path / "f32" / "model.safetensors", "rb") as f:  # safetensors' own header
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
  assert dtypes == {"F32"}, dtypes
  assert json.load(open(tmp_path / "f32" / "config.json"))["torch_dtype"] == "float32"
  res = run_cli("convert_weights.py", "--to_hf", "--ckpt_dir", tmp_path / "ckpt", "--out_dir",
                tmp_path / "x", "--tokenizer", "qwen3-offline")
  assert res.rc != 0 and "--tokenizer" in res.stderr.strip().splitlines()[-1]
