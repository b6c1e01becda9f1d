"""The OpenAI-compatible request bodies, read and checked: every bad field is an `ApiError`
(HTTP 400) naming it, in OpenAI's error shape ({"error": {"message", "type", "param",
"code"}}).

  parse_completion(body, limits, tokenizer)  POST /v1/completions
  parse_chat(body, limits, tokenizer)        POST /v1/chat/completions

Both give a `GenParams`: the prompt's token ids and the request's generation settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from bp_jax.decoding.state import MAX_ROW_STOP_IDS

MAX_STOP_STRINGS = 8


class ApiError(Exception):
  """An HTTP error answered in OpenAI's shape."""

  def __init__(self, status: int, message: str, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                   type, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
  return ApiError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the server's engine can take."""
  model: str             # the served model's name (`model` must be it)
  max_len: int           # cache slots per request: prompt + max_tokens + block_size - 1
  block_size: int        # the server's bucket
  vocab_size: int
  default_max_tokens: int


@dataclasses.dataclass
class GenParams:
  """One generation request, checked."""
  prompt_ids: list[int]
  max_tokens: int
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  seed: int | None = None
  stop: list[str] = dataclasses.field(default_factory=list)
  stop_token_ids: list[int] = dataclasses.field(default_factory=list)
  stream: bool = False
  include_usage: bool = False
  chat: bool = False

  @property
  def sampling(self) -> tuple:
    return (self.temperature, self.top_k, self.top_p, self.min_p)


def read_json(raw: bytes) -> dict:
  """The body as a JSON object, else a 400 saying what is wrong with it."""
  try:
    body = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                   code="invalid_json")
  return body


def _typed(body: dict, name: str, kinds: tuple, kind_name: str, default: Any = None) -> Any:
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) and bool not in kinds:
    raise bad(name, f"must be {kind_name}, got a boolean", "invalid_type")
  if not isinstance(value, kinds):
    raise bad(name, f"must be {kind_name}, got {type(value).__name__}", "invalid_type")
  if isinstance(value, float) and not math.isfinite(value):
    raise bad(name, f"must be a finite number, got {value}")
  return value


def _number(body, name, default):
  return float(_typed(body, name, (int, float), "a number", default))


def _int(body, name, default):
  return _typed(body, name, (int,), "an integer", default)


def _check_model(body: dict, limits: Limits) -> None:
  model = _typed(body, "model", (str,), "a string")
  if model is None:
    raise bad("model", "is required", "missing_field")
  if model != limits.model:
    raise ApiError(400, f"model: unknown model {model!r}; this server serves {limits.model!r} "
                   "(GET /v1/models)", param="model", code="model_not_found")


def _stops(body: dict) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
    raise bad("stop", "must be a string or a list of strings", "invalid_type")
  if len(stops) > MAX_STOP_STRINGS:
    raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
  if any(not s for s in stops):
    raise bad("stop", "stop strings must not be empty")
  return list(stops)


