"""Counting XLA backend compilations in tests (any jit, not only the engine's)."""

import jax


class BackendCompiles:
  """Context manager: `n` is the number of XLA backend compilations while it was active."""

  def __init__(self):
    self.n = 0

  def _listener(self, event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      self.n += 1

  def _hit_listener(self, event, **kw):
    # The suite shares a persistent compilation cache (conftest.py): a program another test
    # compiled first is loaded, not compiled, and still counts as the compilation it replaces.
    if event == "/jax/compilation_cache/cache_hits":
      self.n += 1

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    jax.monitoring.register_event_listener(self._hit_listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)
    jax.monitoring.unregister_event_listener(self._hit_listener)
