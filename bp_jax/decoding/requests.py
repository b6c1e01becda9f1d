"""Checks on a request before anything is compiled or run: block size, cache room, token ids."""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

from bp_jax.errors import BadInputError


def check_block_sizes(sizes: Sequence[int], flag: str = "--config.block_sizes") -> None:
  """Every block size is an integer >= 1 (1 = plain AR decoding)."""
  def ok(b) -> bool:
    try:
      return not isinstance(b, bool) and operator.index(b) >= 1
    except TypeError:
      return False

  bad = [b for b in sizes if not ok(b)]
  if bad:
    raise BadInputError(f"{flag}={','.join(map(str, sizes))}: block sizes must be integers >= 1 "
                        f"(1 = plain AR decoding), got {bad[0]}")


def check_sampling(temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> None:
  """The sampling settings are in range (0 / 1.0 / 0.0 switch top_k / top_p / min_p off)."""
  if not temperature >= 0:
    raise BadInputError(f"--config.temperature={temperature} must be >= 0")
  if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
    raise BadInputError(f"--config.top_k={top_k} must be an integer >= 0 (0 = off)")
  if not 0 < top_p <= 1:
    raise BadInputError(f"--config.top_p={top_p} must be in (0, 1] (1 = off)")
  if not 0 <= min_p < 1:
    raise BadInputError(f"--config.min_p={min_p} must be in [0, 1) (0 = off)")


def check_batching(batch_size: int, sync_cycles: int, prefix: str = "--config.") -> None:
  """batch_size >= 1 slots per bucket; sync_cycles >= 0 (0 = static); errors name
  `{prefix}batch_size` / `{prefix}sync_cycles` ('' for the library's parameters)."""
  if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
    raise BadInputError(f"{prefix}batch_size={batch_size} must be an integer >= 1")
  if isinstance(sync_cycles, bool) or int(sync_cycles) != sync_cycles or sync_cycles < 0:
    raise BadInputError(f"{prefix}sync_cycles={sync_cycles} must be an integer >= 0 "
                        "(0 = a batch runs until all its rows finish)")


@dataclasses.dataclass(frozen=True)
class RequestChecks:
  """What an engine can serve: its cache length, vocabulary, buckets and whether it drafts."""
  max_len: int
  vocab_size: int
  block_sizes: tuple[int, ...]
  has_drafter: bool

  def check_block_size(self, block_size: int) -> None:
    check_block_sizes([block_size], "block_size")
    if block_size == 1:
      return
    if not self.has_drafter:
      raise BadInputError(f"block_size={block_size} needs a drafter (--config.drafter); "
                          "without one only block_size=1 (mode=ar) is possible")
    if block_size not in self.block_sizes:
      raise BadInputError(f"block_size={block_size} is not one of the configured buckets "
                          f"{list(self.block_sizes)} (--config.block_size / --config.block_sizes)")

  def check_request(self, prompt_len: int, max_new_tokens: int, block_size: int = 1) -> None:
    self.check_block_size(block_size)
    if max_new_tokens < 1:
      raise BadInputError(f"--config.max_new_tokens={max_new_tokens} must be >= 1")
    if prompt_len < 1:
      raise BadInputError("empty prompt: at least one token is needed")
    need = prompt_len + max_new_tokens + block_size - 1
    if need > self.max_len:
      raise BadInputError(
          f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} + block_size-1="
          f"{block_size - 1} needs {need} cache slots, more than --config.max_len={self.max_len}")

  def check_prompt_ids(self, prompt_ids: Sequence[int]) -> None:
    if max(prompt_ids) >= self.vocab_size or min(prompt_ids) < 0:
      raise BadInputError(f"prompt token id out of range for vocab_size={self.vocab_size}")
