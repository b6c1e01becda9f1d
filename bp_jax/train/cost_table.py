"""The labels stage's per-machine cost table: what one AR step and one speculative cycle of each
candidate size cost on this machine, measured robustly once and stored with the labels.

Why: at T = 0 the cycles and AR steps of a (prompt, size) decode are deterministic, but one
wall-clock timing per (prompt, size) is not (this 2-core CPU varies by 25-40% between two runs
of one command). `max_throughput` labels priced as counts x this table are reproducible: the
same counts and the same table give the same labels (`label_sets.decode_seconds`).

What is measured (`measure_cost_table`), from `cost_reps` repetitions over `cost_prompts`
calibration prompts (the first labelling prompts), every (prompt, size) run interleaved with the
others in a rotating order, the production loops of the labels stage's engine:
  ar_step_s          median seconds per step of plain AR decoding (block size 1);
  cycle_s[b]         median seconds per cycle of size b, from decodes whose drafter proposes the
                     target's own greedy continuation (every draft accepted: pure cycles; a
                     cycle's compute does not depend on how many drafts survive; a size whose
                     every cycle counts as poor, b - 1 <= ar_fallback_accept, still takes
                     fallback steps, charged there at the AR step);
  fallback_step_s[b] with AR fallback steps in the loop (`--config.ar_fallback`): seconds per
                     fallback step of size b's loop (a target step that also feeds the drafter
                     its context), from decodes whose drafts are all wrong (every cycle is
                     followed by fallback steps): (time - cycles * cycle_s[b]) / steps, at
                     least ar_step_s.
Medians are over every repetition of every calibration prompt; `spread` holds the relative
interquartile range of each, so the report can show how stable they were.

The table is saved as `<workdir>/data/cost_table.json` with the key it was measured under
(`table_key`: this machine, the models, the loops' form) and reused by later labelling runs
that have the same key (`--config.blockpilot.cost_table=auto`); `remeasure` measures again; a
path uses that table file as it is (e.g. to price labels for another machine).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from bp_jax.decoding.costs import machine_fingerprint  # noqa: F401 (moved there; read here)
from bp_jax.errors import BadInputError

TABLE_FILE = "cost_table.json"
FORMAT = 1


def table_key(target_fingerprint: str, drafter_fingerprint: str, loop: Mapping[str, Any],
              max_len: int, dtype: str, sizes: Sequence[int], new_tokens: int) -> dict:
  """The conditions a table was measured under; a stored table is reused only for equal keys."""
  return {"machine": machine_fingerprint(), "target": target_fingerprint,
          "drafter": drafter_fingerprint, "max_len": int(max_len), "dtype": str(dtype),
          "scan_layers": bool(loop["scan_layers"]), "ar_fallback": int(loop["ar_fallback"]),
          "controller": str(loop["controller"]), "sizes": [int(b) for b in sizes],
          "new_tokens": int(new_tokens)}


def _median_iqr(values: Sequence[float]) -> tuple[float, float]:
  """(median, interquartile range / median) of positive per-run costs."""
  v = np.asarray(values, np.float64)
  med = float(np.median(v))
  q1, q3 = np.percentile(v, [25, 75])
  return med, float((q3 - q1) / med) if med > 0 else 0.0


def _wrong(continuation: Sequence[int], vocab_size: int) -> list[int]:
  """A continuation none of whose tokens is the target's greedy token at its position."""
  return [(int(t) + 1) % vocab_size for t in continuation]


