"""JAX's persistent compilation cache, on by default for decode.py and train.py.

A second run of the same command loads its compiled programs from disk instead of compiling
them again. `--config.compile_cache=DIR` picks the folder ("" turns the cache off); the default
is `$XDG_CACHE_HOME/bp_jax/jax` (`~/.cache/bp_jax/jax`).
"""

from __future__ import annotations

import os

import jax

from bp_jax.errors import BadInputError

DEFAULT = "default"  # --config.compile_cache value meaning default_dir()
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_hits = 0
_compiles = 0


def _count(event: str, **_) -> None:
  global _hits
  if event == _HIT_EVENT:
    _hits += 1


def _count_compile(event: str, duration: float, **_) -> None:
  global _compiles
  if event == _COMPILE_EVENT:
    _compiles += 1


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count_compile)


def hits() -> int:
  """Programs loaded from the persistent cache so far in this process."""
  return _hits


def programs_built() -> int:
  """XLA programs compiled or loaded from the persistent cache so far in this process: every
  jit and every eager op's first use at its shapes, not only the engine's own programs (a
  benchmark's timed runs should add none)."""
  return _compiles + _hits


def default_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "bp_jax", "jax")


def enable(path: str | None) -> str:
  """Turns the persistent cache on at `path` (DEFAULT: `default_dir()`; "" or None: off) and
  returns the folder used ("" when off). Every compiled program is cached, however quick."""
  if not path:
    return ""
  folder = default_dir() if path == DEFAULT else os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise BadInputError(f"--config.compile_cache={path!r}: cannot create {folder} ({e}); give "
                        "a writable folder or '' to turn the cache off") from None
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
