"""AdamW with linear warmup + cosine decay, global-norm clipping and masked weight decay."""

from __future__ import annotations

from typing import Any

import jax
import optax

from bp_jax.errors import BadInputError
from bp_jax.optim_config import DEFAULTS


def _field(cfg: Any, name: str) -> float:
  value = cfg.get(name, DEFAULTS[name]) if hasattr(cfg, "get") else getattr(cfg, name)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise BadInputError(f"optimiser field {name}={value!r} must be a number")
  return float(value)


def lr_schedule(cfg: Any, num_steps: int) -> optax.Schedule:
  """0 -> lr linearly over round(warmup_frac * num_steps) steps, then cosine to min_lr_frac * lr."""
  lr, warm, end = _field(cfg, "lr"), _field(cfg, "warmup_frac"), _field(cfg, "min_lr_frac")
  if lr <= 0:
    raise BadInputError(f"optimiser lr={lr} must be > 0")
  if not 0.0 <= warm < 1.0:
    raise BadInputError(f"optimiser warmup_frac={warm} must lie in [0, 1)")
  if not 0.0 <= end <= 1.0:
    raise BadInputError(f"optimiser min_lr_frac={end} must lie in [0, 1]")
  if num_steps < 1:
    raise BadInputError(f"num_steps={num_steps} must be >= 1")
  warmup_steps = max(1, round(warm * num_steps)) if warm > 0 else 0
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
      decay_steps=max(num_steps, warmup_steps + 1), end_value=lr * end)


def decay_mask(params: Any) -> Any:
  """True for leaves that get weight decay: matrices, except norm weights (stacked norms are 2-D)."""

  def wants_decay(path, leaf) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    return leaf.ndim >= 2 and not any("norm" in n for n in names)

  return jax.tree_util.tree_map_with_path(wants_decay, params)


def make_optimizer(cfg: Any, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (+ clipping) from an optimiser ConfigDict; returns (transformation, lr schedule)."""
  schedule = lr_schedule(cfg, num_steps)
  clip, wd = _field(cfg, "clip"), _field(cfg, "weight_decay")
  if clip < 0 or wd < 0:
    raise BadInputError(f"optimiser clip={clip} and weight_decay={wd} must be >= 0")
  adamw = optax.adamw(schedule, b1=_field(cfg, "b1"), b2=_field(cfg, "b2"), eps=_field(cfg, "eps"),
                      weight_decay=wd, mask=decay_mask)
  parts = ([optax.clip_by_global_norm(clip)] if clip > 0 else []) + [adamw]
  return optax.chain(*parts), schedule
