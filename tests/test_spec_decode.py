"""Speculative decoding is lossless at T=0 (docs/design.md §3), compiles once per bucket (§4), and
rejects bad requests with clear messages.

One tiny target (from transformers, so that greedy references come from an independent
implementation) and one random z-lab-format drafter are shared by the whole module; the engine
is module-scoped so each length bucket / block size compiles once for all tests.

Reference: `CONT[i]` is transformers' untrimmed greedy continuation of prompt i (longer than any
request). The engine's AR output must be `CONT[i]` cut at max_new_tokens / the stop token, and
every speculative output must equal the AR output token for token. For drafters whose proposals
are known (`forced_continuation`), the acceptance lengths of every cycle are predicted exactly
by `simulate_cycles`, a plain-Python statement of the exact-match rule.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
import torch

from bp_jax.models.config import DFlashConfig
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.errors import BadInputError
from compile_counting import BackendCompiles
from hf_fixtures import (jax_drafter_from_state_dict, jax_qwen3_from_torch, make_dflash_state_dict,
                         make_hf_qwen3)

V = 128
MASK = V - 1
TARGET_KW = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=256)
DRAFTER_HF = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=10000.0, block_size=8, num_target_layers=3,
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": [0, 2]})
BLOCK_SIZES = (2, 4, 8, 16, 17)
MAX_LEN = 128
LENGTH_BUCKETS = (16, 32, 64)
# 20 prompts, 1..60 tokens, covering all three length buckets and their edges.
PROMPT_LENS = (1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 20, 24, 29, 31, 32, 33, 40, 47, 53, 60)
# Per-prompt max_new_tokens: mostly not multiples of any block size; 1 and 2 are edge cases
# (no cycle at all / a single cycle). prompt + max_new + 16 <= MAX_LEN for every prompt.
MAX_NEWS = (37, 23, 45, 1, 19, 50, 2, 31, 9, 41, 26, 35, 13, 43, 29, 49, 33, 21, 47, 51)
CONT_LEN = 70  # reference continuation length: > max_new + 17 for every prompt
assert len(PROMPT_LENS) == len(MAX_NEWS) == 20
assert all(n + m + max(BLOCK_SIZES) - 1 <= MAX_LEN for n, m in zip(PROMPT_LENS, MAX_NEWS))


def trim(ids, stop: int, max_new: int) -> list[int]:
  out = []
  for t in list(ids)[:max_new]:
    out.append(int(t))
    if t == stop:
      break
  return out


def simulate_forwards(cont, forced, b: int, max_new: int, stop: int, fallback: int = 0,
                      fallback_accept: int = 1) -> list[tuple[int, bool]]:
  """(kept tokens, is a cycle) per target forward of greedy spec decoding when the target's
  greedy continuation is `cont` and the drafter proposes `forced[i]` for new-token index i (0
  past the end of `forced`, as the engine pads). Index 0 comes from prefill; a cycle that starts
  with m committed tokens drafts forced[m .. m+b-2], the target's greedy tokens there are
  cont[m ..], and the longest matching prefix a is accepted; cont[m .. m+a] are committed, of
  which only those up to the stop token and within max_new_tokens are kept (counted). With
  `fallback` (the engine's ar_fallback), a cycle accepting <= fallback_accept drafts is followed
  by min(2^k, fallback) AR steps (not cycles) for the k-th poor cycle in a row."""
  f = lambda i: int(forced[i]) if i < len(forced) else 0

  def kept(m: int, n: int) -> int:
    seg = list(cont[m:m + n])
    return min(seg.index(stop) + 1 if stop in seg else n, max_new - m)

  m, out, misses = 1, [], 0
  if cont[0] == stop:
    return out
  while m < max_new:
    a = 0
    while a < b - 1 and f(m + a) == cont[m + a]:
      a += 1
    out.append((kept(m, a + 1), True))
    committed = cont[m:m + a + 1]
    m += a + 1
    if stop in committed:
      break
    if fallback and a <= fallback_accept:  # AR steps: one committed token per target forward
      misses += 1
      for _ in range(min(2 ** misses, fallback)):
        if m >= max_new or cont[m - 1] == stop:
          break
        out.append((1, False))
        m += 1
      if cont[m - 1] == stop:
        break
    else:
      misses = 0
  return out


def simulate_cycles(*args, **kw) -> list[int]:
  """Kept tokens per speculative cycle (τ's terms) of `simulate_forwards`."""
  return [n for n, is_cycle in simulate_forwards(*args, **kw) if is_cycle]


def forwards_of(g) -> list[tuple[int, bool]]:
  return list(zip(g.forward_lengths, g.forward_is_cycle))


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
  hf = make_hf_qwen3(seed=11, **TARGET_KW)
  target = jax_qwen3_from_torch(hf)
  cfg = DFlashConfig.from_hf_dict(DRAFTER_HF, "tiny-dflash/config.json")
  drafter = jax_drafter_from_state_dict(cfg, make_dflash_state_dict(cfg, seed=5))
  return hf, target, drafter


def _hf_greedy(hf, prompts: list[list[int]], steps: int) -> list[list[int]]:
  """transformers' greedy continuations (no stopping), all prompts in one left-padded batch."""
  L = max(map(len, prompts))
  ids = torch.zeros((len(prompts), L), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, L - len(p):] = torch.tensor(p)
    mask[i, L - len(p):] = 1
  with torch.no_grad():
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
  return out[:, L:].tolist()


@pytest.fixture(scope="module")
def reference(models):
  """Prompts, their reference continuations, and the stop id chosen from them.

  The stop id is the token whose FIRST occurrence falls strictly inside the requested output
  (index 2 .. max_new-3) for the most prompts, among tokens absent from at least 10 outputs (so
  most requests still run to max_new_tokens)."""
  hf = models[0]
  rng = np.random.default_rng(123)
  prompts = [rng.integers(0, V - 1, n).tolist() for n in PROMPT_LENS]
  conts = _hf_greedy(hf, prompts, CONT_LEN)
  assert all(len(c) == CONT_LEN for c in conts)
  best, best_mid = None, -1
  for t in range(V):
    firsts = [c[:m].index(t) if t in c[:m] else None for c, m in zip(conts, MAX_NEWS)]
    mid = sum(k is not None and 2 <= k <= m - 3 for k, m in zip(firsts, MAX_NEWS))
    absent = sum(k is None for k in firsts)
    if absent >= 10 and mid > best_mid:
      best, best_mid = t, mid
  return prompts, conts, best


@pytest.fixture(scope="module")
def engine(models, reference):
  _, target, drafter = models
  stop = reference[2]
  return Engine(target, stop_ids=[stop], drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=LENGTH_BUCKETS,
                                    block_sizes=BLOCK_SIZES))


@pytest.fixture(scope="module")
def ar_outputs(engine, reference):
  prompts = reference[0]
  return [engine.generate(p, max_new_tokens=m, block_size=1).output_ids
          for p, m in zip(prompts, MAX_NEWS)]


def _cases(reference):
  prompts, conts, stop = reference
  return [(i, p, conts[i], m) for i, (p, m) in enumerate(zip(prompts, MAX_NEWS))]


# ---- AR reference -------------------------------------------------------------------------------

def test_ar_output_matches_transformers_greedy(reference, ar_outputs):
  prompts, conts, stop = reference
  n_stopped = n_full = 0
  for i, (c, m) in enumerate(zip(conts, MAX_NEWS)):
    want = trim(c, stop, m)
    assert ar_outputs[i] == want, f"prompt {i} (len {PROMPT_LENS[i]}, max_new {m})"
    if want[-1] == stop:
      n_stopped += 1
    else:
      assert len(ar_outputs[i]) == m
      n_full += 1
  # The fixture's stop choice makes both kinds of request common.
  assert n_stopped >= 3 and n_full >= 10, (n_stopped, n_full)


# ---- lossless greedy ----------------------------------------------------------------------------

@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_random_drafter_is_lossless(engine, reference, ar_outputs, b):
  """(a) A random drafter: almost every draft is rejected (acceptance ~1), rollback every cycle."""
  accepts = []
  for i, p, c, m in _cases(reference):
    g = engine.generate(p, max_new_tokens=m, block_size=b)
    assert g.output_ids == ar_outputs[i], f"prompt {i} (len {len(p)}, max_new {m})"
    assert g.block_size == b
    acc = g.acceptance_lengths
    assert all(1 <= a <= b for a in acc)
    # Counted tokens are exactly the kept ones: the last cycle's tokens past max_new / the
    # stop token are not counted.
    assert sum(acc) == len(g.output_ids) - 1, (acc, len(g.output_ids))
    assert g.target_forwards == len(acc) and all(g.forward_is_cycle)
    accepts += acc
  assert np.mean(accepts) < 1.3  # it really is a bad drafter: rejection paths exercised


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_perfect_drafter_accepts_full_blocks(engine, reference, ar_outputs, b):
  """(b) forced_continuation = the AR output: every cycle but possibly the last accepts all b."""
  stop = reference[2]
  for i, p, c, m in _cases(reference):
    ar = ar_outputs[i]
    g = engine.generate(p, max_new_tokens=m, block_size=b, forced_continuation=ar)
    assert g.output_ids == ar, f"prompt {i}"
    acc = g.acceptance_lengths
    assert acc == simulate_cycles(c, ar, b, m, stop), f"prompt {i}"
    assert all(a == b for a in acc[:-1]), acc
    assert g.target_forwards == math.ceil((len(ar) - 1) / b)  # as few cycles as possible


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_stop_token_inside_an_accepted_block(engine, reference, ar_outputs, b):
  """(c) The drafter proposes the untrimmed greedy continuation, so the block holding the stop
  token is accepted in full, tokens after the stop included; the output must still end at the
  stop token exactly like AR, and the loop must end with that cycle."""
  prompts, conts, stop = reference
  mid_block = 0
  cases = [(i, p, c, m) for i, p, c, m in _cases(reference) if ar_outputs[i][-1] == stop]
  assert len(cases) >= 3
  for i, p, c, m in cases:
    k = len(ar_outputs[i]) - 1  # index of the stop token in the output
    g = engine.generate(p, max_new_tokens=m, block_size=b, forced_continuation=c)
    assert g.output_ids == ar_outputs[i], f"prompt {i}"
    assert g.output_ids[-1] == stop and stop not in g.output_ids[:-1]
    assert g.acceptance_lengths == simulate_cycles(c, c, b, m, stop)
    want = [b] * (k // b) + ([k % b] if k % b else [])  # tokens after the stop: not counted
    assert g.acceptance_lengths == want, (k, g.acceptance_lengths)
    assert g.target_forwards == math.ceil(k / b)
    mid_block += k % b != 0  # the stop is not the block's last token: later tokens were trimmed
  assert mid_block >= 1


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_partial_acceptance_rolls_back_mid_block(engine, reference, ar_outputs, b):
  """A drafter right on most tokens but wrong on ~1 in 4: acceptance stops at every position of
  a block, so both caches roll back to every possible offset."""
  prompts, conts, stop = reference
  rng = np.random.default_rng(b)
  seen = set()
  for i, p, c, m in _cases(reference):
    forced = [(t + 1) % V if rng.random() < 0.25 else t for t in c]
    g = engine.generate(p, max_new_tokens=m, block_size=b, forced_continuation=forced)
    assert g.output_ids == ar_outputs[i], f"prompt {i}"
    assert g.acceptance_lengths == simulate_cycles(c, forced, b, m, stop), f"prompt {i}"
    seen.update(g.acceptance_lengths)
  assert len(seen & set(range(2, b))) >= min(b - 2, 4), sorted(seen)  # intermediate lengths


@pytest.mark.parametrize("b", BLOCK_SIZES)
def test_max_new_tokens_not_a_multiple_of_block_size(engine, reference, b):
  """(d) Output length is exactly max_new_tokens, for lengths just over / under a multiple of b."""
  prompts, conts, stop = reference
  checked = 0
  for i, (p, c) in enumerate(zip(prompts, conts)):
    if len(p) > 30:
      continue
    for m in (b + 1, 2 * b - 1, 2 * b + 1):
      if m % b == 0 or stop in c[:m]:
        continue
      want = c[:m]
      for forced in (None, c, c[:m]):
        g = engine.generate(p, max_new_tokens=m, block_size=b, forced_continuation=forced)
        assert g.output_ids == want and len(g.output_ids) == m, (i, m, forced is None)
      checked += 1
  assert checked >= 10


# ---- compile once -------------------------------------------------------------------------------



def test_scanned_layers_decode_the_same_tokens(models, reference, ar_outputs):
  """Engine(scan_layers=True) (lax.scan over layers in the loops) gives the outputs of the
  default unrolled loops, for AR and spec."""
  _, target, drafter = models
  prompts, _, stop = reference
  scanned = Engine(target, stop_ids=[stop], drafter=drafter,
                   shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=LENGTH_BUCKETS,
                                       block_sizes=(4,)),
                   loop=LoopOptions(scan_layers=True))
  for i in range(4):
    for b in (1, 4):
      out = scanned.generate(prompts[i], max_new_tokens=MAX_NEWS[i], block_size=b).output_ids
      assert out == ar_outputs[i], (i, b)


@pytest.fixture(scope="module")
def fallback_engine(models, reference):
  _, target, drafter = models
  return Engine(target, stop_ids=[reference[2]], drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=LENGTH_BUCKETS,
                                    block_sizes=(4, 8)),
                loop=LoopOptions(ar_fallback=4, ar_fallback_accept=1))


