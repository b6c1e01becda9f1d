"""Checks that a drafter and a block-size policy were made for the models they are used with.

A drafter written by train.py records its target's parameter fingerprint; a policy records the
fingerprints of the target (and drafter) its labels were made with. A drafter trained for
another target of the same shapes loads fine and silently accepts almost nothing (τ ≈ 1): refuse
it, or, with `allow_foreign`, say so loudly and go on. Checkpoints that record no fingerprint
(converted z-lab drafters) are not checked.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from bp_jax.errors import BadInputError
from bp_jax.models.fingerprint import model_fingerprint


def _mismatch(message: str, allow_foreign: bool, flag: str) -> None:
  if not allow_foreign:
    raise BadInputError(f"{message} (--config.{flag}=true decodes anyway)")
  print(f"WARNING: {message}; decoding anyway because --config.{flag} is set: "
        "expect almost no accepted drafts", flush=True)


def check_drafter_made_for(drafter_meta: Mapping[str, Any], drafter_dir: str,
                           target_fingerprint: str, target_dir: str,
                           allow_foreign: bool = False) -> None:
  want = drafter_meta.get("target_fingerprint")
  if want is not None and want != target_fingerprint:
    _mismatch(f"{drafter_dir}: this drafter was trained against a target with fingerprint {want}, "
              f"but {target_dir} has fingerprint {target_fingerprint} (other weights)",
              allow_foreign, "allow_foreign_drafter")


def check_policy_made_for(policy_meta: Mapping[str, Any], policy_dir: str,
                          target_fingerprint: str, drafter_fingerprint: str | None,
                          allow_foreign: bool = False) -> None:
  labels = policy_meta.get("labels") or {}
  for name, have in (("target", target_fingerprint), ("drafter", drafter_fingerprint)):
    want = labels.get(f"{name}_fingerprint")
    if want is not None and have is not None and want != have:
      _mismatch(f"{policy_dir}: this policy was labelled with a {name} of fingerprint {want}, "
                f"but the {name} given has fingerprint {have} (other weights): relabel and "
                "retrain it (train.py --config.stage=labels,policy)", allow_foreign,
                "allow_foreign_drafter")


def stored_fingerprint(module: Any, ckpt_dir: str, load: Callable[[str, str | None], Any]) -> str:
  """The fingerprint of a checkpoint's weights as stored (what train.py recorded), from the
  loaded `module` when its dtype holds the stored values exactly (the same dtype, or float32),
  else from a second load at the stored dtype (`load(ckpt_dir, None)`): e.g. bfloat16 weights
  loaded as float16 are rounded, and their hash would no longer match."""
  from bp_jax.weights.checkpoint_io import read_checkpoint_meta

  stored = np.dtype(read_checkpoint_meta(ckpt_dir)[1].get("dtype", "float32"))
  loaded = np.dtype(module.dtype)
  if loaded == stored or loaded in (np.dtype("float32"), np.dtype("float64")):
    return model_fingerprint(module)
  return model_fingerprint(load(ckpt_dir, None))


class Fingerprints:
  """The target's and drafter's stored-weight fingerprints of one decode run, computed once."""

  def __init__(self, target: Any, target_dir: str, drafter: Any = None, drafter_dir: str = ""):
    self._args = {"target": (target, target_dir), "drafter": (drafter, drafter_dir)}
    self._done: dict[str, str | None] = {}

  def get(self, name: str) -> str | None:
    if name not in self._done:
      from bp_jax.weights.loading import load_drafter, load_target

      module, path = self._args[name]
      load = load_target if name == "target" else (lambda d, dt: load_drafter(d, None, dt))
      self._done[name] = None if module is None else stored_fingerprint(module, path, load)
    return self._done[name]
