"""The one-request loops attend over a window of cache slots sized to the request (prompt,
max_new_tokens and one block), not all max_len slots: same outputs, a bounded set of programs."""

from __future__ import annotations

import numpy as np
import pytest

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.decoding.programs import request_window, request_windows
from toy_models import zeros_drafter_pair


def test_window_set_and_choice():
  assert request_windows(2048) == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
  assert request_windows(640) == (128, 192, 256, 384, 512, 640)
  assert request_windows(128) == (128,) and request_windows(100) == (100,)
  assert request_window(626, 2048) == 768  # within 1.5x of what the request needs
  assert request_window(626, 640) is None  # all slots: no separate program
  assert request_window(129, 2048) == 192 and request_window(128, 2048) == 128
  for max_len in (300, 640, 2048, 40960):
    ws = request_windows(max_len)
    assert len(ws) <= 2 * np.log2(max_len / 128) + 2
    assert all(b <= 1.5 * a for a, b in zip(ws, ws[1:]))


@pytest.fixture(scope="module")
def pair():
  return zeros_drafter_pair()


def test_windowed_requests_decode_as_the_whole_cache_does(pair):
  """Engines of max_len 256 (windows 128, 192, 256) and 128 (one program over all slots):
  identical tokens and forwards for every request, AR and speculative with back-off, greedy and
  for a seed at T = 1 (each in its sampling form's program, `sampling.SamplingForm`)."""
  target, drafter = pair
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 60, n)) for n in (10, 70)]
  loop = LoopOptions(verify="exact", ar_fallback=4)
  big, small = (Engine(target, drafter=drafter, loop=loop,
                       shapes=ShapeOptions(max_len=m, block_sizes=(1, 4), length_buckets=(128,)))
                for m in (256, 128))
  for temperature in (0.0, 1.0):
    for b in (1, 4):
      for i, ids in enumerate(prompts):
        got, want = (e.generate(ids, max_new_tokens=40, block_size=b, temperature=temperature,
                                seed=i) for e in (big, small))
        assert got.output_ids == want.output_ids, (temperature, b, i)
        assert got.forward_lengths == want.forward_lengths, (temperature, b, i)
  # Every request here fits in 128 slots: one windowed program per loop and sampling form on
  # the big engine, the all-slots program on the small one.
  big_keys = sorted(k for k in big.compiled._fns if k[0] in ("ar_loop", "spec_loop"))
  assert big_keys == [("ar_loop", 1, 128), ("ar_loop", 1, 128, "sampled"),
                      ("spec_loop", 4, 128), ("spec_loop", 4, 128, "sampled")], big_keys
  assert sorted(k for k in small.compiled._fns if k[0] in ("ar_loop", "spec_loop")) == [
      ("ar_loop", 1), ("ar_loop", 1, "sampled"), ("spec_loop", 4), ("spec_loop", 4, "sampled")]


def test_a_longer_request_takes_a_larger_window_compiled_once(pair):
  target, drafter = pair
  eng = Engine(target, drafter=drafter,
               shapes=ShapeOptions(max_len=256, block_sizes=(4,), length_buckets=(128,)))
  ids = [1 + i % 60 for i in range(100)]
  for _ in range(2):
    eng.generate(ids, max_new_tokens=60, block_size=4)   # extent 164 -> window 192
    eng.generate(ids[:20], max_new_tokens=20, block_size=4)  # extent 44 -> window 128
  keys = sorted(k for k in eng.compiled._fns if k[0] == "spec_loop")
  assert keys == [("spec_loop", 4, 128), ("spec_loop", 4, 192)]
  assert eng.compiled.counts["spec_loop"] == 2
