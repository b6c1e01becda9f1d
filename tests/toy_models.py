"""JAX-only toy models for tests of acceptance figures and replays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.qwen3 import Qwen3


def zeros_drafter_pair(vocab_size: int = 64):
  """(target, drafter): a random untied target whose greedy output often is token 0, and a
  drafter whose final norm is zero: its logits are all 0, so it always drafts token 0 and a
  cycle accepts exactly the run of 0s the target produces next — partial acceptances of every
  length, and poor cycles after which an AR fallback steps, are common."""
  V = vocab_size
  cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=False, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    getattr(target.layers, name)[...] = 5 * getattr(target.layers, name)[...]
  head = target.lm_head[...]
  target.lm_head[...] = head.at[:, 0].add(0.3 * jax.random.normal(jax.random.key(5), (32,)))
  layers = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": 1})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=4, num_target_layers=3,
                                       mask_token_id=V - 1, target_layer_ids=(0, 2)),
                          rngs=nnx.Rngs(2))
  drafter.norm[...] = jnp.zeros_like(drafter.norm[...])
  return target, drafter
