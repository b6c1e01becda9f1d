"""Continuous batching per block-size bucket: many requests through the batched loops.

Each block size in use (a bucket) has a batched loop state of `batch_size` slots
(`state.LoopState`), decoded by its compiled batched loop. The host:

1. prefills requests in arrival order, each into one-sequence staging caches (the prefill runs
   the block-size policy when the request's size is learned, so its bucket is known only then);
   a request whose bucket is known waits until that bucket has a free slot, and at most
   `batch_size` prefilled requests wait for a slot at any time (their staging caches are the
   memory this holds beyond the slots);
2. moves prefilled requests into free slots of their bucket (`loops.make_insert`: a slot-sized
   copy into the donated state), oldest first;
3. runs the bucket with the most requests in flight (ties: the smallest block size) for
   `sync_cycles` cycles (0: until none of its rows decodes: static batching) in one call,
   attending over the smallest window of cache slots (`programs.window_buckets`) with room for
   its furthest row (the call returns early when a row would pass it);
4. reads back which rows finished (stop token or max_new_tokens), turns each into its
   `Generation` and frees its slot; then goes back to 1.

So a long request never holds a batch hostage: the others' slots are refilled around it after at
most `sync_cycles` cycles. Every row decodes at its own position with its own seed key, so its
tokens are those it gets decoded alone.

Time attribution (a request's `decode_s`): the wall time of each loop call is split equally
among the rows that were decoding when the call started; `prefill_s` is the request's own
prefill plus its insertion into a slot.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from bp_jax.decoding.generation import Generation, generation_of
from bp_jax.decoding.state import LoopState


@dataclasses.dataclass
class BatchRequest:
  """One request of `Engine.generate_batch`; `block_size` is a bucket or `engine.LEARNED`."""
  index: int
  prompt_ids: Sequence[int]
  max_new_tokens: int
  seed: int
  block_size: int | str
  forced_continuation: Sequence[int] | None = None


@dataclasses.dataclass
class _Staged:
  """A prefilled request (its staging caches hold the prompt) waiting for a slot."""
  req: BatchRequest
  pre: Any                 # loops.PrefillOut
  block_size: int
  prefill_s: float
  probs: list[float] | None
  decode_s: float = 0.0


class _Bucket:
  """The slots of one block size: its batched loop state and which request each row holds."""

  def __init__(self, carry: LoopState, batch: int):
    self.carry = carry
    self.rows: list[_Staged | None] = [None] * batch

  def free_rows(self) -> list[int]:
    return [i for i, r in enumerate(self.rows) if r is None]

  def live(self) -> int:
    return sum(r is not None for r in self.rows)


class Scheduler:
  """Runs a list of `BatchRequest`s through an engine's batched loops (see the module doc)."""

  def __init__(self, engine, requests: Sequence[BatchRequest], sampling, forced: bool):
    self.engine, self.sp = engine, sampling
    self.forced = forced
    self.queue = collections.deque(requests)
    self.ready: dict[int, collections.deque[_Staged]] = collections.defaultdict(
        collections.deque)
    self.buckets: dict[int, _Bucket] = {}
    self.results: dict[int, Generation] = {}
    self.pool: list[tuple] = []  # free staging cache pairs

  # -- the steps ----------------------------------------------------------------------------
  def _bucket(self, block_size: int) -> _Bucket:
    if block_size not in self.buckets:
      self.buckets[block_size] = _Bucket(self.engine.slot_carry(block_size, self.forced),
                                         self.engine.batch_size)
    return self.buckets[block_size]

  def _waiting(self) -> int:
    return sum(len(q) for q in self.ready.values())

  def _may_prefill(self, req: BatchRequest) -> bool:
    if isinstance(req.block_size, str):  # learned: the bucket is known after the prefill
      return self._waiting() < self.engine.batch_size
    return len(self._bucket(req.block_size).free_rows()) > len(self.ready[req.block_size])

  def _prefill_some(self) -> None:
    while self.queue and self._may_prefill(self.queue[0]):
      req = self.queue.popleft()
      buffers = self.pool.pop() if self.pool else self.engine.staging_buffers()
      staged = _Staged(req, *self.engine.stage(req, self.sp, buffers))
      self.engine.check_prefill(staged.pre, len(req.prompt_ids))
      self.ready[staged.block_size].append(staged)

  def _insert_ready(self) -> None:
    for b, waiting in self.ready.items():
      bucket = self._bucket(b)
      for row in bucket.free_rows():
        if not waiting:
          break
        staged = waiting.popleft()
        fn, args = self.engine.insert_program(bucket.carry, row, staged.req, staged.pre)
        t0 = time.perf_counter()
        bucket.carry = fn(*args)
        jax.block_until_ready(bucket.carry.pos_B)
        staged.prefill_s += time.perf_counter() - t0
        bucket.rows[row] = staged
        self.pool.append((staged.pre.cache, staged.pre.draft_cache))
        staged.pre = staged.pre._replace(cache=None, draft_cache=None)

  def _run_one(self) -> None:
    b, bucket = max(((b, k) for b, k in self.buckets.items() if k.live()),
                    key=lambda bk: (bk[1].live(), -bk[0]))
    c = bucket.carry
    n_gen, done, max_new, pos = jax.device_get((c.n_gen_B, c.done_B, c.max_new_B, c.pos_B))
    decoding = [i for i, r in enumerate(bucket.rows)
                if r is not None and not done[i] and n_gen[i] < max_new[i]]
    if decoding:
      fn, args = self.engine.slots_program(b, bucket.carry, self.sp, self.forced,
                                           max_pos=int(max(pos[i] for i in decoding)))
      t0 = time.perf_counter()
      bucket.carry = fn(*args)
      jax.block_until_ready(bucket.carry.pos_B)
      share = (time.perf_counter() - t0) / len(decoding)
      for i in decoding:
        bucket.rows[i].decode_s += share
    self._collect(bucket)

  def _collect(self, bucket: _Bucket) -> None:
    c = bucket.carry
    n_gen, done, max_new = jax.device_get((c.n_gen_B, c.done_B, c.max_new_B))
    for i, staged in enumerate(bucket.rows):
      if staged is None or not (done[i] or n_gen[i] >= max_new[i]):
        continue
      r = c.records
      seq, accept, is_cycle, verified, forwards, bad = jax.device_get(
          (c.seq_BS[i], r.accept_BS[i], r.is_cycle_BS[i], r.verified_BS[i], r.forwards_B[i],
           c.bad_B[i]))
      self.results[staged.req.index] = self._generation(staged, seq, accept, is_cycle, verified,
                                                        int(forwards), int(n_gen[i]), bool(bad))
      bucket.rows[i] = None

  def _generation(self, staged: _Staged, seq, accept, is_cycle, verified, forwards: int,
                  n_gen: int, bad: bool) -> Generation:
    n, req = len(staged.req.prompt_ids), staged.req
    if bad:
      self.engine.raise_nonfinite(n + n_gen, "a decode step")
    return generation_of(seq, accept, is_cycle, verified, forwards, n, n_gen,
                         self.engine.stop_ids, req.max_new_tokens, staged.block_size,
                         staged.prefill_s, staged.decode_s, staged.probs)

  def run(self) -> list[Generation]:
    total = len(self.queue)
    while len(self.results) < total:
      self._prefill_some()
      self._insert_ready()
      if any(k.live() for k in self.buckets.values()):
        self._run_one()
      elif not self.queue and not self._waiting():
        raise RuntimeError("scheduler: requests left but none queued, waiting or in flight")
    return [self.results[i] for i in sorted(self.results)]


def empty_buffers_like(cache, draft_cache) -> tuple:
  """Fresh zero staging buffers of the same shapes (another prefilled request waiting)."""
  zeros = lambda t: None if t is None else jax.tree.map(jnp.zeros_like, t)
  return zeros(cache), zeros(draft_cache)