def measure_cost_table(engine: Any, prompts: Sequence[Sequence[int]], sizes: Sequence[int], *,
                       new_tokens: int, reps: int, with_fallback: bool,
                       progress: Callable[[Any], Any] = lambda it: it) -> dict[str, Any]:
  """Measures the table (module docstring) on `engine`, whose loops verify with `exact` (forced
  drafts are the perfect drafter, not draws). Returns {"ar_step_s", "cycle_s", "fallback_step_s",
  "spread", "reps", "prompts", "new_tokens", "seconds"}; sizes as strings."""
  if reps < 1 or not prompts:
    raise BadInputError("--config.blockpilot.cost_reps must be >= 1 and cost_prompts >= 1")
  t0 = time.perf_counter()
  gen = lambda ids, b, forced=None: engine.generate(ids, max_new_tokens=new_tokens, block_size=b,
                                                    forced_continuation=forced)
  spec = [int(b) for b in sizes if int(b) > 1]
  conts = [gen(ids, 1).output_ids for ids in prompts]  # the target's own greedy continuations
  jobs = [("ar", 1, i) for i in range(len(prompts))]
  jobs += [("cycle", b, i) for b in spec for i in range(len(prompts))]
  if with_fallback:
    jobs += [("fallback", b, i) for b in spec for i in range(len(prompts))]
  forced = {"ar": [None] * len(prompts), "cycle": conts,
            "fallback": [_wrong(c, engine.cfg.vocab_size) for c in conts]}
  for kind, b, i in jobs:  # compile every variant before anything is timed
    gen(prompts[i], b, forced[kind][i])
  runs: dict[tuple[str, int, int], list[Any]] = {j: [] for j in jobs}
  for r in progress(range(reps)):
    shift = (r * 7) % len(jobs)
    for kind, b, i in jobs[shift:] + jobs[:shift]:
      runs[(kind, b, i)].append(gen(prompts[i], b, forced[kind][i]))
  per_ar = [g.decode_s / g.target_forwards for (k, _, _), gs in runs.items() if k == "ar"
            for g in gs if g.target_forwards]
  ar_step, ar_spread = _median_iqr(per_ar)
  out = {"ar_step_s": ar_step, "cycle_s": {}, "fallback_step_s": {},
         "spread": {"ar_step": ar_spread, "cycle": {}, "fallback_step": {}}}
  for b in spec:
    pure = all(not g.ar_steps for i in range(len(prompts)) for g in runs[("cycle", b, i)])
    # Sizes whose every cycle counts as poor (b - 1 <= ar_fallback_accept) take fallback steps
    # even with perfect drafts: their steps are charged at the AR step, cycles and steps cannot
    # be told apart there.
    step_guess = 0.0 if pure else ar_step
    per_cycle = [(g.decode_s - g.ar_steps * step_guess) / g.cycles for i in range(len(prompts))
                 for g in runs[("cycle", b, i)] if g.cycles]
    if not per_cycle:
      raise BadInputError(f"cost table: no cycle of size {b} was measured (the calibration "
                          f"prompts' continuations end at once); give longer prompts")
    out["cycle_s"][str(b)], out["spread"]["cycle"][str(b)] = _median_iqr(per_cycle)
    if with_fallback and not pure:
      out["fallback_step_s"][str(b)], out["spread"]["fallback_step"][str(b)] = ar_step, ar_spread
    elif with_fallback:
      per_step = [(g.decode_s - g.cycles * out["cycle_s"][str(b)]) / g.ar_steps
                  for i in range(len(prompts)) for g in runs[("fallback", b, i)] if g.ar_steps]
      if per_step:
        med, spread = _median_iqr(per_step)
        # A fallback step runs the target's one-token forward and feeds the drafter: at least
        # an AR step. Less is the difference's noise on a loaded machine (the suite's workers
        # once measured 0 s, and a priced policy refuses a price of 0).
        out["fallback_step_s"][str(b)] = max(med, ar_step)
        out["spread"]["fallback_step"][str(b)] = spread
  out.update(reps=int(reps), prompts=len(prompts), new_tokens=int(new_tokens),
             seconds=round(time.perf_counter() - t0, 1))
  return out


def check_table(table: Mapping[str, Any], sizes: Sequence[int], with_fallback: bool,
                where: str) -> dict[str, Any]:
  """Refuses a table that cannot price every size (naming the file and the missing key)."""
  try:
    if int(table.get("format", 0)) != FORMAT:
      raise BadInputError(f"{where}: format {table.get('format')!r}, expected {FORMAT}")
    ok = float(table["ar_step_s"]) > 0
    for b in sizes:
      if int(b) > 1:
        ok &= float(table["cycle_s"][str(b)]) > 0
        if with_fallback:
          ok &= float(table["fallback_step_s"][str(b)]) >= 0
  except KeyError as e:
    raise BadInputError(f"{where}: no cost for {e.args[0]!r} (a table measured for other sizes "
                        "or without AR fallback steps; remeasure with "
                        "--config.blockpilot.cost_table=remeasure)") from None
  except (TypeError, ValueError):
    raise BadInputError(f"{where}: costs must be positive numbers") from None
  if not ok:
    raise BadInputError(f"{where}: costs must be positive numbers")
  return dict(table)


def read_table(path: str) -> dict[str, Any] | None:
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise BadInputError(f"cost table {path}: not readable JSON ({e})") from None


def write_table(path: str, table: Mapping[str, Any]) -> None:
  """Writes atomically (a temporary file renamed over the old one)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(table, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def obtain_table(choice: str, stored_path: str, key: Mapping[str, Any],
                 measure: Callable[[], dict], sizes: Sequence[int],
                 with_fallback: bool) -> tuple[dict[str, Any], str]:
  """(the cost table, how it was obtained: "reused" | "measured" | "given").

  `choice` (`--config.blockpilot.cost_table`): "auto" reuses `stored_path` when its key equals
  `key`, else measures and stores; "remeasure" always measures and stores; any other value is
  the path of a table file used as it is (its key is not checked: pricing labels for another
  machine is what a given table is for)."""
  if choice not in ("auto", "remeasure"):
    table = read_table(choice)
    if table is None:
      raise BadInputError(f"--config.blockpilot.cost_table={choice!r}: no such file (give auto, "
                          "remeasure or the path of a cost_table.json)")
    return check_table(table, sizes, with_fallback, choice), "given"
  if choice == "auto":
    table = read_table(stored_path)
    if table is not None and table.get("key") == dict(key):
      return check_table(table, sizes, with_fallback, stored_path), "reused"
  table = {"format": FORMAT, "key": dict(key), **measure()}
  write_table(stored_path, table)
  return table, "measured"


def describe(table: Mapping[str, Any]) -> str:
  """One line: the AR step and each cycle in ms and in AR steps, with their spreads."""
  ar = float(table["ar_step_s"])
  cyc = ", ".join(f"b={b}: {1e3 * float(s):.3f} ms ({float(s) / ar:.2f} AR)"
                  for b, s in sorted(table["cycle_s"].items(), key=lambda kv: int(kv[0])))
  return (f"AR step {1e3 * ar:.3f} ms (IQR {100 * table['spread']['ar_step']:.0f}%); cycles "
          f"{cyc}; {table['reps']} reps x {table['prompts']} prompts")
