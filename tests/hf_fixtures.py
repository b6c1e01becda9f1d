"""Tiny random Hugging Face Qwen3 checkpoints, built by the tests with transformers."""

from __future__ import annotations

import os

import torch
import transformers

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6,
            max_position_embeddings=512, rope_theta=10000.0)


def make_hf_qwen3(seed: int = 0, tie: bool = False, **overrides) -> transformers.Qwen3ForCausalLM:
  """A random float32 Qwen3ForCausalLM; weights scaled up so logits are not near-uniform."""
  kw = dict(TINY, tie_word_embeddings=tie)
  kw.update(overrides)
  cfg = transformers.Qwen3Config(**kw)
  torch.manual_seed(seed)
  model = transformers.Qwen3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model


def save_hf_qwen3(path: str, model: transformers.Qwen3ForCausalLM, **kw) -> str:
  os.makedirs(path, exist_ok=True)
  model.save_pretrained(path, **kw)
  return path


def state_dict_getters(model: torch.nn.Module):
  """(get, shape_of, keys) over a torch module's state dict, in the HF key layout."""
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  return sd.__getitem__, (lambda k: sd[k].shape), set(sd)


def jax_qwen3_from_torch(model: transformers.Qwen3ForCausalLM, dtype=None):
  """Our NNX Qwen3 holding the same weights as a transformers model."""
  import jax.numpy as jnp
  from flax import nnx
  from bp_jax.models.config import Qwen3Config
  from bp_jax.weights.hf_mapping import target_params_from_hf
  from bp_jax.models.nnx_utils import module_from_params
  from bp_jax.models.qwen3 import Qwen3
  cfg = Qwen3Config.from_hf_dict(model.config.to_dict())
  get, shape_of, keys = state_dict_getters(model)
  params = target_params_from_hf(get, shape_of, keys, cfg, "torch")
  dtype = dtype or jnp.float32
  return module_from_params(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)), params)


def make_dflash_state_dict(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
  """Random float32 weights of a z-lab DFlash drafter (`cfg`: bp_jax DFlashConfig), z-lab key names.

  Linear weights are `[out, in]` as in the z-lab safetensors files; norms are near 1.
  """
  c = cfg.layers
  D, F, H = c.hidden_size, c.intermediate_size, c.head_dim
  N, K, n = c.num_attention_heads, c.num_key_value_heads, len(cfg.target_layer_ids)
  g = torch.Generator().manual_seed(seed)
  shapes = {"self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
            "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
            "self_attn.q_norm.weight": (H,), "self_attn.k_norm.weight": (H,),
            "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
            "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D),
            "mlp.down_proj.weight": (D, F)}
  shapes = {f"layers.{i}.{k}": s for i in range(c.num_hidden_layers) for k, s in shapes.items()}
  shapes.update({"fc.weight": (D, n * D), "hidden_norm.weight": (D,), "norm.weight": (D,)})
  sd = {}
  for key, shape in shapes.items():
    if "norm" in key:
      sd[key] = 1.0 + 0.1 * torch.randn(shape, generator=g)
    else:
      sd[key] = 0.08 * torch.randn(shape, generator=g)
  return sd


def dict_getters(sd: dict):
  """(get, shape_of, keys) over a dict of torch tensors / arrays, for `hf_mapping.*_from_hf`."""
  np_sd = {k: (v.detach().float().numpy() if isinstance(v, torch.Tensor) else v)
           for k, v in sd.items()}
  return np_sd.__getitem__, (lambda k: np_sd[k].shape), set(np_sd)


def jax_drafter_from_state_dict(cfg, sd: dict):
  """Our NNX DFlash drafter holding the weights of a z-lab-named state dict."""
  from flax import nnx
  from bp_jax.models.dflash import DFlashDrafter
  from bp_jax.weights.hf_mapping import drafter_params_from_hf
  from bp_jax.models.nnx_utils import module_from_params
  get, shape_of, keys = dict_getters(sd)
  params = drafter_params_from_hf(get, shape_of, keys, cfg, "tiny-dflash")
  return module_from_params(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)), params)