@pytest.mark.parametrize("b", (4, 8))
def test_ar_fallback_is_lossless(fallback_engine, engine, reference, ar_outputs, b):
  """With AR steps after poor cycles (the random drafter makes nearly every cycle poor), the
  output is still the AR output, every target forward commits at least one token, and the
  forwards are a mix: cycles of the fallback engine are more than the pure spec engine's
  (AR steps commit one token each) but fewer than one per token. A perfect drafter never falls
  back: its cycles are the pure spec loop's."""
  stop, fell_back = reference[2], 0
  for i, p, c, m in _cases(reference):
    g = fallback_engine.generate(p, max_new_tokens=m, block_size=b)
    assert g.output_ids == ar_outputs[i], f"prompt {i}"
    # A drafter wrong on 2 tokens in every 5: long cycles, poor cycles and the AR steps after
    # them, exactly as the schedule says.
    forced = [(t + 1) % V if k % 5 < 2 else t for k, t in enumerate(c)]
    g = fallback_engine.generate(p, max_new_tokens=m, block_size=b, forced_continuation=forced)
    assert g.output_ids == ar_outputs[i], f"prompt {i}"
    want = simulate_forwards(c, forced, b, m, stop, fallback=4, fallback_accept=1)
    assert forwards_of(g) == want, f"prompt {i}"
    assert g.ar_steps == sum(not cyc for _, cyc in want)
    assert g.acceptance_lengths == [n for n, cyc in want if cyc]  # τ counts cycles only
    fell_back += want != simulate_forwards(c, forced, b, m, stop)
    perfect = fallback_engine.generate(p, max_new_tokens=m, block_size=b,
                                       forced_continuation=ar_outputs[i])
    assert perfect.output_ids == ar_outputs[i]
    assert perfect.acceptance_lengths == simulate_cycles(c, ar_outputs[i], b, m, stop)
  assert fell_back >= len(reference[0]) // 2, fell_back


