"""Tests for bp_jax.text.tokenizer: the offline Qwen3 tokenizer, loading, stop ids, prompt encoding."""

import json
import os
import subprocess
import sys

import pytest
import transformers

from bp_jax.text import tokenizer as tok_lib
from bp_jax.errors import BadInputError

_EXPECTED_SPECIALS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657,
    "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663,
    "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
    "<think>": 151667, "</think>": 151668,
}


@pytest.fixture(scope="module")
def tok():
  return tok_lib.build_offline_qwen3_tokenizer()


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory) -> str:
  """A folder holding `tok` as `save_pretrained` writes it."""
  folder = tmp_path_factory.mktemp("qwen3_tok")
  tok.save_pretrained(str(folder))
  return str(folder)


@pytest.fixture(scope="module")
def reloaded(saved):
  return tok_lib.load_tokenizer(saved)


def test_hello_world_ids(tok):
  assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
  assert tok("Hello world").input_ids == [9707, 1879]


def test_vocab_size_and_special_ids(tok):
  assert len(tok) == 151669
  for token, token_id in _EXPECTED_SPECIALS.items():
    assert tok.convert_tokens_to_ids(token) == token_id, token
    assert tok.encode(token, add_special_tokens=False) == [token_id], token
  assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
  assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643


def test_decode_round_trip(tok):
  text = "def f(x):\n    return x ** 2  # 日本語 émoji 🤖\n<think>\n</think>"
  assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
  # Control tokens are special (skipped on request); think markers are plain added tokens.
  ids = [151644, 9707, 151667, 151645]
  assert tok.decode(ids, skip_special_tokens=True) == "Hello<think>"


def test_cached_build_is_same_object(tok):
  assert tok_lib.build_offline_qwen3_tokenizer() is tok
  assert tok_lib.load_tokenizer("qwen3-offline") is tok


def test_chat_template(tok):
  ids = tok_lib.encode_prompt(tok, "Write hello", chat=True)
  text = tok.decode(ids)
  assert text == ("<|im_start|>user\nWrite hello<|im_end|>\n<|im_start|>assistant\n"
                  "<think>\n\n</think>\n\n")
  assert ids[0] == 151644 and ids.count(151645) == 1
  # With thinking left on, the generation prompt ends right after the assistant header.
  rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
  assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_plain_encode_has_no_specials(tok):
  assert tok_lib.encode_prompt(tok, "Hello world", chat=False) == [9707, 1879]


def test_stop_token_ids(tok):
  assert tok_lib.stop_token_ids(tok) == [151645, 151643]


def test_save_and_load_round_trip(tok, reloaded):
  text = "import numpy as np\nprint(np.arange(10))  # 中文"
  assert reloaded.encode(text, add_special_tokens=False) == tok.encode(
      text, add_special_tokens=False)
  assert reloaded.eos_token_id == 151645 and reloaded.pad_token_id == 151643
  assert tok_lib.encode_prompt(reloaded, "Write hello", chat=True) == tok_lib.encode_prompt(
      tok, "Write hello", chat=True)
  assert tok_lib.stop_token_ids(reloaded) == [151645, 151643]


def test_a_generic_tokenizer_folder_loads_as_autotokenizer_does_without_torch(
    saved, reloaded, tmp_path, monkeypatch):
  """A folder whose tokenizer_config.json names the generic fast tokenizer (this project's
  converted checkpoints) loads through that class, the one AutoTokenizer resolves it to: the
  same tokenizer, and no import of torch (AutoTokenizer's model registry imports it: ~2.7 s of
  every decode.py start). A folder of another class still goes through AutoTokenizer."""
  auto = transformers.AutoTokenizer.from_pretrained(saved, local_files_only=True)
  assert type(reloaded) is type(auto) is transformers.PreTrainedTokenizerFast
  text = "def f(x):\n    return x  # 日本語"
  assert reloaded.encode(text) == auto.encode(text)
  assert reloaded.all_special_ids == auto.all_special_ids
  assert reloaded.chat_template == auto.chat_template and reloaded.eos_token == auto.eos_token
  code = ("import sys; from bp_jax.text.tokenizer import load_tokenizer; "
          f"t = load_tokenizer({saved!r}); "
          "print(t.encode('Hello world', add_special_tokens=False), 'torch' in sys.modules)")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        cwd=repo)
  assert proc.returncode == 0 and proc.stdout.split() == ["[9707,", "1879]", "False"], (
      proc.stdout + proc.stderr)
  # Another class (a Hugging Face Qwen3 folder names Qwen2Tokenizer): AutoTokenizer's call.
  other = tmp_path / "other"
  other.mkdir()
  (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
  calls = []
  monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                      lambda path, **kw: calls.append(path) or "auto's")
  assert tok_lib.load_tokenizer(str(other)) == "auto's" and calls == [str(other)]
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "tokenizer_config.json").write_text("[1, 2")
  with pytest.raises(BadInputError, match="tokenizer_config.json"):
    tok_lib.load_tokenizer(str(bad))


def test_load_tokenizer_errors(tmp_path):
  with pytest.raises(BadInputError, match="no tokenizer files"):
    tok_lib.load_tokenizer(str(tmp_path))
  missing = tmp_path / "nope"
  with pytest.raises(BadInputError, match="nope"):
    tok_lib.load_tokenizer(str(missing))


def test_encode_prompt_without_template_falls_back(tok):
  class NoTemplate:
    chat_template = None

    def encode(self, text, add_special_tokens):
      assert not add_special_tokens
      return tok.encode(text, add_special_tokens=False)

  assert tok_lib.encode_prompt(NoTemplate(), "Hello world", chat=True) == [9707, 1879]
