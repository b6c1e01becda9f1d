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
     request takes cycles_b cycles (following m -> m + acc_b[m] + 1 from m = 1 until m >= M);
     this reproduces the real decode's cycle count (checked: `agreement`).
  4. Per-cycle oracle: dynamic programming over m, choosing any size at every cycle:
     cost(m) = min_b [c_b + cost(m + acc_b[m] + 1)], cost(m >= M) = 0, with c_b = 1 (fewest target
     forwards, i.e. highest τ) or c_b = the measured seconds per cycle of size b (fastest).
     It knows every future acceptance, so it bounds what any per-cycle controller could do.

Reported per request: the best fixed size's cycles (the per-request oracle), the per-cycle
oracle's cycles, and how many of the per-cycle oracle's cycles use another size than the
request's best fixed size (ties resolved towards that size, so this counts necessary changes).
Gains are ratios of cycles (= ratios of τ, since the committed tokens are the same) or of
estimated seconds.
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


def fixed_cycles(acc_M: np.ndarray) -> int:
  """Cycles a fixed size needs to commit M tokens, from its replayed acceptances."""
  return fallback_schedule(acc_M)[0]


def fallback_schedule(acc_M: np.ndarray, ar_fallback: int = 0,
                      ar_fallback_accept: int = 1) -> tuple[int, int]:
  """(cycles, AR steps) the speculative loop runs to commit M tokens at a fixed size, with the
  engine's AR fallback (`decode_loops.make_spec_loop`: after a cycle accepting at most
  `ar_fallback_accept` drafts, min(2^k, ar_fallback) AR steps for the k-th poor cycle in a
  row; 0 = none)."""
  M, m, cycles, steps, misses = len(acc_M), 1, 0, 0, 0
  while m < M:
    a = int(acc_M[m])
    m += a + 1
    cycles += 1
    if ar_fallback and a <= ar_fallback_accept:
      misses += 1
      run = min(min(2 ** misses, ar_fallback), max(M - m, 0))
      m += run
      steps += run
    else:
      misses = 0
  return cycles, steps


def per_cycle_oracle(acc: dict[int, np.ndarray], costs: dict[int, float], prefer: int
                     ) -> tuple[float, list[int]]:
  """(least total cost, the sizes of its cycles) over schedules choosing a size every cycle.

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


def analyse_request(acc: dict[int, np.ndarray], seconds_per_cycle: dict[int, float]) -> dict:
  """The per-request numbers of the module docstring, for unit costs and for measured costs."""
  sizes = sorted(acc)
  cycles = {b: fixed_cycles(acc[b]) for b in sizes}
  out = {"tokens": int(len(acc[sizes[0]])), "fixed_cycles": {str(b): cycles[b] for b in sizes}}
  for name, costs in (("cycles", {b: 1.0 for b in sizes}), ("seconds", seconds_per_cycle)):
    fixed_cost = {b: cycles[b] * costs[b] for b in sizes}
    best_b = min(sizes, key=lambda b: (fixed_cost[b], b))
    total, schedule = per_cycle_oracle(acc, costs, best_b)
    out[name] = {"best_fixed_size": best_b, "best_fixed": fixed_cost[best_b],
                 "per_cycle": total, "per_cycle_cycles": len(schedule),
                 "switched_cycles": sum(s != best_b for s in schedule),
                 "distinct_sizes": len(set(schedule))}
  return out


def summarize(analyses: Sequence[dict], seconds_per_cycle: dict[int, float]) -> dict:
  """Totals over requests, per objective (cycles / seconds): the best single size for all
  requests (chosen on these requests), the per-request oracle (best fixed size per request),
  the per-cycle oracle, and the gains between them (ratios of totals, minus 1)."""
  sizes = sorted(int(b) for b in analyses[0]["fixed_cycles"]) if analyses else []
  out: dict[str, Any] = {"requests": len(analyses)}
  for name, costs in (("cycles", {b: 1.0 for b in sizes}), ("seconds", seconds_per_cycle)):
    static = {b: sum(a["fixed_cycles"][str(b)] * costs[b] for a in analyses) for b in sizes}
    b_static = min(sizes, key=lambda b: (static[b], b)) if sizes else 0
    per_req = sum(a[name]["best_fixed"] for a in analyses)
    per_cyc = sum(a[name]["per_cycle"] for a in analyses)
    cycles = sum(a[name]["per_cycle_cycles"] for a in analyses)
    gain = lambda a, b: round(a / max(b, 1e-12) - 1.0, 6) + 0.0  # no -0.0 from rounding
    out[name] = {
        "global_static_size": b_static, "global_static": static.get(b_static, 0.0),
        "per_request_oracle": per_req, "per_cycle_oracle": per_cyc,
        "gain_per_request_over_static": gain(static.get(b_static, 0.0), per_req),
        "gain_per_cycle_over_per_request": gain(per_req, per_cyc),
        "gain_per_cycle_over_static": gain(static.get(b_static, 0.0), per_cyc),
        "switched_cycle_fraction": sum(a[name]["switched_cycles"] for a in analyses)
                                   / max(cycles, 1),
        "requests_switching": int(sum(a[name]["switched_cycles"] > 0 for a in analyses))}
  return out
