"""A small byte-level BPE tokenizer trained on Python source (for the embedded demo model).

Byte-level pre-tokenisation and decoding make it lossless on any text (indentation, tabs,
blank lines and non-ASCII included); no normaliser is applied. Two special tokens come first:
`<|endoftext|>` (id 0: end of text and padding) and `<|mask|>` (id 1: the DFlash mask token).
"""

from __future__ import annotations

import os
from typing import Iterable

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from bp_jax.errors import BadInputError

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
EOS_ID = 0
MASK_ID = 1
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # in id order
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens


def train_bpe(texts_iter: Iterable[str], vocab_size: int,
              out_dir: str | os.PathLike) -> transformers.PreTrainedTokenizerFast:
  """Trains a byte-level BPE tokenizer on `texts_iter` and saves it to `out_dir`.

  The result is deterministic for the same texts (in the same order) and vocab_size, and
  `transformers.AutoTokenizer.from_pretrained(out_dir)` loads it offline. The vocabulary may
  come out smaller than `vocab_size` when the texts allow fewer merges.

  Args:
    texts_iter: training texts (e.g. Python files' contents).
    vocab_size: the vocabulary size to reach, specials included; at least 258.
    out_dir: folder written with `save_pretrained` (created if missing).

  Raises:
    BadInputError: vocab_size below 258, or a text that is not a string.
  """
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
      or vocab_size < MIN_VOCAB_SIZE:
    raise BadInputError(
        f"BPE vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + "
        f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size!r}")

  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tokenizer.train_from_iterator(_checked_texts(texts_iter), trainer=trainer)
  for token, expected in zip(SPECIAL_TOKENS, (EOS_ID, MASK_ID)):
    assert tokenizer.token_to_id(token) == expected, (token, tokenizer.token_to_id(token))

  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
      mask_token=MASK_TOKEN, clean_up_tokenization_spaces=False)
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(os.fspath(out_dir))
  return fast


def _checked_texts(texts: Iterable[str]) -> Iterable[str]:
  for index, text in enumerate(texts):
    if not isinstance(text, str):
      raise BadInputError(f"BPE training text {index} is a {type(text).__name__}, not a string")
    yield text
