"""bp_jax: BlockPilot-style adaptive speculative decoding with DFlash drafters, in JAX/Flax NNX.

The small public API, for notebooks and scripts:

  from bp_jax import load_target, load_drafter, load_tokenizer, Engine, ShapeOptions
  target = load_target("ckpt/qwen3-4b")
  drafter = load_drafter("ckpt/dflash-4b", target.cfg)
  engine = Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=2048, block_sizes=(16,)))
  out = engine.generate(prompt_ids, max_new_tokens=256, block_size=16)  # a Generation

Sub-packages by role: models/ (the networks), weights/ (checkpoints and conversion), decoding/
(the jitted loops and the engine), policy/ (BlockPilot's block-size policy), text/ (tokenizers,
prompts), eval/ (reports, plots), train/ and data/ (train.py's stages; nothing outside them
imports them). Names below are imported on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Qwen3": "bp_jax.models.qwen3",
    "Qwen3Config": "bp_jax.models.config",
    "DFlashDrafter": "bp_jax.models.dflash",
    "DFlashConfig": "bp_jax.models.config",
    "load_target": "bp_jax.weights.loading",
    "load_drafter": "bp_jax.weights.loading",
    "load_tokenizer": "bp_jax.text.tokenizer",
    "encode_prompt": "bp_jax.text.tokenizer",
    "load_prompts": "bp_jax.text.prompts",
    "Engine": "bp_jax.decoding.engine",
    "Generation": "bp_jax.decoding.generation",
    "LEARNED": "bp_jax.decoding.engine",
    "ShapeOptions": "bp_jax.decoding.options",
    "LoopOptions": "bp_jax.decoding.options",
    "BatchOptions": "bp_jax.decoding.options",
    "BlockPolicy": "bp_jax.policy.mlp",
    "load_policy": "bp_jax.policy.mlp",
    "BadInputError": "bp_jax.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'bp_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + __all__)
