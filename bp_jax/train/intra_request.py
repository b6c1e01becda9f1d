"""Intra-request variation of the best block size: what a per-cycle choice could gain over the
one per-request choice BlockPilot makes (the referee's question), by teacher-forced replay.

What is computed, for one request at temperature 0 (greedy):
  1. The request's greedy output y (M tokens, trimmed at the stop token / max_new_tokens) is the
     output of every block size (decoding is lossless).
  2. Replay: for every m = 1..M-1 (a cycle that starts with m tokens committed; its bonus token
     y[m-1] sits at position p = n + m - 1) and every candidate size b, the drafter drafts b-1
     tokens from exactly the context a real cycle would see there (target features of positions
     < p, from one causal target forward over prompt + y) and `acc_b[m]` = the number of leading
     drafts equal to y[m], y[m+1], ... (the greedy target's tokens, i.e. the accepted count a).
     This is the drafter's training forward with an anchor at every position
     (`draft_objective.drafter_train_forward`), one pass per size.
  3. A cycle of size b started at m commits acc_b[m] + 1 tokens. With a fixed size b the
     request runs the loop that decoded it (`forward_schedule`: from m = 1 until m >= M, cycles
     m -> m + acc_b[m] + 1 and, with the engine's AR fallback, the AR steps after poor
     cycles); this reproduces the real decode's every target forward, cycle or AR step, and its
     committed tokens (checked: `agreement`).
  4. Per-cycle oracle: dynamic programming over m, choosing any size at every forward (and,
     when the loop has the AR fallback, an AR step: size 1, which commits one token):
     cost(m) = min_b [c_b + cost(m + acc_b[m] + 1)], cost(m >= M) = 0, with c_b = 1 (fewest target
     forwards, i.e. most committed tokens per target forward) or c_b = the measured seconds per
     cycle of size b and per AR step (fastest). It knows every future acceptance, so it bounds
     what any per-cycle controller could do.

Reported per request and objective: the best fixed size's cost (the per-request oracle: its
target forwards, cycles and AR fallback steps together, or its seconds), the per-cycle oracle's,
and how many of the per-cycle oracle's forwards use another size than the request's best fixed
size (ties resolved towards that size, so this counts necessary changes; with the fallback its
AR steps are not changes: the fixed loop takes them too). Gains are ratios of target forwards
(= ratios of tokens per target forward, since the committed tokens are the same; = ratios of τ
only without the fallback) or of estimated seconds.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.decoding.buckets import pick_bucket
from bp_jax.train import draft_objective as obj


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _replay_jit(t_graph, d_graph, block_size: int, num_anchors: int, t_state, d_state,
                tokens_1T: jax.Array, length: jax.Array, first_anchor: jax.Array) -> jax.Array:
  """[A] accepted drafts a (0..b-1) at anchors first_anchor + 0..A-1 (garbage past the end)."""
  target, drafter = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
  b, T = block_size, tokens_1T.shape[1]
  hiddens_n1TD = obj.target_features(target, tokens_1T, drafter.cfg.target_layer_ids)
  anchors_1A = (first_anchor + jnp.arange(num_anchors, dtype=jnp.int32))[None]
  valid_1A = anchors_1A < length
  anchors_1A = jnp.where(valid_1A, anchors_1A, 0)
  block_tokens, block_pos, _ = obj.build_blocks(tokens_1T, anchors_1A, b,
                                                drafter.cfg.mask_token_id)
  labels = jnp.take_along_axis(tokens_1T, jnp.minimum(block_pos, T - 1).reshape(1, -1), axis=1)
  labels = jnp.where(block_pos.reshape(1, -1) < length, labels, -1).reshape(block_pos.shape)
  emb = target.embed_tokens(block_tokens)
  hidden = obj.drafter_train_forward(drafter, hiddens_n1TD, emb, anchors_1A, valid_1A)
  drafts = jnp.argmax(obj.block_logits(target, hidden), axis=-1)
  return obj.acceptance_lengths(drafts, labels[:, :, 1:])[0] - 1


def replay_acceptance(target: Any, drafter: Any, prompt_ids: Sequence[int],
                      output_ids: Sequence[int], sizes: Sequence[int], max_new_tokens: int,
                      length_buckets: Sequence[int]) -> dict[int, np.ndarray]:
  """{b: acc_b [M]} where acc_b[m] (m >= 1) is the number of drafts a cycle of size b starting
  with m tokens committed would have accepted (module docstring, step 2); acc_b[0] is unused."""
  n, M = len(prompt_ids), len(output_ids)
  if M < 2:
    return {int(b): np.zeros(max(M, 1), np.int64) for b in sizes}
  T = pick_bucket(n + M, length_buckets, "prompt + output length")
  tokens = np.zeros((1, T), np.int32)
  tokens[0, :n + M] = list(prompt_ids) + list(output_ids)
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  A = max(1, max_new_tokens - 1)
  out = {}
  for b in sizes:
    if int(b) == 1:  # plain AR decoding: no drafts, one token per target forward
      out[1] = np.zeros(M, np.int64)
      continue
    acc = np.asarray(_replay_jit(t_graph, d_graph, int(b), A, t_state, d_state,
                                 jnp.asarray(tokens), jnp.int32(n + M), jnp.int32(n)))
    full = np.zeros(M, np.int64)
    full[1:] = acc[:M - 1]  # anchor n + m - 1 for m = 1..M-1
    out[int(b)] = full
  return out


def forward_schedule(acc_M: np.ndarray, ar_fallback: int = 0,
                     ar_fallback_accept: int = 1) -> list[tuple[int, bool]]:
  """(committed tokens kept, is a speculative cycle) per target forward of the loop that commits
  the M tokens at a fixed size, as `Generation.forward_lengths` / `forward_is_cycle` record it:
  cycles from the replayed acceptances and, with the engine's AR fallback (`ar_fallback` > 0),
  min(2^k, ar_fallback) AR steps after the k-th cycle in a row accepting at most
  `ar_fallback_accept` drafts. The last forward keeps only the tokens up to M."""
  M, m, out, misses = len(acc_M), 1, [], 0
  while m < M:
    a = int(acc_M[m])
    out.append((min(a + 1, M - m), True))
    m += a + 1
    if ar_fallback and a <= ar_fallback_accept:
      misses += 1
      steps = min(2 ** misses, ar_fallback, max(M - m, 0))
      out += [(1, False)] * steps
      m += steps
    else:
      misses = 0
  return out


def fallback_schedule(acc_M: np.ndarray, ar_fallback: int = 0,
                      ar_fallback_accept: int = 1) -> tuple[int, int]:
  """(speculative cycles, AR steps) of `forward_schedule`."""
  forwards = forward_schedule(acc_M, ar_fallback, ar_fallback_accept)
  cycles = sum(is_cycle for _, is_cycle in forwards)
  return cycles, len(forwards) - cycles


def fixed_cycles(acc_M: np.ndarray) -> int:
  """Cycles a fixed size needs to commit M tokens without the AR fallback."""
  return fallback_schedule(acc_M)[0]


def per_cycle_oracle(acc: dict[int, np.ndarray], costs: dict[int, float], prefer: int
                     ) -> tuple[float, list[int]]:
  """(least total cost, the sizes of its forwards) over schedules choosing a size every forward.

  Ties prefer `prefer` (the request's best fixed size), then the smaller size."""
  sizes = sorted(acc)
  order = [prefer] + [b for b in sizes if b != prefer]
  M = len(acc[sizes[0]])
  best = np.zeros(M + max(sizes) + 1)
  pick = np.zeros(M, np.int64)
  for m in range(M - 1, 0, -1):
    vals = [costs[b] + best[min(m + int(acc[b][m]) + 1, M)] for b in order]
    k = int(np.argmin(vals))  # first minimum: `prefer` wins ties
    best[m], pick[m] = vals[k], order[k]
  schedule, m = [], 1
  while m < M:
    schedule.append(int(pick[m]))
    m += int(acc[int(pick[m])][m]) + 1
  return float(best[1]) if M > 1 else 0.0, schedule


def objectives(sizes: Sequence[int], seconds_per_cycle: dict[int, float],
               ar_step_s: float | None) -> dict[str, dict[int, float]]:
  """{objective: {size: cost of one of its forwards}}; size 1 is an AR step (`ar_step_s` unless
  size 1 is a candidate with its own measured cost)."""
  steps = {} if ar_step_s is None else {1: float(ar_step_s)}
  return {"forwards": {b: 1.0 for b in (1, *sizes)},
          "seconds": {**steps, **{b: float(seconds_per_cycle[b]) for b in sizes}}}


def analyse_request(acc: dict[int, np.ndarray], seconds_per_cycle: dict[int, float],
                    ar_step_s: float | None = None, ar_fallback: int = 0,
                    ar_fallback_accept: int = 1) -> dict:
  """The per-request numbers of the module docstring, for unit costs per target forward and for
  measured costs, with the loop that ran (`ar_fallback`, `ar_fallback_accept`: the engine's;
  with the fallback, `ar_step_s` prices its AR steps unless size 1 is a candidate)."""
  sizes = sorted(acc)
  schedules = {b: fallback_schedule(acc[b], ar_fallback if b > 1 else 0, ar_fallback_accept)
               for b in sizes}
  options = dict(acc)
  if ar_fallback and 1 not in options:  # the loop's AR step is a choice of a per-cycle controller
    options[1] = np.zeros(len(acc[sizes[0]]), np.int64)
  out = {"tokens": int(len(acc[sizes[0]])),
         "fixed_cycles": {str(b): schedules[b][0] for b in sizes},
         "fixed_ar_steps": {str(b): schedules[b][1] for b in sizes}}
  for name, costs in objectives(sizes, seconds_per_cycle, ar_step_s).items():
    if any(b not in costs for b in options):
      raise ValueError("the AR fallback's steps need a cost: pass ar_step_s")
    fixed = {b: cyc * costs[b] + steps * costs.get(1, 0.0) for b, (cyc, steps) in schedules.items()}
    best_b = min(sizes, key=lambda b: (fixed[b], b))
    total, schedule = per_cycle_oracle(options, costs, best_b)
    switched = [b for b in schedule if b != best_b and not (ar_fallback and b == 1)]
    out[name] = {"best_fixed_size": best_b, "best_fixed": fixed[best_b],
                 "fixed": {str(b): c for b, c in fixed.items()},
                 "per_cycle": total, "per_cycle_forwards": len(schedule),
                 "switched_forwards": len(switched), "distinct_sizes": len(set(schedule))}
  return out


def summarize(analyses: Sequence[dict]) -> dict:
  """Totals over requests, per objective (target forwards / seconds): the best single size for
  all requests (chosen on these requests), the per-request oracle (best fixed size per request),
  the per-cycle oracle, and the gains between them (ratios of totals, minus 1)."""
  names = [n for n in ("forwards", "seconds") if analyses and n in analyses[0]]
  out: dict[str, Any] = {"requests": len(analyses)}
  gain = lambda a, b: round(a / max(b, 1e-12) - 1.0, 6) + 0.0  # no -0.0 from rounding
  for name in names:
    sizes = sorted(int(b) for b in analyses[0][name]["fixed"])
    static = {b: sum(a[name]["fixed"][str(b)] for a in analyses) for b in sizes}
    b_static = min(sizes, key=lambda b: (static[b], b))
    per_req = sum(a[name]["best_fixed"] for a in analyses)
    per_cyc = sum(a[name]["per_cycle"] for a in analyses)
    forwards = sum(a[name]["per_cycle_forwards"] for a in analyses)
    out[name] = {
        "global_static_size": b_static, "global_static": static[b_static],
        "per_request_oracle": per_req, "per_cycle_oracle": per_cyc,
        "gain_per_request_over_static": gain(static[b_static], per_req),
        "gain_per_cycle_over_per_request": gain(per_req, per_cyc),
        "gain_per_cycle_over_static": gain(static[b_static], per_cyc),
        "switched_fraction": sum(a[name]["switched_forwards"] for a in analyses)
                             / max(forwards, 1),
        "requests_switching": int(sum(a[name]["switched_forwards"] > 0 for a in analyses))}
  return out
