"""Replays for the benchmarks that study the drafter's probabilities against its acceptance
(`controller_calibration`, `decline_replay`): the drafter's drafts at every position of the
target's own greedy output (teacher-forced: what a cycle starting there would draft and
accept), and the priced back-off simulated over them at given costs, with and without the
decline (`bp_jax.decoding.decline`) and its gate (`bp_jax.decoding.evidence`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.decoding import controller as control
from bp_jax.decoding import decline
from bp_jax.decoding import evidence
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import ShapeOptions


def teacher_forced(target, drafter, prompts, block_size: int, max_len: int, max_new_tokens: int,
                   stop_ids=()) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per prompt, (p_Tk, hit_Tk) [T, b-1] over the T positions t of its greedy AR output with b-1
  known target tokens after them: the drafter's probability of each of its b-1 greedy drafts
  after seq[t] (from the target features of positions < t, as a cycle starting at t drafts)
  and whether each equals the target's own token there."""
  eng = Engine(target, stop_ids=stop_ids, shapes=ShapeOptions(max_len=max_len))
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  b, mask_id = block_size, drafter.cfg.mask_token_id

  @jax.jit
  def context(t_state, d_state, tokens_1S):
    """The drafter's context cache over every position of the sequence."""
    model, dr = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    zero = jnp.zeros((1,), jnp.int32)
    out = model(tokens_1S, target.init_cache(1, max_len).with_lengths(zero),
                dr.cfg.target_layer_ids)
    return dr.add_context(out.layer_hiddens, dr.init_cache(1, max_len).with_lengths(zero))

  @jax.jit
  def draft_at(t_state, d_state, draft_cache, tok, t):
    """(b-1 greedy drafts, their probabilities) of a cycle starting at position t."""
    model, dr = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    block_1b = jnp.full((1, b), mask_id, jnp.int32).at[0, 0].set(tok)
    h = dr.draft(model.embed_tokens(block_1b), draft_cache.with_lengths(t[None]))
    logits_1kV = model.project_to_vocab(h[:, 1:])
    drafts_1k = jnp.argmax(logits_1kV, -1).astype(jnp.int32)
    return drafts_1k[0], control.drafted_probs(logits_1kV, drafts_1k)[0]

  out = []
  for i, (key, ids) in enumerate(prompts):
    gen = eng.generate(ids, max_new_tokens=max_new_tokens, block_size=1).output_ids
    seq = ids + gen
    n = len(ids)
    tokens = jnp.zeros((1, max_len), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    dcache = context(t_state, d_state, tokens)
    p_rows, hit_rows = [], []
    for t in range(n, len(seq) - b + 1):  # positions with b-1 known target tokens after them
      drafts, p = jax.device_get(draft_at(t_state, d_state, dcache, jnp.int32(seq[t]),
                                          jnp.int32(t)))
      p_rows.append(p)
      hit_rows.append(drafts == np.asarray(seq[t + 1:t + b]))
    k = b - 1
    out.append((np.asarray(p_rows, np.float32).reshape(-1, k),
                np.asarray(hit_rows, bool).reshape(-1, k)))
    print(f"  {i + 1}/{len(prompts)} {key}: {len(gen)} tokens", flush=True)
  return out


def accepted_and_expected(p_Tk: np.ndarray, hit_Tk: np.ndarray, rates=None
                          ) -> tuple[np.ndarray, np.ndarray]:
  """([T] drafts a cycle at each position accepts, [T] the drafts its probabilities expect,
  `decline.expected_accepted`, with `rates` interpolated as `controller.calibrated` does)."""
  if rates is not None:
    centres = (np.arange(len(rates)) + 0.5) / len(rates)
    p_Tk = np.interp(p_Tk, centres, rates)
  accepted = np.cumprod(hit_Tk, axis=1).sum(axis=1)
  return accepted, np.cumprod(p_Tk, axis=1).sum(axis=1)


# The gate's rules as the loop runs them, on one row (jitted: called once per simulated cycle).
_gate_observed = jax.jit(evidence.observed, static_argnums=(1, 2))
_gate_backs_off = jax.jit(evidence.backs_off, static_argnums=2)


def iid(prompts: list[tuple[np.ndarray, np.ndarray]], seed: int = 0
        ) -> list[tuple[np.ndarray, np.ndarray]]:
  """The same prompts with each position's accepted drafts drawn independently from all
  prompts' (the same acceptance profile, no runs of hard or easy positions)."""
  rng = np.random.default_rng(seed)
  pooled = np.concatenate([a for a, _ in prompts])
  return [(rng.choice(pooled, len(a)), e) for a, e in prompts]


def simulate(prompts: list[tuple[np.ndarray, np.ndarray]], draft_cost: float,
             verify_cost: float, cap: int, declines: bool, gate: bool = False,
             every_cycle: bool = False, pays_multiple: float = evidence.PAYS_MULTIPLE) -> dict:
  """The priced back-off over every prompt's positions (module doc): committed tokens, cost in
  AR steps, verified and declined cycles, AR steps. `gate`: a miss backs off only as the
  engine's gate lets it (`evidence.backs_off` at the cycle's price and `pays_multiple`; its
  evidence carried across the prompts as the engine carries it); `every_cycle`: no cycle is a
  miss (the paper's loop)."""
  decline_3 = np.zeros(3)
  seen = jnp.asarray(evidence.empty_state())
  block = 2  # the gate reads full cycles only: any k = block - 1 > 0 marks one
  price = draft_cost + verify_cost
  # Whether a miss takes its AR steps now.
  backs_off = lambda: not gate or bool(_gate_backs_off(seen, price, pays_multiple))
  tokens = cost = 0.0
  verified = declined = ar_steps = 0
  for accepted_T, expected_T in prompts:
    end, m, misses, wait = len(accepted_T), 0, 0, 0
    while m < end:
      if wait:
        steps = min(wait, end - m)
        cost, m, wait, ar_steps = cost + steps, m + steps, 0, ar_steps + steps
        continue
      a, e = int(accepted_T[m]), float(expected_T[m])
      scale = decline_3[2] / max(decline_3[1], 1e-6)
      if (declines and decline_3[0] >= decline.EVIDENCE_ROWS
          and misses <= decline.MAX_DECLINE_LEVEL and 1 + scale * e < verify_cost):
        cost, m, declined = cost + draft_cost + 1, m + 1, declined + 1
        misses += 1
        wait = min(2 ** misses, cap) if backs_off() else 0
        continue
      cost, m, verified = cost + draft_cost + verify_cost, m + a + 1, verified + 1
      decline_3 = decline.EVIDENCE_FORGET * decline_3 + np.asarray([1.0, e, a])
      if gate:
        seen = _gate_observed(seen, block - 1, block, jnp.asarray([a]), jnp.bool_(misses > 0))
      miss = a + 1 < draft_cost + verify_cost and not every_cycle
      misses = misses + 1 if miss else 0
      wait = min(2 ** misses, cap) if miss and backs_off() else 0
    tokens += end
  return {"tokens_per_ar_step": tokens / cost, "verified": verified, "declined": declined,
          "ar_steps": ar_steps}


def oracle(prompts, draft_cost: float, verify_cost: float) -> float:
  """Tokens per AR step of cost when each position takes a cycle exactly where it commits more
  tokens than it costs, an AR step elsewhere."""
  tokens = cost = 0.0
  for accepted_T, _ in prompts:
    m = 0
    while m < len(accepted_T):
      a = int(accepted_T[m])
      if a + 1 > draft_cost + verify_cost:
        cost, m = cost + draft_cost + verify_cost, m + a + 1
      else:
        cost, m = cost + 1, m + 1
    tokens += len(accepted_T)
  return tokens / cost
