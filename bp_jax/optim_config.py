"""Optimiser settings as config data (configs/*.py build them without importing training code)."""

from __future__ import annotations

from typing import Any

import ml_collections

from bp_jax.errors import BadInputError

# Fields of an optimiser ConfigDict and their defaults (the published DFlash recipe's shape).
DEFAULTS: dict[str, Any] = {
    "lr": 3e-4,             # peak learning rate
    "warmup_frac": 0.04,    # fraction of the steps spent warming up linearly from 0
    "min_lr_frac": 0.1,     # final learning rate as a fraction of `lr` (cosine end value)
    "weight_decay": 0.0,    # decoupled weight decay (not applied to norms or 1-D leaves)
    "clip": 1.0,            # global gradient-norm clip; 0 disables clipping
    "b1": 0.9,
    "b2": 0.95,
    "eps": 1e-8,
}


def opt_config(**overrides: Any) -> ml_collections.ConfigDict:
  """An optimiser ConfigDict with every field of DEFAULTS (for configs/*.py)."""
  unknown = set(overrides) - set(DEFAULTS)
  if unknown:
    raise BadInputError(f"unknown optimiser field(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
  return ml_collections.ConfigDict({**DEFAULTS, **overrides})
