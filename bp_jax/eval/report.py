"""The BlockPilot evaluation report: per-method rows, a markdown table, and PNG plots.

A method's row aggregates its runs over the evaluation prompts (one run per prompt); the
figures have decode.py's names and meanings (`run_decode.figures`, `decoding.generation`):
  tau                     mean over prompts of each request's τ: committed tokens per
                          speculative cycle (1 for AR; the AR fallback's steps are no cycles)
  tau_pooled_over_cycles  committed tokens per speculative cycle over all the method's cycles
  tokens_per_forward      mean over prompts of committed tokens per target forward (cycles and
                          AR fallback steps together)
  ar_step_share           AR fallback steps / target forwards, over all runs
  tokens_per_s            new tokens / (prefill + loop seconds), summed over the prompts
  speedup                 tokens_per_s / the AR row's tokens_per_s (same prompts, same run)
  mean_size               mean block size; `sizes`: how often each size was used
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from bp_jax.eval.plots import ACCEPTANCE_LABEL, plt, save_figure

# {"new_tokens", "prefill_s", "decode_s", "block_size", "acceptance_lengths" (per speculative
# cycle), "forward_lengths" (per target forward, in loop order)}
Run = Mapping


def _mean_over_requests(lists: Sequence[Sequence[int]]) -> float:
  means = [float(np.mean(v)) for v in lists if len(v)]
  return float(np.mean(means)) if means else 0.0


def acceptance_figures(runs: Sequence[Run]) -> dict:
  """τ (per speculative cycle: mean over requests and pooled) and tokens per target forward of
  `runs` (module docstring)."""
  cycles = [r["acceptance_lengths"] for r in runs]
  forwards = [r["forward_lengths"] for r in runs]
  pooled = [a for c in cycles for a in c]
  n_cycles, n_forwards = len(pooled), sum(len(f) for f in forwards)
  return {"tau": _mean_over_requests(cycles),
          "tau_pooled_over_cycles": float(np.mean(pooled)) if pooled else 0.0,
          "tokens_per_forward": _mean_over_requests(forwards),
          "cycles": n_cycles, "ar_steps": n_forwards - n_cycles,
          "ar_step_share": (n_forwards - n_cycles) / n_forwards if n_forwards else 0.0}


def method_row(name: str, runs: Sequence[Run], ar_tokens_per_s: float | None = None,
               note: str = "") -> dict:
  """One table row from a method's runs (module docstring)."""
  new = sum(r["new_tokens"] for r in runs)
  secs = sum(r["prefill_s"] + r["decode_s"] for r in runs)
  tps = new / max(secs, 1e-12)
  sizes = collections.Counter(int(r["block_size"]) for r in runs)
  return {"method": name, "prompts": len(runs), **acceptance_figures(runs),
          "new_tokens": int(new), "seconds": float(secs), "tokens_per_s": float(tps),
          "speedup": float(tps / ar_tokens_per_s) if ar_tokens_per_s else 1.0,
          "mean_size": float(np.mean([r["block_size"] for r in runs])) if runs else 0.0,
          "sizes": {str(b): sizes[b] for b in sorted(sizes)}, "note": note}


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as a GitHub markdown table."""
  head = ("| method | τ per spec. cycle (mean over requests) | τ pooled over cycles | "
          "tokens per target forward | AR fallback steps / forwards | tokens/s | speedup vs AR "
          "| mean b | sizes used | note |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
  lines = [head]
  for r in rows:
    sizes = " ".join(f"{b}:{c}" for b, c in r["sizes"].items())
    lines.append(f"| {r['method']} | {r['tau']:.3f} | {r['tau_pooled_over_cycles']:.3f} | "
                 f"{r['tokens_per_forward']:.3f} | {100 * r['ar_step_share']:.1f}% | "
                 f"{r['tokens_per_s']:.1f} | {r['speedup']:.3f}x | {r['mean_size']:.2f} | "
                 f"{sizes} | {r.get('note', '')} |")
  return "\n".join(lines)


def tau_by_size_plot(tau_NK: np.ndarray, sizes: Sequence[int], path: str,
                     title: str = "") -> str:
  """τ (committed tokens per speculative cycle) against block size: one thin line per prompt,
  the mean in bold, and (bars) how many prompts have each size as their best."""
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
  ax.set_ylabel("τ (committed tokens per speculative cycle)")
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
  """Normalised histograms of acceptance lengths per speculative cycle (the AR fallback's
  steps are not cycles), one step line per method."""
  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  top = max((max(a) for a in accepts.values() if len(a)), default=1)
  bins = np.arange(0.5, top + 1.5)
  for name, a in accepts.items():
    if len(a):
      ax.hist(a, bins=bins, density=True, histtype="step", linewidth=1.6,
              label=f"{name} (mean {np.mean(a):.2f})")
  ax.set_xlabel(ACCEPTANCE_LABEL)
  ax.set_ylabel("fraction of speculative cycles")
  ax.legend(fontsize=7)
  return save_figure(fig, path)
