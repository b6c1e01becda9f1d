"""Loading converted checkpoints (targets and drafters) into NNX modules."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from bp_jax.weights.checkpoint_io import load_checkpoint, read_checkpoint_meta
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.errors import BadInputError
from bp_jax.models.nnx_utils import module_from_params
from bp_jax.models.qwen3 import Qwen3

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(name: str | None, flag: str = "--config.dtype"):
  """None -> None (keep the checkpoint's dtype); else one of DTYPES, or a clear error."""
  if name in (None, "", "auto"):
    return None
  if name not in DTYPES:
    raise BadInputError(f"{flag}={name!r} is not a known dtype; use one of {sorted(DTYPES)}")
  return DTYPES[name]


def _build(make, params, ckpt_dir: str, dtype):
  try:
    return module_from_params(make, params, dtype)
  except ValueError as e:
    raise BadInputError(f"checkpoint {ckpt_dir}: parameters do not match its config.json ({e})")


def _restore(ckpt_dir: str, kind: str, make_cfg, make_module, dtype: str | None, mesh):
  """Reads config and metadata, then the params: with a mesh, each restored straight onto its
  rule-table sharding (`bp_jax.parallel.rules`), so no device holds more than its shards."""
  config, meta = read_checkpoint_meta(ckpt_dir, expected_kind=kind)
  cfg = make_cfg(config, f"{ckpt_dir}/config.json")
  dt = parse_dtype(dtype) or jnp.dtype(meta.get("dtype", "float32"))
  make = lambda: make_module(cfg, dtype=dt, rngs=nnx.Rngs(0))
  abstract = None
  if mesh is not None:
    from bp_jax.parallel.rules import abstract_params
    abstract = abstract_params(nnx.state(nnx.eval_shape(make)).to_pure_dict(), mesh, dt)
  params, _, _ = load_checkpoint(ckpt_dir, expected_kind=kind, abstract=abstract)
  return _build(make, params, ckpt_dir, dt)


def load_target(ckpt_dir: str, dtype: str | None = None, mesh=None) -> Qwen3:
  """A Qwen3 target from a folder written by convert_weights.py (or train.py); with a
  `jax.sharding.Mesh`, its weights restored onto the rule table's shardings."""
  return _restore(ckpt_dir, "qwen3", Qwen3Config.from_hf_dict, Qwen3, dtype, mesh)


def load_drafter(ckpt_dir: str, target_cfg: Qwen3Config | None = None,
                 dtype: str | None = None, mesh=None) -> DFlashDrafter:
  """A DFlash drafter; checked against `target_cfg` when given; `mesh` as for `load_target`."""
  drafter = _restore(ckpt_dir, "dflash", DFlashConfig.from_hf_dict, DFlashDrafter, dtype, mesh)
  if target_cfg is not None:
    drafter.validate_against_target(target_cfg, ckpt_dir)
  return drafter
