"""One request's result, and the host-side trimming of a loop's output.

Figures, one meaning each:
  τ (`tau`)             committed tokens per speculative cycle (draft + verify), the paper's
                        figure; AR steps taken by the fallback are not cycles. A plain AR
                        request (block size 1) is cycles of block size 1 that draft nothing:
                        each commits one token, τ = 1.
  `tokens_per_forward`  committed tokens per target forward in the loop, cycles and AR steps
                        together (the prefill's forward and its first token are not counted).
  `forward_verified`    per target forward, k + 1 when it verified k drafts after a drafter
                        pass, 0 when no drafter pass preceded it (plain AR loop, AR steps);
                        `forward_cost_units` prices a request's loop from it.
Both count only tokens that are kept: the last forward's tokens past the first stop token or
past `max_new_tokens` are not counted (`clip_forward_lengths`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from bp_jax.decoding.controller import verify_cost


def trim_at_stop(ids: Sequence[int], stop_ids: Sequence[int], max_new: int) -> list[int]:
  """First `max_new` ids, cut just after the first stop token."""
  out = []
  for t in list(ids)[:max_new]:
    out.append(int(t))
    if t in stop_ids:
      break
  return out


def clip_forward_lengths(lengths: Sequence[int], kept: int) -> list[int]:
  """Committed tokens per forward, cut so that they sum to `kept` (the new tokens kept after the
  prefill's first one): the last forward may have committed tokens past the stop token or past
  max_new_tokens; forwards that kept nothing are dropped."""
  out, left = [], int(kept)
  for a in lengths:
    if left <= 0:
      break
    out.append(min(int(a), left))
    left -= out[-1]
  return out


@dataclasses.dataclass
class Generation:
  """One request's result."""
  output_ids: list[int]            # new tokens only, trimmed after the first stop token
  prefill_s: float
  decode_s: float
  block_size: int
  forward_lengths: list[int]       # committed tokens per target forward in the loop, in order
  forward_is_cycle: list[bool]     # per forward: a cycle (False: an AR step of the fallback)
  forward_verified: list[int]      # per forward: k + 1 after a drafter pass verifying k, else 0
  prompt_len: int
  # The policy's decision scores (block_size=LEARNED): class probabilities for a classify head,
  # shrunk expected value ratios for a value head (`BlockPolicy.decide`).
  policy_probs: list[float] | None = None
  features: dict[str, np.ndarray] | None = None  # prefill features [F] (return_features=True)
  # Decoded in the plain AR loop because the priced back-off would start it deep (its forwards
  # are AR steps, `Engine.starts_plain`); `block_size` stays the bucket it was given.
  plain_start: bool = False
  # The size a learned request's policy picked, where its batch decoded it at the joint size
  # (`BatchOptions.join_learned`) or not (then `block_size`); None for a fixed size.
  policy_block_size: int | None = None
  # Moved to the plain AR bucket mid-decode where its drafting lost (`Scheduler._move_losing`:
  # cycles that kept missing, `BatchOptions.move_plain_after`; an explorer run's own τ; a tail
  # whose slowest row ends sooner plain): its forwards there are AR steps.
  moved_plain: bool = False

  @property
  def new_tokens(self) -> int:
    return len(self.output_ids)

  @property
  def acceptance_lengths(self) -> list[int]:
    """Committed tokens per speculative cycle (τ's terms)."""
    return [a for a, c in zip(self.forward_lengths, self.forward_is_cycle) if c]

  @property
  def target_forwards(self) -> int:
    return len(self.forward_lengths)

  @property
  def cycles(self) -> int:
    return int(sum(self.forward_is_cycle))

  @property
  def ar_steps(self) -> int:
    return self.target_forwards - self.cycles

  @property
  def tau(self) -> float | None:
    """Mean committed tokens per speculative cycle (1.0 for plain AR); None when the request
    ran no cycle (its first token was a stop token, or max_new_tokens=1)."""
    a = self.acceptance_lengths
    return float(np.mean(a)) if a else None

  @property
  def tokens_per_forward(self) -> float | None:
    f = self.forward_lengths
    return float(np.mean(f)) if f else None

  @property
  def drafter_passes(self) -> int:
    """Drafter passes in the loop: one per forward that verified drafts (k + 1 > 0)."""
    return sum(v > 0 for v in self.forward_verified)

  @property
  def verified_drafts(self) -> list[int]:
    """Drafts verified (k) per forward that followed a drafter pass, in order."""
    return [v - 1 for v in self.forward_verified if v > 0]

  @property
  def mean_verified_drafts(self) -> float | None:
    """Mean k over the forwards that followed a drafter pass; None without one."""
    k = self.verified_drafts
    return float(np.mean(k)) if k else None


def verify_label(verified: int) -> str:
  """What a forward verified, from its `Generation.forward_verified` value: "ar" (0: an AR
  step, no drafter pass) or "k=n" (n drafts after a drafter pass)."""
  return "ar" if verified == 0 else f"k={verified - 1}"


def forward_cost_units(verified: Sequence[int], costs: Sequence[float],
                       draft_cost: float) -> float:
  """A loop's estimated cost in AR steps (`controller.verify_cost` units) from its per-forward
  `forward_verified` record: each forward over max(v, 1) tokens, plus `draft_cost` per forward
  that followed a drafter pass (v > 0). E.g. a plain AR request costs one unit per forward."""
  return float(sum(verify_cost(max(int(v), 1), costs) + (draft_cost if v > 0 else 0.0)
                   for v in verified))


def cycle_flags(is_cycle_S, verified_S, block_size: int) -> list[bool]:
  """Per forward of a loop row's records: a speculative cycle. A request of a block size > 1
  counts as cycles only the forwards that followed a drafter pass (verified > 0): those the AR
  loop ran for it (a plain start, or after a move to the plain bucket) are AR steps, not the
  τ = 1 cycles of a plain request (block size 1)."""
  return [bool(c) and (block_size == 1 or int(v) > 0) for c, v in zip(is_cycle_S, verified_S)]


def generation_of(seq_S, accept_S, is_cycle_S, verified_S, forwards: int, n: int, n_gen: int,
                  stop_ids: Sequence[int], max_new: int, block_size: int, prefill_s: float,
                  decode_s: float, policy_probs: list[float] | None = None,
                  features: dict[str, np.ndarray] | None = None,
                  plain_start: bool = False,
                  policy_block_size: int | None = None,
                  moved_plain: bool = False) -> Generation:
  """A request's `Generation` from its loop row: tokens at absolute positions `seq_S` (prompt of
  n, then n_gen generated), committed tokens, cycle flags and verified tokens per forward (first
  `forwards`), trimmed at the stop token and max_new_tokens. `plain_start`: the AR loop ran
  it in place of a deep start (`Engine.starts_plain`); `moved_plain`: it moved to the AR loop
  mid-decode (`BatchOptions.move_plain_after`): the AR loop's forwards are AR steps
  (`cycle_flags`). `policy_block_size`: a learned request's pick
  (`Generation.policy_block_size`)."""
  ids = trim_at_stop(np.asarray(seq_S)[n:n + n_gen], stop_ids, max_new)
  # Sliced on the host: a device array sliced to each new length would compile a slice.
  lengths = clip_forward_lengths(np.asarray(accept_S)[:forwards].tolist(), len(ids) - 1)
  verified = [int(v) for v in np.asarray(verified_S)[:len(lengths)]]
  is_cycle = cycle_flags(np.asarray(is_cycle_S)[:len(lengths)], verified, block_size)
  return Generation(ids, prefill_s, decode_s, block_size, lengths, is_cycle, verified, n,
                    policy_probs, features, plain_start, policy_block_size, moved_plain)
