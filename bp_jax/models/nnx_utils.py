"""Small helpers between NNX modules and plain nested dicts of arrays (the checkpoint format)."""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

M = TypeVar("M", bound=nnx.Module)


def module_from_params(make: Callable[[], M], params: dict, dtype=None) -> M:
  """Builds a module abstractly (no random init) and fills it with `params` (a nested dict)."""
  module = nnx.eval_shape(make)
  state = nnx.state(module)
  want = state.to_pure_dict()
  got_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  want_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)}
  if got_paths != want_paths:
    raise ValueError(f"parameter tree mismatch: missing {sorted(want_paths - got_paths)[:5]}, "
                     f"unexpected {sorted(got_paths - want_paths)[:5]}")

  def convert(path, x, ref):
    if tuple(x.shape) != tuple(ref.shape):
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, "
                       f"expected {tuple(ref.shape)}")
    return jnp.asarray(x, dtype or ref.dtype)

  state.replace_by_pure_dict(jax.tree_util.tree_map_with_path(convert, params, want))
  nnx.update(module, state)
  return module


def module_params(module: nnx.Module) -> dict:
  """The module's parameters as a nested dict of arrays."""
  return nnx.state(module, nnx.Param).to_pure_dict()
