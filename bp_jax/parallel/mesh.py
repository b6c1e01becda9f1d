"""`--config.mesh=data:D,model:M`: a named device mesh (docs/design.md §9).

The text lists `axis:size` pairs, comma-separated, in any order; an axis left out has size 1,
so the mesh always has both axes `data` (batch rows, KV-cache rows) and `model` (heads, MLP
width, vocabulary). "" (the default) means no mesh: one device, nothing sharded.

Device count: the mesh uses the first D*M devices of `jax.devices()`; D*M must not exceed the
devices there are. On a multi-process run (multi-host TPU slices, after
`jax.distributed.initialize()`) it must equal `jax.device_count()`, so that every process
holds part of the mesh.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from bp_jax.errors import BadInputError

MESH_AXES = ("data", "model")
FLAG = "--config.mesh"
_PAIR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*:\s*([+-]?\d+)\s*")


def parse_mesh(text: str, flag: str = FLAG) -> dict[str, int] | None:
  """`"data:4,model:2"` -> {"data": 4, "model": 2} (both axes, missing ones 1); "" -> None.

  Raises:
    BadInputError (naming `flag`): malformed text, an axis other than data/model, an axis given
      twice, or a size < 1.
  """
  text = (text or "").strip()
  if not text:
    return None
  sizes: dict[str, int] = {}
  for part in text.split(","):
    match = _PAIR.fullmatch(part)
    if match is None:
      raise BadInputError(f"{flag}={text!r}: cannot read {part.strip()!r}; write axis:size "
                          "pairs separated by commas, e.g. data:4,model:2")
    name, size = match.group(1), int(match.group(2))
    if name not in MESH_AXES:
      raise BadInputError(f"{flag}={text!r}: unknown axis {name!r}; the axes are "
                          f"{' and '.join(MESH_AXES)}")
    if name in sizes:
      raise BadInputError(f"{flag}={text!r}: axis {name!r} is given twice")
    if size < 1:
      raise BadInputError(f"{flag}={text!r}: axis {name!r} has size {size}; sizes must be >= 1")
    sizes[name] = size
  return {name: sizes.get(name, 1) for name in MESH_AXES}


def mesh_from_sizes(sizes: dict[str, int], devices: Sequence | None = None,
                    flag: str = FLAG) -> Mesh:
  """A `Mesh` of shape (data, model) over the first data*model of `devices` (default: all).

  Raises:
    BadInputError: more devices asked for than there are, or (several processes) fewer.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = math.prod(sizes[a] for a in MESH_AXES)
  spec = ",".join(f"{a}:{sizes[a]}" for a in MESH_AXES)
  if n > len(devices):
    raise BadInputError(f"{flag}={spec} needs {n} devices but {len(devices)} are available; "
                        "the sizes' product must be at most the device count")
  if jax.process_count() > 1 and n != len(devices):
    raise BadInputError(f"{flag}={spec} covers {n} of {len(devices)} devices; on a "
                        f"multi-process run ({jax.process_count()} processes) the sizes' "
                        "product must equal the device count")
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:  # topology-aware device order on TPU/GPU slices
    return jax.make_mesh(shape, MESH_AXES, (AxisType.Auto,) * len(MESH_AXES),
                         devices=devices[:n])
  except Exception:  # e.g. a subset of devices that the topology helper cannot lay out
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def make_mesh(text: str, devices: Sequence | None = None, flag: str = FLAG) -> Mesh | None:
  """The mesh of a `--config.mesh` value, or None for "" (one device, no sharding)."""
  sizes = parse_mesh(text, flag)
  return None if sizes is None else mesh_from_sizes(sizes, devices, flag)


def describe(mesh: Mesh | None) -> str:
  """`data:4,model:2 (8 devices, cpu)`, or `none` (a log line / summary field)."""
  if mesh is None:
    return "none"
  spec = ",".join(f"{a}:{mesh.shape[a]}" for a in mesh.axis_names)
  return f"{spec} ({mesh.devices.size} devices, {mesh.devices.flat[0].platform})"
