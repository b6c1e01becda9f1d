"""Resource figures reported by decoding and training runs."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
  """This process's peak resident memory so far, in MiB (Linux ru_maxrss is in KiB)."""
  return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
