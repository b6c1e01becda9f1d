"""The stages of train.py, by name, in the order `all` runs them.

Each stage is a function `stage_fn(cfg) -> None` that reads its inputs from `cfg.workdir` and
fails with a `BadInputError` naming any missing input and the stage that makes it. Stage modules
are imported on first use; a stage whose module is not present yet reports that clearly.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

from bp_jax.errors import BadInputError

StageFn = Callable[[Any], None]

# name -> (module, function), in pipeline order.
STAGE_SOURCES: dict[str, tuple[str, str]] = {
    "tokenizer": ("bp_jax.train.corpus", "tokenizer_stage"),
    "lm_data": ("bp_jax.train.corpus", "lm_data_stage"),
    "lm": ("bp_jax.train.lm", "lm_stage"),
    "regenerate": ("bp_jax.train.regenerate", "regenerate_stage"),
    "draft": ("bp_jax.train.draft", "draft_stage"),
    "labels": ("bp_jax.train.labels", "labels_stage"),
    "policy": ("bp_jax.train.policy_stage", "policy_stage"),
    "report": ("bp_jax.train.report_stage", "report_stage"),
}

# Names that stand for several stages: `all` makes the demo's target and drafter; `blockpilot`
# labels prompts, trains the block-size policies and writes the evaluation report.
STAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "all": ("tokenizer", "lm_data", "lm", "regenerate", "draft"),
    "blockpilot": ("labels", "policy", "report"),
}


def load_stage(name: str) -> StageFn:
  """Imports and returns the function of stage `name`.

  Raises:
    BadInputError: an unknown stage (listing the known ones), or one whose module is missing.
  """
  if name not in STAGE_SOURCES:
    raise BadInputError(f"unknown stage {name!r}; known stages: {', '.join(STAGE_SOURCES)} "
                        f"(or {' / '.join(repr(g) for g in STAGE_GROUPS)})")
  module_name, fn_name = STAGE_SOURCES[name]
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name != module_name:
      raise
    raise BadInputError(f"stage {name!r} is not available: its module {module_name} is "
                        "missing") from None
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise BadInputError(f"stage {name!r} is not available: {module_name} has no "
                        f"function {fn_name}()")
  return fn


def _lazy(name: str) -> StageFn:
  def run(cfg: Any) -> None:
    load_stage(name)(cfg)

  run.__name__ = f"{name}_stage"
  run.__doc__ = f"Runs stage {name!r} ({'.'.join(STAGE_SOURCES[name])})."
  return run


# The registry: stage name -> stage_fn(cfg).
STAGES: dict[str, StageFn] = {name: _lazy(name) for name in STAGE_SOURCES}


def parse_stages(text: str) -> list[str]:
  """A comma-separated list of stage names or group names (`STAGE_GROUPS`) -> stage names, in
  the order given (a group expands in place)."""
  names = [s.strip() for s in str(text or "").split(",") if s.strip()]
  groups = " / ".join(repr(g) for g in STAGE_GROUPS)
  if not names:
    raise BadInputError(f"--config.stage is empty; give {groups} or some of: "
                        f"{', '.join(STAGE_SOURCES)}")
  out: list[str] = []
  for name in names:
    if name in STAGE_GROUPS:
      out += STAGE_GROUPS[name]
    elif name in STAGE_SOURCES:
      out.append(name)
    else:
      raise BadInputError(f"--config.stage: unknown stage {name!r}; known stages: "
                          f"{', '.join(STAGE_SOURCES)} (or {groups})")
  return out


def run_stages(cfg: Any, command: str = "") -> None:
  """Runs the stages named by `cfg.stage`, checking first that all of them are available, while
  holding the workdir's lock (`workdir.workdir_lock`; `command` is recorded in it), with JAX's
  matmul precision set to `cfg.matmul_precision` (`bp_jax.models.precision`)."""
  from bp_jax.models.precision import matmul_precision, precision_of
  from bp_jax.parallel.mesh import make_mesh
  from bp_jax.train.workdir import workdir_lock

  names = parse_stages(cfg.stage)
  fns = [(name, load_stage(name)) for name in names]
  make_mesh(str(cfg.get("mesh", "") or ""))  # a bad --config.mesh fails before any stage runs
  precision = precision_of(cfg)
  with workdir_lock(cfg, ",".join(names), command or "run_stages (in-process)"), \
      matmul_precision(precision):
    for name, fn in fns:
      t0 = time.perf_counter()
      print(f"== stage {name}", flush=True)
      fn(cfg)
      print(f"== stage {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
