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


def interval_bars(values: Mapping[str, tuple[float, float, float]], path: str, ylabel: str,
                  title: str = "", reference: float | None = 1.0) -> str:
  """One horizontal bar per name at its value, with its (low, high) interval as an error bar,
  and a vertical line at `reference` (e.g. 1.0 for a ratio)."""
  names = list(values)
  mid = [values[n][0] for n in names]
  err = [[m - values[n][1] for n, m in zip(names, mid)], [values[n][2] - m for n, m in
                                                          zip(names, mid)]]
  fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.2))
  ax.barh(range(len(names)), mid, xerr=err, color="#4c72b0", capsize=3)
  ax.set_yticks(range(len(names)), names)
  ax.invert_yaxis()
  if reference is not None:
    ax.axvline(reference, color="k", lw=0.8)
  ax.set_xlabel(ylabel)
  if title:
    ax.set_title(title)
  return save_figure(fig, path)
