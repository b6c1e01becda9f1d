"""A short, dtype-independent hash of a model's parameters: which exact target a dataset, a
drafter or a policy was made with."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from flax import nnx


def model_fingerprint(module: Any) -> str:
  """A short sha256 of a module's parameters (paths, shapes and float32 values), the same
  whatever dtype the module was loaded in."""
  h = hashlib.sha256()
  state = nnx.state(module, nnx.Param).to_pure_dict()
  for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(state),
                           key=lambda kv: jax.tree_util.keystr(kv[0])):
    arr = np.asarray(jax.device_get(leaf), dtype=np.float32)
    h.update(f"{jax.tree_util.keystr(path)}:{arr.shape};".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()[:16]
