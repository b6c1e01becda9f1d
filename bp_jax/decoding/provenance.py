"""Checks that a drafter and a block-size policy were made for the models they are used with.

A drafter written by train.py records its target's parameter fingerprint; a policy records the
fingerprints of the target (and drafter) its labels were made with. A drafter trained for
another target of the same shapes loads fine and silently accepts almost nothing (τ ≈ 1): refuse
it, or, with `allow_foreign`, say so loudly and go on. Checkpoints that record no fingerprint
(converted z-lab drafters) are not checked.
"""

from __future__ import annotations

from typing import Any, Mapping

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


def fingerprints(target: Any, drafter: Any) -> tuple[str, str | None]:
  return model_fingerprint(target), None if drafter is None else model_fingerprint(drafter)