def test_ar_fallback_samples_like_ar(fallback_engine, engine, reference):
  """At T=1 every token is the target's sample at its position (same keys) whether it comes
  from a cycle or a fallback AR step: outputs equal plain AR sampling with the same seed."""
  for i in range(6):
    p, m = reference[0][i], MAX_NEWS[i]
    want = engine.generate(p, max_new_tokens=m, block_size=1, temperature=1.0, seed=i)
    got = fallback_engine.generate(p, max_new_tokens=m, block_size=4, temperature=1.0, seed=i)
    assert got.output_ids == want.output_ids, i


def test_ar_fallback_settings_are_checked(models):
  _, target, drafter = models
  with pytest.raises(BadInputError, match="ar_fallback"):
    Engine(target, drafter=drafter,
           shapes=ShapeOptions(max_len=MAX_LEN, block_sizes=(4,)),
           loop=LoopOptions(ar_fallback=-1))


def test_each_bucket_compiles_once(engine, reference):
  """Decoding prompts of all length buckets with several block sizes compiles one prefill per
  bucket and one loop per block size; a second pass compiles nothing at all."""
  prompts, conts, stop = reference
  sizes = (1, 4, 16, 17)
  jobs = [(p, m, b) for b in sizes for p, m in zip(prompts[::3], MAX_NEWS[::3])]
  used_buckets = {min(x for x in LENGTH_BUCKETS if x >= len(p)) for p, _, _ in jobs}
  assert used_buckets == set(LENGTH_BUCKETS)
  before = set(engine.compiled.seconds)
  outputs = [engine.generate(p, max_new_tokens=m, block_size=b).output_ids for p, m, b in jobs]
  keys = set(engine.compiled.seconds)
  expected = ({("prefill", P) for P in used_buckets} | {("ar_loop", 1)}
              | {("prefill", P, "target_only") for P in used_buckets}  # block size 1's
              | {("spec_loop", b) for b in sizes if b > 1})
  assert expected <= keys
  assert keys - before <= expected  # nothing else was compiled by this pass
  # One compilation per key, ever (the module's earlier tests used the same engine).
  for name in ("prefill", "ar_loop", "spec_loop"):
    assert engine.compiled.counts[name] == sum(k[0] == name for k in keys), (
        name, engine.compiled.counts, sorted(keys))
  counts = dict(engine.compiled.counts)
  with BackendCompiles() as compiles:
    again = [engine.generate(p, max_new_tokens=m, block_size=b).output_ids for p, m, b in jobs]
  assert again == outputs
  assert dict(engine.compiled.counts) == counts
  assert compiles.n == 0, f"{compiles.n} XLA compilations in the second pass"


