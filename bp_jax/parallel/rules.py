"""Logical axes of every parameter, and the one rule table that maps them onto the mesh.

Each parameter of the Qwen3 target (`models/qwen3.py`), the DFlash drafter (`models/dflash.py`)
and the block-size policy MLP (`policy/mlp.py`) is named by its leaf name in the module's state
(`PARAM_AXES`, a logical axis per dimension); `RULES` maps logical axes to mesh axes:

  attention heads (q_proj/o_proj), KV heads (k_proj/v_proj), MLP width, vocabulary (embed /
  lm_head)  -> `model`;   batch rows and KV-cache rows -> `data`;   everything else replicated.

When a dimension does not divide its mesh axis (e.g. 2 KV heads on model:4, or a vocabulary of
1000 on model:3) that dimension is REPLICATED, not refused: decoding stays correct, only memory
is lost. `plan_params` returns one line per replicated dimension and logs them (logger
`bp_jax.parallel`). Head dimensions (stored flattened, N*H) divide only at head boundaries.
The policy MLP (~100k parameters) is replicated: its activations would cost more to gather
than its weights take.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bp_jax.errors import BadInputError

log = logging.getLogger("bp_jax.parallel")

# One decoder layer's parameters (`models/layers.LAYER_PARAM_NAMES`); stacked, they get a
# leading "layers" axis. Shapes: q_proj [D, N*H], k_proj/v_proj [D, K*H], o_proj [N*H, D],
# gate/up [D, F], down [F, D], norms [D] or [H].
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "input_norm": ("embed",), "post_norm": ("embed",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"), "o_proj": ("q_heads", "embed"),
    "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed"),
}

# Every parameter's logical axes, by leaf name (unique across the three models).
PARAM_AXES: dict[str, tuple[str, ...]] = {
    # Qwen3 target: embed [V, D], final_norm [D], lm_head [D, V].
    "embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab"),
    # DFlash drafter: fc [n*D, D], hidden_norm [D], norm [D] (and `layers`).
    "fc": ("features", "embed"), "hidden_norm": ("embed",), "norm": ("embed",),
    # Block-size policy: feature stats [F], w_in [F, H], w_hid [depth-1, H, H], w_out [H, C].
    "feat_mean": ("policy_in",), "feat_inv_std": ("policy_in",),
    "w_in": ("policy_in", "policy_hidden"), "b_in": ("policy_hidden",),
    "w_hid": ("policy_depth", "policy_hidden", "policy_hidden"),
    "b_hid": ("policy_depth", "policy_hidden"),
    "w_out": ("policy_hidden", "policy_classes"), "b_out": ("policy_classes",),
    # The value head's decision rule: prior [C], lam [], static class []; the priced head's
    # prior counts [2C] (in value_prior) and the prices it decides with [2C].
    "value_prior": ("policy_classes",), "value_lam": (), "static_class": (),
    "size_prices": ("policy_prices",),
    **{name: ("layers", *axes) for name, axes in LAYER_AXES.items()},
}

# THE rule table: logical axis -> mesh axis (a name, a tuple of names, or None = replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",                  # rows of a batch (training batches, decode rows)
    "cache_rows": ("data", "model"),  # KVCache rows Z = B*K: sequences on data, KV heads on model
    "vocab": "model",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "embed": None, "layers": None, "head_dim": None, "features": None,
    "policy_in": None, "policy_hidden": None, "policy_depth": None, "policy_classes": None,
    "policy_prices": None,
}

HEAD_AXES = ("q_heads", "kv_heads")  # stored as N*H: split only at multiples of head_dim


@dataclasses.dataclass
class Placement:
  """What `plan_params` decided."""
  shardings: Any                 # a pytree like the state, NamedSharding leaves
  replicated: list[str]          # one line per dimension replicated because it does not divide


def _mesh_axes(rule) -> tuple[str, ...]:
  return () if rule is None else ((rule,) if isinstance(rule, str) else tuple(rule))


def _leaf_name(path) -> str:
  keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return str(keys[-1]) if keys else ""


def _path_name(path) -> str:
  return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _head_dim(state) -> int:
  """head_dim, read off the q_norm weights [L, H] (1 when the state has none)."""
  found = [x.shape[-1] for p, x in jax.tree_util.tree_leaves_with_path(state)
           if _leaf_name(p) == "q_norm"]
  return int(found[0]) if found else 1


def spec_for(name: str, shape: tuple[int, ...], axes: tuple[str, ...], mesh: Mesh,
             rules: Mapping = RULES, head_dim: int = 1,
             replicated: list[str] | None = None) -> P:
  """The PartitionSpec of one array whose dimensions have logical `axes`; a dimension that
  does not divide its mesh axes (or whose mesh axis an earlier dimension took) is replicated
  and a line naming `name` and the dimension is appended to `replicated`."""
  if len(axes) != len(shape):
    raise BadInputError(f"parameter {name!r} has shape {shape} but its logical axes {axes} "
                        f"name {len(axes)} dimensions")
  used: set[str] = set()
  spec = []
  for dim, (size, axis) in enumerate(zip(shape, axes)):
    if axis not in rules:
      raise BadInputError(f"parameter {name!r}: logical axis {axis!r} has no rule in "
                          "bp_jax.parallel.rules.RULES")
    mesh_axes = tuple(a for a in _mesh_axes(rules[axis]) if mesh.shape.get(a, 1) > 1)
    if not mesh_axes:
      spec.append(None)
      continue
    n = math.prod(mesh.shape[a] for a in mesh_axes)
    unit = head_dim if axis in HEAD_AXES else 1
    why = None
    if used & set(mesh_axes):
      why = f"mesh axis {'/'.join(mesh_axes)} is taken by another dimension"
    elif size % unit or (size // unit) % n:
      on = ",".join(f"{a}:{mesh.shape[a]}" for a in mesh_axes)
      why = (f"{size // unit} heads do not divide {on}" if unit > 1
             else f"size {size} does not divide {on}")
    if why:
      if replicated is not None:
        replicated.append(f"{name} dim {dim} ({axis}): {why}; replicated")
      spec.append(None)
      continue
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return P(*spec)


def _state_of(model_or_state):
  if isinstance(model_or_state, nnx.Module):
    return nnx.state(model_or_state)
  return model_or_state


def plan_params(model_or_state, mesh: Mesh, rules: Mapping = RULES) -> Placement:
  """Shardings of a Qwen3 / DFlash / policy module's state (an `nnx.State`, a pure dict of
  arrays or of `jax.ShapeDtypeStruct`s) from `PARAM_AXES` and `rules`; logs each replicated
  dimension.

  Raises:
    BadInputError: a parameter with no entry in `PARAM_AXES`, or of another rank.
  """
  state = _state_of(model_or_state)
  head_dim = _head_dim(state)
  replicated: list[str] = []

  def one(path, x):
    name, leaf = _path_name(path), _leaf_name(path)
    if leaf not in PARAM_AXES:
      raise BadInputError(f"parameter {name!r} has no logical axes in "
                          "bp_jax.parallel.rules.PARAM_AXES")
    return NamedSharding(mesh, spec_for(name, tuple(x.shape), PARAM_AXES[leaf], mesh, rules,
                                        head_dim, replicated))

  shardings = jax.tree_util.tree_map_with_path(one, state)
  for line in replicated:
    log.info("sharding: %s", line)
  return Placement(shardings, replicated)


def param_shardings(model_or_state, mesh: Mesh, rules: Mapping = RULES):
  """A pytree like the state with a `NamedSharding` per parameter (see `plan_params`)."""
  return plan_params(model_or_state, mesh, rules).shardings


def shard_state(model_or_state, mesh: Mesh | None, rules: Mapping = RULES):
  """The state (or a module's state) placed on its rule-table shardings; None mesh: as is."""
  state = _state_of(model_or_state)
  if mesh is None or state is None:
    return state
  return jax.device_put(state, param_shardings(state, mesh, rules))


def abstract_params(abstract: Mapping[str, Any], mesh: Mesh, dtype=None,
                    rules: Mapping = RULES) -> dict[str, Any]:
  """A pure dict of `jax.ShapeDtypeStruct` (or arrays) -> the same with `dtype` (default:
  each leaf's) and the rule-table sharding: an orbax restore target that reads each device's
  shards straight onto it (`checkpoint_io.load_checkpoint(abstract=...)`)."""
  shardings = param_shardings(abstract, mesh, rules)
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(tuple(x.shape), dtype or x.dtype, sharding=s),
      abstract, shardings)


