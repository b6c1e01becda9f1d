"""Training checkpoints with orbax's CheckpointManager: arrays + JSON metadata per step.

Each step folder `<dir>/<step>/` holds two items: `state` (a pytree of arrays: params, optimiser
state, rng, stored leaf by leaf) and `meta` (JSON: step, data position, ...). Orbax writes a step
into `<step>.orbax-checkpoint-tmp` and renames it into place only once every item is written, so
an interrupted save leaves the previous step as the latest; leftover temporary folders are
ignored and removed the next time the manager is opened.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from bp_jax.weights.checkpoint_io import _quiet_orbax
from bp_jax.errors import BadInputError

MAX_TO_KEEP = 2
TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's suffix for a step folder being written


def _leaves_dict(tree: Any) -> dict[str, Any]:
  """A pytree's leaves as {"00000": leaf, ...} (orbax-friendly keys, order = tree order)."""
  return {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def flatten_state(trees: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """{"params": tree, ...} -> {"params": {"00000": leaf, ...}, ...} for saving."""
  return {name: _leaves_dict(tree) for name, tree in trees.items()}


def unflatten_state(stored: dict[str, dict[str, Any]], like: dict[str, Any]) -> dict[str, Any]:
  """Inverse of `flatten_state`, using the tree structures of `like`."""
  out = {}
  for name, tree in like.items():
    leaves, treedef = jax.tree.flatten(tree)
    got = stored[name]
    out[name] = jax.tree.unflatten(treedef, [got[f"{i:05d}"] for i in range(len(leaves))])
  return out


class TrainCheckpointer:
  """Saves and restores training state under `directory`, keeping the newest MAX_TO_KEEP steps."""

  def __init__(self, directory: str, max_to_keep: int = MAX_TO_KEEP):
    self.directory = os.path.abspath(directory)
    remove_unfinished(self.directory)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
        enable_async_checkpointing=False, cleanup_tmp_directories=False, create=True)
    with _quiet_orbax():
      self._manager = ocp.CheckpointManager(
          self.directory, options=options,
          item_handlers={"state": ocp.StandardCheckpointHandler(),
                         "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    """The newest fully written step, or None."""
    with _quiet_orbax():
      self._manager.reload()
      return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    with _quiet_orbax():
      return sorted(self._manager.all_steps())

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Writes `state` (a dict of pytrees of arrays) and JSON `meta` as checkpoint `step`."""
    try:
      with _quiet_orbax():
        self._manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(flatten_state(state)), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()
    except BaseException:
      # The step was never committed, so the latest checkpoint is still the previous one.
      # Tidy the partial folder (best effort: writer threads may still be finishing it; any
      # leftover is ignored by orbax and removed when a manager is next opened).
      _settle_and_remove(self.directory)
      raise

  def restore(self, step: int, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores checkpoint `step` into the structure, shapes and dtypes of `like`.

    Raises:
      BadInputError: the stored arrays do not match `like` (a workdir of another model/config).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten_state(like))
    path = os.path.join(self.directory, str(step))
    with _quiet_orbax():
      try:
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        stored = self._manager.item_metadata(step)["state"]
        _check_matches(stored, abstract, path)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
      except BadInputError:
        raise
      except Exception as e:  # orbax raises assorted types for damaged or foreign folders
        raise BadInputError(f"cannot restore training checkpoint {path}: "
                            f"{type(e).__name__}: {e}") from e
    return unflatten_state(restored["state"], like), dict(meta["meta"])

  def close(self) -> None:
    with _quiet_orbax():
      self._manager.close()


def remove_unfinished(directory: str, attempts: int = 50) -> list[str]:
  """Deletes step folders left unfinished by an interrupted save; returns their names.

  Retries for a while: after a save failed inside this process, orbax's writer threads may
  still be finishing files in the folder being deleted.
  """
  if not os.path.isdir(directory):
    return []
  names = [n for n in os.listdir(directory) if TMP_MARKER in n]
  for name in names:
    path = os.path.join(directory, name)
    for attempt in range(attempts):
      shutil.rmtree(path, ignore_errors=True)
      if not os.path.exists(path):
        break
      time.sleep(0.02 * (attempt + 1))
    else:
      raise BadInputError(f"cannot remove the unfinished checkpoint folder {path}; delete it "
                          "by hand")
  return names


def _settle_and_remove(directory: str, quiet_polls: int = 3, max_polls: int = 40) -> None:
  """Removes unfinished step folders until none has reappeared for `quiet_polls` polls."""
  quiet = 0
  for _ in range(max_polls):
    try:
      found = remove_unfinished(directory, attempts=5)
    except BadInputError:
      found = ["busy"]
    quiet = 0 if found else quiet + 1
    if quiet >= quiet_polls:
      return
    time.sleep(0.05)


def _check_matches(stored: Any, abstract: dict[str, dict[str, Any]], path: str) -> None:
  """Clear error when a checkpoint holds other arrays than the model being trained."""
  for name, leaves in abstract.items():
    have = dict(stored.get(name, {})) if stored is not None else {}
    if set(have) != set(leaves):
      raise BadInputError(
          f"training checkpoint {path} holds {len(have)} '{name}' arrays but this run has "
          f"{len(leaves)}: it was written for another model or optimiser; use a fresh workdir "
          "or delete the old checkpoints")
    for key, want in leaves.items():
      got_shape = tuple(getattr(have[key], "shape", ()))
      if got_shape != tuple(want.shape):
        raise BadInputError(
            f"training checkpoint {path}: '{name}' array {key} has shape {got_shape} but this "
            f"run expects {tuple(want.shape)}: it was written for another model config; use a "
            "fresh workdir or delete the old checkpoints")

