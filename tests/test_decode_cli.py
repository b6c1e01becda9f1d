"""End to end through the command lines: convert_weights.py, then decode.py --config.mode=ar,
against transformers' greedy generate; and decode.py's failures on bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from hf_fixtures import make_hf_qwen3, save_hf_qwen3

# Qwen3's real vocabulary size, so that the offline Qwen3 tokenizer (151,669 tokens) fits; the
# rest of the model is tiny.
VOCAB = 151936
MAX_NEW = 12
PROMPTS = [
    {"id": "short", "prompt": "def fib(n):"},
    {"id": "medium", "prompt": "Write a Python function that merges two sorted lists."},
    {"id": "long", "prompt": "Hello world! " * 8 + "Now count the words in this sentence "
                             "and print the result, then stop."},
]
RECORD_KEYS = {"id", "prompt", "output_ids", "text", "new_tokens", "prefill_s", "decode_s"}
SUMMARY_KEYS = {"tokens_per_s", "compilations", "prompts"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, run_cli):
  """(transformers model, converted checkpoint folder, prompts JSONL path)."""
  root = tmp_path_factory.mktemp("e2e")
  hf = make_hf_qwen3(seed=21, vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8)
  hf_dir = save_hf_qwen3(str(root / "hf"), hf)
  ckpt = str(root / "ckpt")
  res = run_cli("convert_weights.py", "--hf_dir", hf_dir, "--out_dir", ckpt,
                "--tokenizer", "qwen3-offline")
  assert res.rc == 0, res.stderr
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
  return hf, ckpt, str(prompts)


def _decode(run_cli, ckpt: str, prompts: str, output: str, *extra: str):
  return run_cli("decode.py", "--config", "configs/qwen3.py", "--config.mode=ar",
                 "--config.target", ckpt, "--config.prompts", prompts, "--config.output", output,
                 "--config.max_new_tokens", str(MAX_NEW), *extra)


def test_decode_ar_matches_transformers_greedy_generate(converted, run_cli, tmp_path):
  hf, ckpt, prompts = converted
  output = str(tmp_path / "out" / "ar.jsonl")
  res = _decode(run_cli, ckpt, prompts, output, "--config.max_len", "128")
  assert res.rc == 0, res.stderr
  with open(output) as f:
    records = [json.loads(line) for line in f]
  with open(output + ".summary.json") as f:
    summary = json.load(f)
  assert not os.path.exists(output + ".partial")

  tok = transformers.AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
  assert len(tok) == 151669
  stop = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
  assert [r["id"] for r in records] == [p["id"] for p in PROMPTS]
  lengths = []
  for rec, p in zip(records, PROMPTS):
    assert RECORD_KEYS <= set(rec), sorted(rec)
    assert rec["prompt"] == p["prompt"]
    ids = tok.encode(p["prompt"], add_special_tokens=False)
    lengths.append(len(ids))
    x = torch.tensor([ids])
    with torch.no_grad():
      ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                        max_new_tokens=MAX_NEW, eos_token_id=stop, pad_token_id=stop[1])
    ref_ids = ref[0, len(ids):].tolist()
    assert rec["output_ids"] == ref_ids, p["id"]
    assert rec["new_tokens"] == len(ref_ids)
    assert rec["text"] == tok.decode(ref_ids, skip_special_tokens=False)
    assert rec["prefill_s"] >= 0 and rec["decode_s"] >= 0
  # The prompts fall in two length buckets (32 and 64, from --config.max_len 128).
  assert max(lengths) > 32 >= min(lengths)

  assert SUMMARY_KEYS <= set(summary), sorted(summary)
  assert summary["prompts"] == len(PROMPTS)
  assert summary["tokens_per_s"] > 0
  assert summary["compilations"] == 3  # prefill per bucket used (2) + the AR loop (1)
  assert summary["compilations_by_function"] == {"prefill": 2, "ar_loop": 1}
  # Printed to a pipe: completions without terminal codes, and no line that only applies to
  # speculative decoding.
  assert "--- short" in res.stdout and "\033[" not in res.stdout
  for line in ("verify-length controller", "tau (tokens per spec. cycle)", "block policy"):
    assert line not in res.stdout, line


def _decode_fails(run_cli, ckpt, prompts, tmp_path, *extra: str) -> str:
  out_dir = tmp_path / "never"
  res = _decode(run_cli, ckpt, prompts, str(out_dir / "o.jsonl"), *extra)
  line = res.error_line("decode.py")
  assert res.error_is_last_line_of_its_own("decode.py"), res.stderr
  assert not out_dir.exists(), "a failed run left an output folder"
  return line


def test_unknown_dtype_flag_fails_cleanly(converted, run_cli, tmp_path):
  _, ckpt, prompts = converted
  line = _decode_fails(run_cli, ckpt, prompts, tmp_path, "--config.dtype", "float8")
  assert "--config.dtype='float8'" in line and "float32" in line


def test_prompt_longer_than_the_cache_fails_cleanly(converted, run_cli, tmp_path):
  _, ckpt, prompts = converted
  line = _decode_fails(run_cli, ckpt, prompts, tmp_path, "--config.max_len", "16",
                       "--config.max_new_tokens", "1")
  assert "'long'" in line and "--config.max_len=16" in line


def test_converted_config_contradicting_its_weights_fails_naming_file_and_parameter(
    converted, run_cli, tmp_path):
  _, ckpt, prompts = converted
  bad = tmp_path / "ckpt"
  os.makedirs(bad)
  for name in os.listdir(ckpt):  # share the parameters, edit a copy of config.json
    if name != "config.json":
      os.symlink(os.path.join(ckpt, name), bad / name)
  with open(os.path.join(ckpt, "config.json")) as f:
    cfg = json.load(f)
  cfg["intermediate_size"] = 48
  (bad / "config.json").write_text(json.dumps(cfg))
  line = _decode_fails(run_cli, str(bad), prompts, tmp_path)
  assert str(bad) in line and "config.json" in line
  # Which parameter disagrees (the MLP weights), not only the two shapes.
  assert any(name in line for name in ("gate_proj", "up_proj", "down_proj")), line


def test_second_run_loads_its_programs_from_the_compile_cache(converted, run_cli, tmp_path):
  """The persistent compilation cache is on by default: a second identical run compiles
  nothing (every program is a cache hit). (`--config.compile_cache=''`, which turns it off, is
  what the in-process decodes of test_decode_options run with; their summary says so.)"""
  _, ckpt, prompts = converted
  env = {"XDG_CACHE_HOME": str(tmp_path / "cache_home")}
  summaries = []
  for k in range(2):
    out = str(tmp_path / f"run{k}" / "ar.jsonl")
    res = run_cli("decode.py", "--config", "configs/qwen3.py", "--config.target", ckpt,
                  "--config.prompts", prompts, "--config.output", out,
                  "--config.max_new_tokens", "4", "--config.max_len", "128", env=env)
    assert res.rc == 0, res.stderr
    with open(out + ".summary.json") as f:
      summaries.append(json.load(f))
  first, second = summaries
  assert first["compile_cache"] == str(tmp_path / "cache_home" / "bp_jax" / "jax")
  assert first["compile_cache_hits"] == 0 and first["compilations"] == 3
  assert second["compile_cache_hits"] == second["compilations"] == 3