# ---- KV caches and batches -------------------------------------------------------------------


def cache_sharding(cache, mesh: Mesh, rules: Mapping = RULES):
  """Shardings of a `bp_jax.models.kv_cache.KVCache` (stacked or per-layer form), as a KVCache
  of `NamedSharding`s.

  Rows Z = B*K (row b*K + k = KV head k of sequence b) go on RULES["cache_rows"] = (data,
  model): the data part when B % data == 0, the model part when K % model == 0; a part that
  does not divide is replicated. With B/data == 1 the model split falls on KV heads, matching
  the k_proj/v_proj sharding; with more rows per data shard it splits sequences instead (still
  correct, XLA moves the rows). `lengths` [B] on RULES["batch"] when it divides, else
  replicated.
  """
  B = int(cache.lengths.shape[0])
  Z = int(cache.k[0].shape[0] if cache.is_per_layer else cache.k.shape[1])
  K = Z // B
  size = lambda a: mesh.shape.get(a, 1)
  data_ax, model_ax = (_mesh_axes(rules["cache_rows"]) + (None, None))[:2]
  rows = tuple(a for a, n in ((data_ax, B), (model_ax, K))
               if a is not None and size(a) > 1 and n % size(a) == 0)
  rows_spec = None if not rows else (rows[0] if len(rows) == 1 else rows)
  batch_ax = tuple(a for a in _mesh_axes(rules["batch"]) if size(a) > 1)
  len_spec = P(batch_ax[0]) if len(batch_ax) == 1 and B % size(batch_ax[0]) == 0 else P()
  layer = NamedSharding(mesh, P(rows_spec, None, None))
  if cache.is_per_layer:
    return cache.replace(k=tuple(layer for _ in cache.k), v=tuple(layer for _ in cache.v),
                         lengths=NamedSharding(mesh, len_spec))
  stacked = NamedSharding(mesh, P(None, rows_spec, None, None))
  return cache.replace(k=stacked, v=stacked, lengths=NamedSharding(mesh, len_spec))


def shard_cache(cache, mesh: Mesh | None, rules: Mapping = RULES):
  """The cache placed on `cache_sharding`; None mesh (or None cache): as is."""
  if mesh is None or cache is None:
    return cache
  return jax.device_put(cache, cache_sharding(cache, mesh, rules))


def batch_sharding(x, mesh: Mesh, rules: Mapping = RULES) -> NamedSharding:
  """Leading (batch) dimension on RULES["batch"] when it divides, the rest replicated."""
  shape = tuple(getattr(x, "shape", ()))
  if not shape:
    return NamedSharding(mesh, P())
  spec = spec_for("batch", shape[:1], ("batch",), mesh, rules)
  return NamedSharding(mesh, P(*spec, *([None] * (len(shape) - 1))))


def shard_batch(batch, mesh: Mesh | None, rules: Mapping = RULES):
  """A pytree of host arrays [B, ...] placed with `batch_sharding`; None mesh: as is."""
  if mesh is None:
    return batch
  return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(x, mesh, rules)), batch)


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array."""
  return NamedSharding(mesh, P())
