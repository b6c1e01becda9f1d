"""The BlockPilot evaluation report: per-method rows, a markdown table, and PNG plots.

A method's row aggregates its runs over the evaluation prompts (one run per prompt):
  tau            committed tokens / target forwards of the decode loops (cycle-weighted mean
                 acceptance length; 1 for AR)
  request_tau    mean over prompts of each request's τ
  tokens_per_s   new tokens / (prefill + loop seconds), summed over the prompts
  speedup        tokens_per_s / the AR row's tokens_per_s (same prompts, same run)
  mean_size      mean block size; `sizes`: how often each size was used
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from bp_jax.eval.plots import ACCEPTANCE_LABEL, plt, save_figure

Run = Mapping  # {"new_tokens", "prefill_s", "decode_s", "acceptance_lengths", "block_size"}


def method_row(name: str, runs: Sequence[Run], ar_tokens_per_s: float | None = None,
               note: str = "") -> dict:
  """One table row from a method's runs (module docstring)."""
  accepts = [a for r in runs for a in r["acceptance_lengths"]]
  taus = [float(np.mean(r["acceptance_lengths"])) for r in runs if r["acceptance_lengths"]]
  new = sum(r["new_tokens"] for r in runs)
  secs = sum(r["prefill_s"] + r["decode_s"] for r in runs)
  tps = new / max(secs, 1e-12)
  sizes = collections.Counter(int(r["block_size"]) for r in runs)
  return {"method": name, "prompts": len(runs), "tau": float(np.mean(accepts)) if accepts else 0.0,
          "request_tau": float(np.mean(taus)) if taus else 0.0, "new_tokens": int(new),
          "seconds": float(secs), "tokens_per_s": float(tps),
          "speedup": float(tps / ar_tokens_per_s) if ar_tokens_per_s else 1.0,
          "mean_size": float(np.mean([r["block_size"] for r in runs])) if runs else 0.0,
          "sizes": {str(b): sizes[b] for b in sorted(sizes)}, "note": note}


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as a GitHub markdown table."""
  head = ("| method | τ | request τ | tokens/s | speedup vs AR | mean b | sizes used | note |\n"
          "|---|---:|---:|---:|---:|---:|---|---|")
  lines = [head]
  for r in rows:
    sizes = " ".join(f"{b}:{c}" for b, c in r["sizes"].items())
    lines.append(f"| {r['method']} | {r['tau']:.3f} | {r['request_tau']:.3f} | "
                 f"{r['tokens_per_s']:.1f} | {r['speedup']:.3f}x | {r['mean_size']:.2f} | "
                 f"{sizes} | {r.get('note', '')} |")
  return "\n".join(lines)


def tau_by_size_plot(tau_NK: np.ndarray, sizes: Sequence[int], path: str,
                     title: str = "") -> str:
  """τ against block size: one thin line per prompt, the mean in bold, and (bars) how many
  prompts have each size as their best."""
  tau_NK = np.asarray(tau_NK, np.float64)
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for row in tau_NK:
    ax.plot(sizes, row, color="#4c72b0", alpha=0.15, linewidth=0.8)
  if len(tau_NK):
    ax.plot(sizes, tau_NK.mean(axis=0), color="#c44e52", linewidth=2.5, marker="o", label="mean")
    best = np.asarray(sizes)[np.argmax(tau_NK, axis=1)]
    counts = collections.Counter(best.tolist())
    ax2 = ax.twinx()
    ax2.bar(sizes, [counts.get(b, 0) for b in sizes], alpha=0.2, color="#55a868", width=0.6)
    ax2.set_ylabel("prompts whose best size this is")
  ax.set_xlabel("block size")
  ax.set_ylabel("τ (committed tokens per target forward)")
  ax.set_title(title or f"τ by block size ({len(tau_NK)} prompts)")
  ax.legend(loc="upper left")
  return save_figure(fig, path)


def size_distribution_plot(chosen: Mapping[str, Sequence[int]], sizes: Sequence[int],
                           path: str) -> str:
  """Grouped bars: how often each method chose each block size."""
  names = list(chosen)
  width = 0.8 / max(len(names), 1)
  fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(sizes)), 3.8))
  x = np.arange(len(sizes))
  for i, name in enumerate(names):
    counts = collections.Counter(int(b) for b in chosen[name])
    ax.bar(x + (i - (len(names) - 1) / 2) * width, [counts.get(b, 0) for b in sizes], width,
           label=name)
  ax.set_xticks(x, [str(b) for b in sizes])
  ax.set_xlabel("block size")
  ax.set_ylabel("requests")
  ax.set_title("chosen block sizes")
  ax.legend(fontsize=7, ncol=2)
  return save_figure(fig, path)


def acceptance_histograms(accepts: Mapping[str, Sequence[int]], path: str) -> str:
  """Normalised histograms of acceptance lengths, one step line per method."""
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  top = max((max(a) for a in accepts.values() if len(a)), default=1)
  bins = np.arange(0.5, top + 1.5)
  for name, a in accepts.items():
    if len(a):
      ax.hist(a, bins=bins, density=True, histtype="step", linewidth=1.6,
              label=f"{name} (mean {np.mean(a):.2f})")
  ax.set_xlabel(ACCEPTANCE_LABEL)
  ax.set_ylabel("fraction of cycles")
  ax.legend(fontsize=7)
  return save_figure(fig, path)
