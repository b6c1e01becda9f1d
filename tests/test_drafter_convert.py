"""Converted checkpoints end to end: z-lab drafter and Qwen3 target round trips through
convert_weights.py (both ways), mismatch and bad-input errors, and a decode.py speculative run
on tiny converted checkpoints whose output equals the AR run's.

The command lines run as subprocesses, several at a time, from module fixtures; the tests then
check their results. Checkpoints: a random tiny Qwen3 target (transformers, vocab 260 with a
small byte-level BPE tokenizer, so decode.py can encode and decode text) and a random z-lab
drafter folder (config.json + model.safetensors with z-lab key names) for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import transformers

from bp_jax.weights.checkpoint_io import load_checkpoint, save_checkpoint
from bp_jax.models.config import DFlashConfig
from bp_jax.weights.convert import convert_from_hf, export_to_hf
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions
from bp_jax.errors import BadInputError
from bp_jax.weights.loading import load_drafter, load_target
from hf_fixtures import make_dflash_state_dict, make_hf_qwen3, save_hf_qwen3

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 260
TARGET_KW = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=512)
DRAFTER_HF = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=V,
                  hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
                  block_size=4, num_target_layers=3,
                  dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 1]})
# Drafters that cannot serve the target, each with its own reason.
BAD_DRAFTERS = {
    "wide": dict(hidden_size=48),
    "deep": dict(num_target_layers=5),
    "mask": dict(dflash_config={"mask_token_id": V, "target_layer_ids": [0, 1]}),
    "layers": dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 3]}),
    # Reads the target's last layer, whose feature differs in transformers (test_qwen3.py).
    "last": dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 2]}),
}
PROMPTS = [  # three prompts in two length buckets (32, 64) with the vocab-260 BPE tokenizer
    {"id": "short", "prompt": "x = 1"},
    {"id": "mid", "prompt": "def add(a, b):\n    return"},
    {"id": "long", "prompt": "import os\n\ndef list_files(path):\n    return sorted("},
]


# ---- command lines ------------------------------------------------------------------------------

@dataclasses.dataclass
class Cli:
  rc: int
  stdout: str
  stderr: str

  def error(self, script: str) -> str:
    """Asserts a clean failure: non-zero exit, no traceback, stderr ending in one
    `<script>: error: ...` line; returns that line."""
    assert self.rc != 0, f"expected a failure:\n{self.stdout}\n{self.stderr}"
    assert "Traceback" not in self.stderr, self.stderr
    lines = [l for l in self.stderr.splitlines() if l.strip()]
    assert lines and lines[-1].startswith(f"{script}: error: "), self.stderr
    assert sum("error:" in l for l in lines) == 1, self.stderr
    return lines[-1]

  def ok(self) -> "Cli":
    assert self.rc == 0, f"rc={self.rc}\n{self.stdout}\n{self.stderr}"
    return self


def run_cli(script: str, *args) -> Cli:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
  proc = subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)
  return Cli(proc.returncode, proc.stdout, proc.stderr)


def run_many(jobs: dict[str, tuple], workers: int = 3) -> dict[str, Cli]:
  """{name: (script, *args)} run concurrently -> {name: Cli}."""
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {name: pool.submit(run_cli, *job) for name, job in jobs.items()}
    return {name: f.result() for name, f in futures.items()}


# ---- fixtures -----------------------------------------------------------------------------------

def _write_zlab_drafter(folder: str, config: dict, seed: int) -> dict:
  os.makedirs(folder)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
  sd = make_dflash_state_dict(DFlashConfig.from_hf_dict(config), seed=seed)
  safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()},
                              os.path.join(folder, "model.safetensors"))
  return {k: v.numpy() for k, v in sd.items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  """HF/z-lab source folders; the target converted in-process; the first batch of command
  lines: the drafter converted with --target_dir, a wider drafter refused by --target_dir, and
  the target exported back to the Hugging Face layout with --to_hf."""
  root = str(tmp_path_factory.mktemp("drafter_convert"))
  p = lambda *names: os.path.join(root, *names)
  from bp_jax.text import bpe
  stdlib = os.path.dirname(os.__file__)
  texts = [pathlib.Path(stdlib, n).read_text(encoding="utf-8")
           for n in ("bisect.py", "colorsys.py")]
  bpe.train_bpe(texts, V, p("tok"))
  hf = make_hf_qwen3(seed=7, **TARGET_KW)
  save_hf_qwen3(p("hf_target"), hf)
  for name in os.listdir(p("tok")):
    shutil.copy(p("tok", name), p("hf_target", name))
  sd = _write_zlab_drafter(p("hf_drafter"), DRAFTER_HF, seed=1)
  for i, (name, change) in enumerate(BAD_DRAFTERS.items()):
    _write_zlab_drafter(p(f"hf_drafter_{name}"), dict(DRAFTER_HF, **change), seed=10 + i)
  with open(p("prompts.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in PROMPTS))

  convert_from_hf(p("hf_target"), p("ck_target"), show_progress=False)
  cli = run_many({
      "drafter": ("convert_weights.py", "--hf_dir", p("hf_drafter"), "--out_dir",
                  p("ck_drafter"), "--target_dir", p("ck_target")),
      "wide_vs_target": ("convert_weights.py", "--hf_dir", p("hf_drafter_wide"), "--out_dir",
                         p("ck_wide_checked"), "--target_dir", p("ck_target")),
      "target_to_hf": ("convert_weights.py", "--to_hf", "--ckpt_dir", p("ck_target"),
                       "--out_dir", p("hf_target_export")),
      "last_layer": ("convert_weights.py", "--hf_dir", p("hf_drafter_last"), "--out_dir",
                     p("ck_last")),
  })
  cli["drafter"].ok()
  return dict(root=root, p=p, hf=hf, sd=sd, cli=cli)


@pytest.fixture(scope="module")
def decode_runs(ckpts):
  """The second batch of command lines: the drafter's export back to the z-lab layout, and
  decode.py runs: spec and AR on the converted pair, and one with a mismatched drafter that must
  fail cleanly."""
  p = ckpts["p"]
  # A drafter converted without --target_dir: the mismatch must then be caught when decoding.
  convert_from_hf(p("hf_drafter_wide"), p("ck_wide"), show_progress=False)
  base = ("--config", "configs/qwen3_dflash.py", "--config.target", p("ck_target"),
          "--config.prompts", p("prompts.jsonl"), "--config.max_new_tokens", "21",
          "--config.max_len", "128", "--config.length_buckets", "32,64", "--config.show", "0")
  spec = base + ("--config.drafter", p("ck_drafter"), "--config.block_size", "4")
  return run_many({
      "drafter_to_hf": ("convert_weights.py", "--to_hf", "--ckpt_dir", p("ck_drafter"),
                        "--out_dir", p("hf_drafter_export")),
      "spec": ("decode.py", *spec, "--config.output", p("out", "spec.jsonl"),
               "--config.report", p("report")),
      "ar": ("decode.py", *base, "--config.mode=ar", "--config.output", p("out", "ar.jsonl")),
      "wide": ("decode.py", *base, "--config.drafter", p("ck_wide")),
  })


def _read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]


def _assert_same_tree(a: dict, b: dict, path: str = ""):
  assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b))
  for k in a:
    if isinstance(a[k], dict):
      _assert_same_tree(a[k], b[k], f"{path}/{k}")
    else:
      assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{path}/{k}"
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"{path}/{k}")


def _config(folder: str) -> dict:
  with open(os.path.join(folder, "config.json")) as f:
    return json.load(f)


# ---- round trips --------------------------------------------------------------------------------

def test_drafter_round_trip_through_the_command_lines(ckpts, decode_runs):
  """z-lab folder -> convert_weights.py -> ours -> convert_weights.py --to_hf -> z-lab folder
  -> ours again: identical tensors, key names and config fields at every step."""
  p, sd = ckpts["p"], ckpts["sd"]
  assert "converted dflash checkpoint" in ckpts["cli"]["drafter"].stdout
  assert "exported dflash checkpoint" in decode_runs["drafter_to_hf"].ok().stdout
  # The exported folder is a z-lab folder: same key names, same tensors, same config fields.
  exported = safetensors.numpy.load_file(p("hf_drafter_export", "model.safetensors"))
  assert set(exported) == set(sd)
  for k, v in sd.items():
    assert exported[k].dtype == np.float32, k
    np.testing.assert_array_equal(exported[k], v, err_msg=k)
  cfg = _config(p("hf_drafter_export"))
  for key in ("block_size", "num_target_layers", "dflash_config", "hidden_size",
              "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "vocab_size"):
    assert cfg[key] == DRAFTER_HF[key], key
  # ... and converting it again gives the same checkpoint.
  convert_from_hf(p("hf_drafter_export"), p("ck_drafter_again"), show_progress=False)
  a_params, a_cfg, a_meta = load_checkpoint(p("ck_drafter"), expected_kind="dflash")
  b_params, b_cfg, b_meta = load_checkpoint(p("ck_drafter_again"), expected_kind="dflash")
  _assert_same_tree(a_params, b_params)
  assert a_cfg == b_cfg
  assert a_meta["dtype"] == b_meta["dtype"] == "float32"
  # The converted drafter holds the z-lab tensors (Linear weights transposed to [in, out]).
  np.testing.assert_array_equal(a_params["fc"], sd["fc.weight"].T)
  np.testing.assert_array_equal(a_params["layers"]["q_proj"][0],
                                sd["layers.0.self_attn.q_proj.weight"].T)
  drafter = load_drafter(p("ck_drafter_again"), load_target(p("ck_target")).cfg)
  assert drafter.cfg == DFlashConfig.from_hf_dict(DRAFTER_HF)


@pytest.mark.parametrize("tie", [False, True])
def test_target_round_trip(ckpts, tmp_path, tie):
  """HF -> ours -> HF (transformers reloads the original weights) -> ours again."""
  p = ckpts["p"]
  if tie:  # a tied target (no lm_head.weight), in-process
    hf = make_hf_qwen3(seed=8, tie=True, **TARGET_KW)
    src = save_hf_qwen3(str(tmp_path / "hf_tied"), hf)
    ck, out = str(tmp_path / "ck_tied"), str(tmp_path / "hf_export")
    convert_from_hf(src, ck, show_progress=False)
    assert export_to_hf(ck, out) == "qwen3"
  else:  # the module's target, exported by convert_weights.py --to_hf
    hf, ck, out = ckpts["hf"], p("ck_target"), p("hf_target_export")
    assert "exported qwen3 checkpoint" in ckpts["cli"]["target_to_hf"].ok().stdout
  stored = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
  assert ("lm_head.weight" in stored) is (not tie)
  # transformers loads the export with exactly the original weights.
  back = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
  want = hf.state_dict()
  got = back.state_dict()
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)
  assert back.config.tie_word_embeddings is tie
  assert back.config.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
  again = str(tmp_path / "ck_again")
  convert_from_hf(out, again, show_progress=False)
  a_params, a_cfg, _ = load_checkpoint(ck, expected_kind="qwen3")
  b_params, b_cfg, _ = load_checkpoint(again, expected_kind="qwen3")
  _assert_same_tree(a_params, b_params)
  assert a_cfg == b_cfg
  if not tie:  # tokenizer files travel with the checkpoint both ways
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert os.path.isfile(os.path.join(again, "tokenizer.json"))


# ---- drafter / target mismatches ----------------------------------------------------------------

def test_convert_with_target_dir_rejects_a_wider_drafter(ckpts):
  p = ckpts["p"]
  line = ckpts["cli"]["wide_vs_target"].error("convert_weights.py")
  assert "hidden_size=48" in line and "hidden_size=32" in line, line
  assert p("hf_drafter_wide") in line
  assert not os.path.exists(p("ck_wide_checked"))


@pytest.mark.parametrize("name,words", [
    ("deep", ("num_target_layers=5", "3 layers")),
    ("mask", ("mask_token_id=260", "vocab_size=260")),
    ("layers", ("target_layer_ids [3]", "3 layers")),
    ("wide", ("hidden_size=48", "hidden_size=32")),
    ("last", ("target_layer_ids [0, 2]", "last layer 2", "final-normed")),
])
def test_convert_with_target_dir_rejects_mismatched_drafters(ckpts, tmp_path, name, words):
  p = ckpts["p"]
  with pytest.raises(BadInputError) as err:
    convert_from_hf(p(f"hf_drafter_{name}"), str(tmp_path / "out"), target_dir=p("ck_target"),
                    show_progress=False)
  msg = str(err.value)
  assert all(w in msg for w in words), msg
  assert p(f"hf_drafter_{name}") in msg
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name,words", [
    ("deep", ("num_target_layers=5", "3 layers")),
    ("mask", ("mask_token_id=260",)),
    ("layers", ("target_layer_ids [3]",)),
])
def test_loading_a_mismatched_drafter_for_decoding_fails(ckpts, tmp_path, name, words):
  """Without --target_dir the drafter converts; loading it against the target then fails, as
  does building an engine with it."""
  p = ckpts["p"]
  ck = str(tmp_path / name)
  convert_from_hf(p(f"hf_drafter_{name}"), ck, show_progress=False)
  target = load_target(p("ck_target"))
  with pytest.raises(BadInputError) as err:
    load_drafter(ck, target.cfg)
  assert all(w in str(err.value) for w in words) and ck in str(err.value), str(err.value)
  drafter = load_drafter(ck)  # no target given: no check
  with pytest.raises(BadInputError) as err:
    Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=64, length_buckets=(32,)))
  assert all(w in str(err.value) for w in words), str(err.value)


def test_drafter_reading_the_last_target_layer_is_refused_both_ways(ckpts, tmp_path):
  """Without --target_dir the drafter's own num_target_layers tells which layer is the last:
  converting is refused on the command line, and a bp_jax drafter checkpoint that reads the
  last layer (one trained before the rule) is refused by --to_hf."""
  p = ckpts["p"]
  line = ckpts["cli"]["last_layer"].error("convert_weights.py")
  assert p("hf_drafter_last") in line and "last layer 2" in line, line
  assert "transformers" in line and "1..L-3" in line, line
  assert not os.path.exists(p("ck_last"))
  params, config, meta = load_checkpoint(p("ck_drafter"), expected_kind="dflash")
  config["dflash_config"] = dict(config["dflash_config"], target_layer_ids=[0, 2])
  old = str(tmp_path / "ck_old")
  save_checkpoint(old, params, config, meta)
  with pytest.raises(BadInputError) as err:
    export_to_hf(old, str(tmp_path / "hf_out"))
  assert old in str(err.value) and "last layer 2" in str(err.value), str(err.value)
  assert sorted(os.listdir(tmp_path)) == ["ck_old"]  # no output, no temporary folder


def test_drafter_config_without_dflash_fields_is_refused(tmp_path):
  for missing in ("block_size", "num_target_layers"):
    d = {k: v for k, v in DRAFTER_HF.items() if k != missing}
    with pytest.raises(BadInputError, match=missing):
      DFlashConfig.from_hf_dict(d, "x/config.json")
  d = dict(DRAFTER_HF, dflash_config={"target_layer_ids": [0, 1]})
  with pytest.raises(BadInputError, match="mask_token_id"):
    DFlashConfig.from_hf_dict(d, "x/config.json")


# ---- decode.py ----------------------------------------------------------------------------------

def test_decode_spec_end_to_end_matches_ar(ckpts, decode_runs):
  p = ckpts["p"]
  decode_runs["spec"].ok()
  decode_runs["ar"].ok()
  spec = _read_jsonl(p("out", "spec.jsonl"))
  ar = _read_jsonl(p("out", "ar.jsonl"))
  assert [r["id"] for r in spec] == [r["id"] for r in ar] == [r["id"] for r in PROMPTS]
  for s, a in zip(spec, ar):
    assert s["output_ids"] == a["output_ids"], s["id"]
    assert s["text"] == a["text"]
    assert 1 <= len(s["output_ids"]) <= 21
    assert s["block_size"] == 4 and a["block_size"] == 1
    # The default controller (priced) may take AR steps beside its cycles.
    acc = s["acceptance_lengths"]
    assert all(1 <= x <= 4 for x in acc) and s["cycles"] == len(acc)
    assert s["target_forwards"] == len(s["forward_lengths"]) == s["cycles"] + s["ar_steps"]
    assert s["tau"] == (pytest.approx(np.mean(acc), abs=1e-4) if acc else None)
    assert 0 <= sum(s["forward_lengths"]) - (len(s["output_ids"]) - 1) <= 3
    assert a["acceptance_lengths"] == [1] * a["target_forwards"]
  buckets = {32 if r["prompt_tokens"] <= 32 else 64 for r in spec}
  assert buckets == {32, 64}
  with open(p("out", "spec.jsonl.summary.json")) as f:
    summary = json.load(f)
  all_acc = [x for r in spec for x in r["acceptance_lengths"]]
  assert all_acc and summary["tau_pooled_over_cycles"] == pytest.approx(np.mean(all_acc), abs=1e-4)
  assert summary["tokens_per_s"] > 0
  hist = summary["acceptance_histogram"]
  assert {int(k): v for k, v in hist.items()} == {x: all_acc.count(x) for x in set(all_acc)}
  # The AR loop too where the default priced start ran a request plain (`Engine.starts_plain`):
  # whether one does rests on the prices timed on the machine running it (a cycle's price in AR
  # steps against the earlier requests' τ), so the records say which programs ran, each once.
  plain = [s["plain_start"] for s in spec]
  assert not plain[0] and all(s["ar_steps"] == s["target_forwards"] for s in spec
                              if s["plain_start"])
  assert summary["compilations_by_function"] == {"prefill": 2, "spec_loop": 1,
                                                 **({"ar_loop": 1} if any(plain) else {})}
  with open(p("out", "ar.jsonl.summary.json")) as f:
    assert json.load(f)["compilations_by_function"] == {"prefill": 2, "ar_loop": 1}
  pngs = [f for f in os.listdir(p("report")) if f.endswith(".png")]
  assert pngs
  with open(p("report", pngs[0]), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_decode_unknown_mode_and_spec_without_drafter(ckpts):
  """Refused before any model loads, naming the flags (decode.py prints the same message as its
  one error line; test_decode_cli checks that mapping)."""
  from bp_jax.decode_job import run as run_decode
  with pytest.raises(BadInputError) as err:
    run_decode.run(_decode_config(ckpts, mode="beam"))
  line = str(err.value)
  assert "--config.mode='beam'" in line and "'ar'" in line and "'spec'" in line, line
  with pytest.raises(BadInputError, match=r"--config.mode=spec needs --config.drafter"):
    run_decode.run(_decode_config(ckpts, mode="spec", drafter=""))


def test_decode_with_mismatched_drafter(ckpts, decode_runs):
  line = decode_runs["wide"].error("decode.py")
  assert "hidden_size=48" in line and "hidden_size=32" in line, line
  assert ckpts["p"]("ck_wide") in line


def _decode_config(ckpts, **fields):
  from configs import qwen3_dflash
  p = ckpts["p"]
  cfg = qwen3_dflash.get_config()
  cfg.update(dict(target=p("ck_target"), drafter=p("ck_drafter"), prompts=p("prompts.jsonl"),
                  max_new_tokens=21, max_len=128, length_buckets="32,64", block_size=4,
                  output=p("out", "never.jsonl"), show=0), **fields)
  return cfg


def test_decode_block_size_outside_the_bucket_list_becomes_a_bucket(ckpts):
  """--config.block_size need not be among --config.block_sizes: it is added as a bucket (and
  compiled once); it stays lossless. It fails only where it cannot work: past max_len."""
  from bp_jax.decode_job import run as run_decode
  p = ckpts["p"]
  records, summary = run_decode.run(_decode_config(
      ckpts, block_size=12, block_sizes="2,4,6", compare="ar", output=p("out", "b12.jsonl")))
  assert summary["block_sizes_used"] == {"12": len(records)}
  assert summary["compare"]["ar"]["identical_to_ar"] == len(records)
  assert summary["main"]["identical_to_ar"] == len(records)
  assert summary["compilations_by_function"]["spec_loop"] == 1
  with pytest.raises(BadInputError) as err:
    run_decode.run(_decode_config(ckpts, block_size=120))
  assert "block_size-1=119" in str(err.value) and "--config.max_len=128" in str(err.value)
  assert not os.path.exists(p("out", "never.jsonl"))


def test_decode_request_over_the_cache(ckpts):
  """Every prompt is checked before decoding starts; the message names the prompt and flag."""
  from bp_jax.decode_job import run as run_decode
  with pytest.raises(BadInputError) as err:
    run_decode.run(_decode_config(ckpts, max_len=64))
  msg = str(err.value)
  assert "'long'" in msg and "--config.max_len=64" in msg and "max_new_tokens=21" in msg, msg
  assert not os.path.exists(ckpts["p"]("out", "never.jsonl"))
