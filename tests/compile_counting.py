"""Counting XLA backend compilations in tests (any jit, not only the engine's)."""

from bp_jax.compile_cache import programs_built


class BackendCompiles:
  """Context manager: `n` is the number of XLA programs built while it was active (compiled,
  or loaded from the persistent compilation cache the suite shares, conftest.py: a program
  another test compiled first still counts as the compilation it replaces), as
  `bp_jax.compile_cache.programs_built` counts them."""

  def __init__(self):
    self._start = self._end = None

  @property
  def n(self) -> int:
    if self._start is None:
      return 0
    return (programs_built() if self._end is None else self._end) - self._start

  def __enter__(self):
    self._start, self._end = programs_built(), None
    return self

  def __exit__(self, *exc):
    self._end = programs_built()

  def __repr__(self) -> str:
    return f"BackendCompiles(n={self.n})"
