"""Training batches from token-sequence datasets, and packing token streams into LM chunks."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from bp_jax.errors import BadInputError


def _check_count(value: int, flag: str, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise BadInputError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The example order of one epoch: a permutation fixed by (seed, epoch) alone."""
  _check_count(seed, "seed", 0)
  _check_count(epoch, "epoch", 0)
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
  return rng.permutation(num_examples)


def _read(source: Sequence[Mapping[str, Any]], indices: np.ndarray) -> list[Mapping[str, Any]]:
  """Reads examples by index, in one call when the source supports it."""
  getitems = getattr(source, "__getitems__", None)
  if getitems is not None:
    return list(getitems([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


def pad_batch(records: Sequence[Mapping[str, Any]], seq_len: int,
              pad_id: int) -> dict[str, np.ndarray]:
  """Pads/truncates records {"tokens", "prompt_len"?} to `seq_len` columns.

  Returns:
    tokens [B, seq_len] int32 (pad_id after each sequence), loss_mask [B, seq_len] int32
    (1 where prompt_len <= position < length), lengths [B] int32 (tokens kept, at most seq_len)
    and prompt_lens [B] int32 (as stored, not clipped).
  """
  batch = len(records)
  tokens = np.full((batch, seq_len), pad_id, dtype=np.int32)
  loss_mask = np.zeros((batch, seq_len), dtype=np.int32)
  lengths = np.zeros((batch,), dtype=np.int32)
  prompt_lens = np.zeros((batch,), dtype=np.int32)
  for row, record in enumerate(records):
    seq = np.asarray(record["tokens"], dtype=np.int32)[:seq_len]
    prompt_len = int(record.get("prompt_len", 0))
    tokens[row, :seq.size] = seq
    loss_mask[row, min(prompt_len, seq.size):seq.size] = 1
    lengths[row] = seq.size
    prompt_lens[row] = prompt_len
  return {"tokens": tokens, "loss_mask": loss_mask, "lengths": lengths,
          "prompt_lens": prompt_lens}


def batches(source: Sequence[Mapping[str, Any]], batch_size: int, seq_len: int, seed: int,
            epoch: int, pad_id: int,
            drop_remainder: bool = True) -> Iterator[dict[str, np.ndarray]]:
  """Yields one epoch of shuffled, padded batches (see `pad_batch` for the arrays).

  Args:
    source: random-access examples with "tokens" and optionally "prompt_len" (a `Dataset`
      from `open_dataset`, or a list of dicts).
    batch_size: examples per batch.
    seq_len: columns per batch; longer sequences are truncated, shorter ones padded.
    seed: with `epoch`, fixes the order: the same (seed, epoch) always gives the same batches,
      another epoch another order.
    epoch: the epoch number (>= 0).
    pad_id: the token written after each sequence.
    drop_remainder: drop the last incomplete batch; when False it is yielded with fewer rows.
  """
  _check_count(batch_size, "batch_size", 1)
  _check_count(seq_len, "seq_len", 1)
  order = epoch_order(len(source), seed, epoch)
  stop = len(order) - len(order) % batch_size if drop_remainder else len(order)
  for start in range(0, stop, batch_size):
    yield pad_batch(_read(source, order[start:start + batch_size]), seq_len, pad_id)


def packed_lm_chunks(token_stream_iter: Iterable[int | Sequence[int] | np.ndarray], seq_len: int,
                     eot_id: int | None = None) -> Iterator[np.ndarray]:
  """Cuts a token stream into consecutive int32 chunks of exactly `seq_len` tokens.

  Args:
    token_stream_iter: token ids, or pieces of the stream (lists/arrays of ids, e.g. documents
      already ending with an end-of-text id); pieces are concatenated in order.
    seq_len: the chunk length; a final partial chunk is dropped.
    eot_id: when given, appended after every piece (each piece is then one document).
  """
  _check_count(seq_len, "seq_len", 1)
  pending: list[np.ndarray] = []
  count = 0
  for piece in token_stream_iter:
    arr = np.atleast_1d(np.asarray(piece))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
      raise BadInputError(
          f"token stream: expected token ids or 1-D lists of them, got {piece!r:.80}")
    pending.append(arr.astype(np.int32))
    count += arr.size
    if eot_id is not None:
      pending.append(np.array([eot_id], dtype=np.int32))
      count += 1
    if count >= seq_len:
      stream = np.concatenate(pending)
      full = count - count % seq_len
      yield from stream[:full].reshape(-1, seq_len)
      pending, count = [stream[full:]], count - full


def chunk_records(chunks: Iterable[np.ndarray], id_prefix: str = "chunk-"
                  ) -> Iterator[dict[str, Any]]:
  """Turns LM chunks into `write_sequences` records (ids `<prefix>00000000`, prompt_len 0)."""
  for index, chunk in enumerate(chunks):
    yield {"id": f"{id_prefix}{index:08d}", "tokens": chunk, "prompt_len": 0}
