"""Tests for bp_jax.text.bpe: a small byte-level BPE tokenizer trained on Python source."""

import os

import pytest
import transformers

from bp_jax.text import bpe
from bp_jax.errors import BadInputError

_STDLIB = os.path.dirname(os.__file__)


def _stdlib_texts(names):
  return [open(os.path.join(_STDLIB, n), encoding="utf-8").read() for n in names]


@pytest.fixture(scope="module")
def texts():
  return _stdlib_texts(["textwrap.py", "bisect.py", "colorsys.py", "keyword.py", "this.py"])


@pytest.fixture(scope="module")
def trained(texts, tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("bpe300")
  return bpe.train_bpe(texts, 300, out_dir), out_dir


def test_special_tokens_and_vocab(trained):
  tok, _ = trained
  assert isinstance(tok, transformers.PreTrainedTokenizerFast)
  assert len(tok) == 300
  assert tok.convert_tokens_to_ids("<|endoftext|>") == 0 == bpe.EOS_ID
  assert tok.convert_tokens_to_ids("<|mask|>") == 1 == bpe.MASK_ID
  assert tok.eos_token_id == 0 and tok.pad_token_id == 0 and tok.mask_token_id == 1
  assert tok.encode("x<|mask|>y")[1] == 1
  assert tok.encode("hello") == tok("hello")["input_ids"]  # no BOS/EOS added


def test_round_trip_is_lossless_on_python(trained, texts):
  tok, _ = trained
  others = _stdlib_texts(["glob.py", "fnmatch.py"])  # not seen in training
  tricky = "class A:\n\tdef f(self):\n        return  'é' \t \n\n\n   # ✓\r\n<|endoftext|>\n"
  for text in texts + others + [tricky, "", " ", "\n\n"]:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
  assert len(tok.encode(others[0])) < len(others[0].encode())  # merges do compress


def test_reloads_offline_with_auto_tokenizer(trained, texts):
  tok, out_dir = trained
  loaded = transformers.AutoTokenizer.from_pretrained(out_dir)
  assert loaded.mask_token_id == 1 and loaded.eos_token_id == 0 and len(loaded) == 300
  assert loaded.encode(texts[0]) == tok.encode(texts[0])
  assert loaded.decode(loaded.encode(texts[1])) == texts[1]


def test_training_is_deterministic(texts, tmp_path):
  first = bpe.train_bpe(texts, 600, tmp_path / "a")
  second = bpe.train_bpe(iter(texts), 600, tmp_path / "b")
  assert first.get_vocab() == second.get_vocab()
  with open(tmp_path / "a" / "tokenizer.json", encoding="utf-8") as a, \
      open(tmp_path / "b" / "tokenizer.json", encoding="utf-8") as b:
    assert a.read() == b.read()


def test_bad_inputs(tmp_path):
  with pytest.raises(BadInputError, match="vocab_size"):
    bpe.train_bpe(["x"], 100, tmp_path)
  with pytest.raises(BadInputError, match="not a string"):
    bpe.train_bpe(["x", b"y"], 300, tmp_path)