def _settings(body: dict, limits: Limits, prompt_ids: list[int], prompt_param: str,
              max_tokens_names: tuple[str, ...]) -> GenParams:
  """The fields both endpoints share, checked against the engine's limits."""
  n = _int(body, "n", 1)
  if n != 1:
    raise bad("n", f"only n=1 is supported, got {n}")
  max_tokens = None
  for name in max_tokens_names:
    value = _int(body, name, None)
    if value is not None:
      max_tokens, max_name = value, name
  if max_tokens is None:
    room = limits.max_len - len(prompt_ids) - (limits.block_size - 1)
    max_tokens, max_name = max(1, min(limits.default_max_tokens, room)), max_tokens_names[0]
  if max_tokens < 1:
    raise bad(max_name, f"must be >= 1, got {max_tokens}")
  if max_tokens > limits.max_len:
    raise bad(max_name, f"{max_tokens} exceeds the server's max_len={limits.max_len} "
              "(prompt + max_tokens must fit in it)")
  if not prompt_ids:
    raise bad(prompt_param, "is empty: at least one token is needed")
  room = limits.max_len - (limits.block_size - 1)
  if len(prompt_ids) + 1 > room:
    raise bad(prompt_param, f"the prompt is {len(prompt_ids)} tokens, too long for the "
              f"server's max_len={limits.max_len}", "context_length_exceeded")
  if len(prompt_ids) + max_tokens > room:
    raise bad(max_name, f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} is more "
              f"than the server's max_len={limits.max_len} allows (at most "
              f"{room - len(prompt_ids)} new tokens for this prompt)", "context_length_exceeded")
  temperature = _number(body, "temperature", 0.0)
  if temperature < 0:
    raise bad("temperature", f"must be >= 0, got {temperature}")
  top_p = _number(body, "top_p", 1.0)
  if not 0 < top_p <= 1:
    raise bad("top_p", f"must be in (0, 1], got {top_p}")
  top_k = _int(body, "top_k", 0)
  if top_k == -1:  # vLLM's "off"
    top_k = 0
  if top_k < 0:
    raise bad("top_k", f"must be >= 0 (0 or -1 = off), got {top_k}")
  min_p = _number(body, "min_p", 0.0)
  if not 0 <= min_p < 1:
    raise bad("min_p", f"must be in [0, 1), got {min_p}")
  seed = _int(body, "seed", None)
  if seed is not None and not 0 <= seed < 2**63:
    raise bad("seed", f"must be in [0, 2^63), got {seed}")
  stop_ids = body.get("stop_token_ids") or []
  if not isinstance(stop_ids, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
    raise bad("stop_token_ids", "must be a list of integers", "invalid_type")
  if len(stop_ids) > MAX_ROW_STOP_IDS:
    raise bad("stop_token_ids", f"at most {MAX_ROW_STOP_IDS}, got {len(stop_ids)}")
  if any(not 0 <= t < limits.vocab_size for t in stop_ids):
    raise bad("stop_token_ids", f"ids must be in [0, {limits.vocab_size})")
  stream = _typed(body, "stream", (bool,), "a boolean", False)
  options = _typed(body, "stream_options", (dict,), "an object", {}) or {}
  include_usage = bool(options.get("include_usage", False))
  return GenParams(prompt_ids, int(max_tokens), temperature, top_p, int(top_k), min_p, seed,
                   _stops(body), list(stop_ids), stream, include_usage)


def _check_ids(ids: list, limits: Limits, param: str) -> list[int]:
  if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
    raise bad(param, "must be a string or a list of token ids (integers)", "invalid_type")
  if any(not 0 <= t < limits.vocab_size for t in ids):
    raise bad(param, f"token ids must be in [0, {limits.vocab_size})")
  return list(ids)


def parse_completion(body: dict, limits: Limits, tokenizer) -> GenParams:
  """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of one of
  either (one prompt per request)."""
  _check_model(body, limits)
  if "prompt" not in body:
    raise bad("prompt", "is required", "missing_field")
  prompt = body["prompt"]
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, str):
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
  elif isinstance(prompt, list):
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
      raise bad("prompt", "one prompt per request (send one request per prompt)")
    ids = _check_ids(prompt, limits, "prompt")
  else:
    raise bad("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}",
              "invalid_type")
  if _typed(body, "echo", (bool,), "a boolean", False):
    raise bad("echo", "is not supported")
  if body.get("logprobs") is not None:
    raise bad("logprobs", "is not supported")
  return _settings(body, limits, ids, "prompt", ("max_tokens",))


ROLES = ("system", "user", "assistant", "developer", "tool")


def _content_text(content: Any, i: int) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text"
              and isinstance(part.get("text"), str)):
        raise bad(f"messages[{i}].content", "only text parts are supported", "invalid_type")
      parts.append(part["text"])
    return "".join(parts)
  raise bad(f"messages[{i}].content", "must be a string or a list of text parts",
            "invalid_type")


def parse_chat(body: dict, limits: Limits, tokenizer) -> GenParams:
  """POST /v1/chat/completions: `messages` rendered with the checkpoint's chat template
  (`chat_prompt`)."""
  _check_model(body, limits)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise bad("messages", "must be a non-empty list of {role, content} objects",
              "missing_field" if messages is None else "invalid_type")
  turns = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise bad(f"messages[{i}]", "must be an object with role and content", "invalid_type")
    role = m.get("role")
    if role not in ROLES:
      raise bad(f"messages[{i}].role", f"must be one of {list(ROLES)}, got {role!r}")
    turns.append({"role": "system" if role == "developer" else role,
                  "content": _content_text(m.get("content"), i)})
  ids = chat_prompt(tokenizer, turns)
  params = _settings(body, limits, ids, "messages", ("max_completion_tokens", "max_tokens"))
  params.chat = True
  return params


# A plain ChatML rendering for tokenizers without a chat template (the demo's): the turns as
# text, then the assistant's turn opened.
FALLBACK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                     "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def chat_text(tokenizer, turns: list[dict]) -> str:
  """The conversation rendered with the tokenizer's chat template (thinking off for templates
  that know `enable_thinking`, as `text.tokenizer.encode_prompt`), or `FALLBACK_TEMPLATE`."""
  template = getattr(tokenizer, "chat_template", None)
  kwargs: dict[str, Any] = {}
  if template and "enable_thinking" in str(template):
    kwargs["enable_thinking"] = False
  if not template:
    kwargs["chat_template"] = FALLBACK_TEMPLATE
  return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True,
                                       **kwargs)


def chat_prompt(tokenizer, turns: list[dict]) -> list[int]:
  return list(tokenizer.encode(chat_text(tokenizer, turns), add_special_tokens=False))