def test_a_plain_request_is_prefilled_without_the_drafter(engine, reference, ar_outputs):
  """`Engine.plain_prefill`: a block-size-1 request on an engine with a drafter runs the
  target's prefill alone (its own program per length bucket) and leaves the drafter's context
  buffers as they were, neither written nor donated; a drafting request after it fills them and
  decodes AR's tokens."""
  prompts, _, _ = reference
  draft_before = engine.draft_cache
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(draft_before)]
  g = engine.generate(prompts[4], max_new_tokens=MAX_NEWS[4], block_size=1)
  assert g.output_ids == ar_outputs[4]
  assert engine.draft_cache is draft_before  # the same buffers, still alive
  for old, new in zip(leaves, jax.tree_util.tree_leaves(engine.draft_cache)):
    np.testing.assert_array_equal(np.asarray(new), old)
  bucket = min(x for x in LENGTH_BUCKETS if x >= len(prompts[4]))
  assert ("prefill", bucket, "target_only") in engine.compiled
  spec = engine.generate(prompts[4], max_new_tokens=MAX_NEWS[4], block_size=8)
  assert spec.output_ids == ar_outputs[4] and spec.cycles > 0
  assert engine.draft_cache is not draft_before  # the drafting prefill took (donated) them


def test_precompile_compiles_every_requested_bucket(models, reference):
  _, target, drafter = models
  eng = Engine(target, drafter=drafter,
               shapes=ShapeOptions(max_len=64, length_buckets=(8, 24), block_sizes=(3, 5)))
  summary = eng.precompile([3])
  assert summary["by_function"] == {"prefill": 2, "spec_loop": 1}
  assert summary["compilations"] == 3
  assert set(eng.compiled.seconds) == {("prefill", 8), ("prefill", 24), ("spec_loop", 3)}
  prompts, conts, _ = reference
  used = set()
  for p, c in zip(prompts, conts):
    if len(p) <= 24:
      g = eng.generate(p, max_new_tokens=9, block_size=3)
      assert g.output_ids == c[:9]  # this engine has no stop ids
      used.add(8 if len(p) <= 8 else 24)
  assert used == {8, 24}
  assert eng.compiled.total == 3  # decoding after precompile compiled nothing new
  assert set(eng.compiled.seconds) == {("prefill", 8), ("prefill", 24), ("spec_loop", 3)}


