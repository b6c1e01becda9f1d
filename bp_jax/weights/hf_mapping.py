"""Mapping between Hugging Face / z-lab safetensors keys and bp_jax parameter trees.

Hugging Face stores Linear weights `[out, in]`; we store `[in, out]` and stack layers along a
leading axis. Both directions stream one tensor at a time.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.errors import BadInputError
from bp_jax.models.qwen3 import layer_param_shapes

# our per-layer name -> (HF key suffix inside a layer, transposed?)
LAYER_KEYS = {
    "input_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}

Getter = Callable[[str], np.ndarray]  # HF key -> array (raises for a missing key)
ShapeOf = Callable[[str], tuple]      # HF key -> shape, without reading the data


def _checked(get: Getter, shape_of: ShapeOf, key: str, want: tuple, transpose: bool,
             source: str, dtype) -> np.ndarray:
  stored = tuple(shape_of(key))
  want_stored = tuple(reversed(want)) if transpose else tuple(want)
  if stored != want_stored:
    raise BadInputError(
        f"{source}: tensor '{key}' has shape {list(stored)} but the config.json implies "
        f"{list(want_stored)} (config and weights do not match)")
  arr = get(key)
  return np.asarray(arr.T if transpose else arr).astype(dtype)


def _stack_layers(get: Getter, shape_of: ShapeOf, cfg: Qwen3Config, prefix: str, source: str,
                  dtype, progress: Callable[[str], None] | None) -> dict[str, np.ndarray]:
  n = cfg.num_hidden_layers
  out = {}
  for name, shape in layer_param_shapes(cfg).items():
    suffix, transpose = LAYER_KEYS[name]
    buf = np.empty((n, *shape), dtype)
    for i in range(n):
      key = f"{prefix}{i}.{suffix}"
      buf[i] = _checked(get, shape_of, key, shape, transpose, source, dtype)
      if progress:
        progress(key)
    out[name] = buf
  return out


def target_params_from_hf(get: Getter, shape_of: ShapeOf, keys: set[str], cfg: Qwen3Config,
                          source: str, dtype=np.float32,
                          progress: Callable[[str], None] | None = None) -> dict:
  """Builds the Qwen3 parameter tree from HF keys `model.*` / `lm_head.weight`."""
  D, V = cfg.hidden_size, cfg.vocab_size
  extra = sorted(k for k in keys if k.startswith("model.layers.")
                 and int(k.split(".")[2]) >= cfg.num_hidden_layers)
  if extra:
    raise BadInputError(f"{source}: has weights for more layers than num_hidden_layers="
                        f"{cfg.num_hidden_layers} in config.json (e.g. '{extra[0]}')")
  params = {"embed": _checked(get, shape_of, "model.embed_tokens.weight", (V, D), False, source,
                              dtype)}
  params["layers"] = _stack_layers(get, shape_of, cfg, "model.layers.", source, dtype, progress)
  params["final_norm"] = _checked(get, shape_of, "model.norm.weight", (D,), False, source, dtype)
  if not cfg.tie_word_embeddings:
    if "lm_head.weight" not in keys:
      raise BadInputError(f"{source}: 'lm_head.weight' is missing and config.json says "
                          "tie_word_embeddings=false")
    params["lm_head"] = _checked(get, shape_of, "lm_head.weight", (D, V), True, source, dtype)
  return params


def drafter_params_from_hf(get: Getter, shape_of: ShapeOf, keys: set[str], cfg: DFlashConfig,
                           source: str, dtype=np.float32,
                           progress: Callable[[str], None] | None = None) -> dict:
  """Builds the DFlash drafter tree from z-lab keys `layers.*`, `fc`, `hidden_norm`, `norm`."""
  c = cfg.layers
  D, n = c.hidden_size, len(cfg.target_layer_ids)
  params = {"layers": _stack_layers(get, shape_of, c, "layers.", source, dtype, progress)}
  params["fc"] = _checked(get, shape_of, "fc.weight", (n * D, D), True, source, dtype)
  params["hidden_norm"] = _checked(get, shape_of, "hidden_norm.weight", (D,), False, source, dtype)
  params["norm"] = _checked(get, shape_of, "norm.weight", (D,), False, source, dtype)
  return params


def _layer_items(layers: dict, prefix: str) -> Iterator[tuple[str, np.ndarray]]:
  n = next(iter(layers.values())).shape[0]
  for i in range(n):
    for name, (suffix, transpose) in LAYER_KEYS.items():
      arr = np.asarray(layers[name][i])
      yield f"{prefix}{i}.{suffix}", np.ascontiguousarray(arr.T if transpose else arr)


def target_params_to_hf(params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """Inverse of `target_params_from_hf`, one tensor at a time."""
  yield "model.embed_tokens.weight", np.asarray(params["embed"])
  yield from _layer_items(params["layers"], "model.layers.")
  yield "model.norm.weight", np.asarray(params["final_norm"])
  if "lm_head" in params:
    yield "lm_head.weight", np.ascontiguousarray(np.asarray(params["lm_head"]).T)


def drafter_params_to_hf(params: dict) -> Iterator[tuple[str, np.ndarray]]:
  """Inverse of `drafter_params_from_hf`, one tensor at a time."""
  yield from _layer_items(params["layers"], "layers.")
  yield "fc.weight", np.ascontiguousarray(np.asarray(params["fc"]).T)
  yield "hidden_norm.weight", np.asarray(params["hidden_norm"])
  yield "norm.weight", np.asarray(params["norm"])
