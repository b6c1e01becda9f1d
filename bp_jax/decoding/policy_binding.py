"""Checks that a block-size policy fits the engine it is bound to: its classes, its feature
type (some need the drafter) and its input width (the target's and drafter's sizes)."""

from __future__ import annotations

from typing import Sequence

from bp_jax.errors import BadInputError
from bp_jax.policy.features import DRAFT_CONFIDENCE, POOLED_LAYERS, feature_dims


def check_policy_fits(policy, sizes: Sequence[int], target_cfg, drafter) -> None:
  """Raises BadInputError when `policy` cannot choose among `sizes` on this target/drafter."""
  arch = policy.arch
  if len(sizes) != arch.num_classes:
    raise BadInputError(f"the policy has {arch.num_classes} classes but {len(sizes)} block "
                        f"sizes were given ({list(sizes)})")
  if arch.feature_type in (POOLED_LAYERS, DRAFT_CONFIDENCE) and drafter is None:
    raise BadInputError(f"a policy over '{arch.feature_type}' needs the drafter; "
                        "give a drafter (--config.drafter)")
  dims = feature_dims(target_cfg.vocab_size, target_cfg.hidden_size,
                      0 if drafter is None else len(drafter.cfg.target_layer_ids),
                      0 if drafter is None else drafter.cfg.block_size)
  want = dims.get(arch.feature_type)
  if want != arch.input_dim:
    raise BadInputError(f"the policy reads {arch.input_dim} '{arch.feature_type}' features but "
                        f"this target/drafter gives {want}: it was trained for another model")