# ---- bad requests -------------------------------------------------------------------------------

def test_block_size_not_in_buckets_lists_the_buckets(engine):
  with pytest.raises(BadInputError) as err:
    engine.generate([1, 2, 3], max_new_tokens=4, block_size=5)
  msg = str(err.value)
  assert "block_size=5" in msg and str(list(BLOCK_SIZES)) in msg


def test_request_over_the_cache_names_max_len(engine):
  with pytest.raises(BadInputError) as err:
    engine.generate(list(range(60)), max_new_tokens=54, block_size=16)
  msg = str(err.value)
  assert "--config.max_len=128" in msg and "129" in msg, msg
  assert "60" in msg and "max_new_tokens=54" in msg, msg
  engine.check_request(60, 54, 1)   # the same request fits in AR mode
  engine.check_request(60, 53, 16)  # 60 + 53 + 15 = 128 slots: fits exactly
  with pytest.raises(BadInputError, match="max_len"):
    engine.check_request(60, 53, 17)


def test_spec_without_drafter_is_refused(models):
  _, target, _ = models
  eng = Engine(target, shapes=ShapeOptions(max_len=32, length_buckets=(16,)))
  with pytest.raises(BadInputError, match="needs a drafter"):
    eng.generate([1, 2], max_new_tokens=3, block_size=4)


