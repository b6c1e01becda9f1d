"""PNG plots (matplotlib, headless)."""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


ACCEPTANCE_LABEL = "acceptance length (tokens committed per speculative cycle)"


def save_figure(fig, path: str) -> str:
  """Lays out, writes (PNG, 110 dpi) and closes `fig`; returns `path`."""
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def acceptance_histogram(lengths: Sequence[int], path: str, title: str = "") -> str:
  """Histogram of committed tokens per target forward."""
  counts = collections.Counter(int(a) for a in lengths)
  xs = list(range(1, max(counts, default=1) + 1))
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.bar(xs, [counts.get(x, 0) for x in xs], color="#4c72b0")
  ax.set_xlabel(ACCEPTANCE_LABEL)
  ax.set_ylabel("cycles")
  mean = sum(lengths) / max(len(lengths), 1)
  ax.set_title(f"{title}  (mean {mean:.2f}, {len(lengths)} cycles)".strip())
  return save_figure(fig, path)


def line_plot(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str,
              xlabel: str, ylabel: str, title: str = "") -> str:
  """One line per named (x, y) series."""
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name, (x, y) in series.items():
    ax.plot(x, y, marker="o", label=name)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  if len(series) > 1:
    ax.legend()
  return save_figure(fig, path)
