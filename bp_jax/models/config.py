"""Model configs read from Hugging Face `config.json` files (Qwen3 targets, z-lab DFlash drafters)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from bp_jax.errors import BadInputError

_QWEN3_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Sizes of a dense Qwen3 decoder (target) or of a DFlash drafter's layer stack."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960

  def __post_init__(self):
    if self.num_attention_heads % self.num_key_value_heads:
      raise BadInputError(
          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise BadInputError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")

  @property
  def q_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
    missing = [k for k in _QWEN3_INT_KEYS if k not in d]
    if missing:
      raise BadInputError(f"{source}: missing key(s) {missing}")
    theta = d.get("rope_theta")
    if theta is None:
      theta = (d.get("rope_parameters") or {}).get("rope_theta")
    if theta is None:
      raise BadInputError(f"{source}: no RoPE base (neither 'rope_theta' nor 'rope_parameters.rope_theta')")
    rope_type = (d.get("rope_parameters") or d.get("rope_scaling") or {}).get("rope_type", "default")
    if rope_type not in ("default", None):
      raise BadInputError(f"{source}: rope_type={rope_type!r} is not supported (only 'default')")
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    return cls(
        **{k: int(d[k]) for k in _QWEN3_INT_KEYS},
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
    )

  def to_hf_dict(self) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        **{k: getattr(self, k) for k in _QWEN3_INT_KEYS},
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "silu", "attention_bias": False,
    }


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """DFlash's default target layers when a config does not list them (docs/design.md §2)."""
  L, n = num_target_layers, num_draft_layers
  if n == 1:
    return (L // 2,)
  return tuple(int(round(1 + i * (L - 4) / (n - 1))) for i in range(n))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """A z-lab DFlash drafter: its own layer stack plus what ties it to a target."""
  layers: Qwen3Config          # sizes of the draft layers (vocab is the target's)
  block_size: int              # the block size the drafter was trained with
  num_target_layers: int       # layers of the target it was trained against
  mask_token_id: int
  target_layer_ids: tuple[int, ...]

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DFlashConfig":
    layers = Qwen3Config.from_hf_dict(d, source)
    for key in ("block_size", "num_target_layers"):
      if key not in d:
        raise BadInputError(f"{source}: DFlash drafter config lacks '{key}'")
    dcfg = d.get("dflash_config") or {}
    if "mask_token_id" not in dcfg:
      raise BadInputError(f"{source}: DFlash drafter config lacks 'dflash_config.mask_token_id'")
    ids = dcfg.get("target_layer_ids")
    if ids is None:
      ids = default_target_layer_ids(int(d["num_target_layers"]), layers.num_hidden_layers)
    return cls(layers=layers, block_size=int(d["block_size"]),
               num_target_layers=int(d["num_target_layers"]),
               mask_token_id=int(dcfg["mask_token_id"]), target_layer_ids=tuple(int(i) for i in ids))

  def to_hf_dict(self) -> dict[str, Any]:
    d = self.layers.to_hf_dict()
    d.update(architectures=["DFlashDraftModel"], block_size=self.block_size,
             num_target_layers=self.num_target_layers,
             dflash_config={"mask_token_id": self.mask_token_id,
                            "target_layer_ids": list(self.target_layer_ids)})
    return d


def is_dflash_dict(d: dict[str, Any]) -> bool:
  return "dflash_config" in d or "num_target_layers" in d


def read_config_json(path: str) -> dict[str, Any]:
  """Reads a config.json, with a clear error naming the file when it is missing or malformed."""
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.exists(path):
    raise BadInputError(f"{path}: no such file (expected a Hugging Face config.json)")
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise BadInputError(f"{path}: not valid JSON ({e})") from e