def test_decode_loops_update_the_caches_in_place(engine, fallback_engine, reference):
  """The compiled loops hold no copy of a cache-sized buffer: every step writes the caches in
  place and attention reads them in their stored layout (a copy there costs a whole cache per
  layer per step; bp_jax/models/kv_cache.py explains the layout that avoids it). The same holds for
  the loop with AR fallback steps (a `lax.cond` there would copy every buffer)."""
  cache_shape = re.compile(rf"= f32\[[0-9,]*\b{MAX_LEN}\b[0-9,]*\]\{{[0-9,]*\}} copy\(")
  for eng, key in ((engine, ("ar_loop", 1)), (engine, ("spec_loop", 4)),
                   (fallback_engine, ("spec_loop", 4))):
    eng.generate(reference[0][0], max_new_tokens=8, block_size=key[1])
    hlo = eng.compiled._fns[key].as_text()
    copies = [line.strip()[:120] for line in hlo.splitlines() if cache_shape.search(line)]
    assert not copies, (key, copies)


def test_first_use_of_a_loop_is_warmed_untimed_and_leaves_the_request_intact(models, reference,
                                                                             ar_outputs):
  """A block size's loop runs once on copies of the request's buffers before its first timed
  run (`Engine._warm_loop`); the request still decodes the AR output, and only once per size."""
  _, target, drafter = models
  prompts, _, stop = reference
  fresh = Engine(target, stop_ids=[stop], drafter=drafter,
                 shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=LENGTH_BUCKETS,
                                     block_sizes=(4,)))
  for i in range(3):
    for b in (1, 4):
      assert fresh.generate(prompts[i], max_new_tokens=MAX_NEWS[i],
                            block_size=b).output_ids == ar_outputs[i]
  assert set(fresh.warmup_seconds) == {1, 4} and min(fresh.warmup_seconds.values()) > 0
