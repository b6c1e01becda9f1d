"""Batched decoding and continuous batching (`Engine.generate_batch`, `scheduler`): every row
of a batch is token-identical to decoding its request alone, finished rows free their slots for
queued requests, and each batched loop compiles once per (block size, batch size).

The models are `toy_models.zeros_drafter_pair`: a drafter that always drafts token 0, so cycles
accept every length and poor cycles (AR fallback) are common; the prompts have different
lengths (three length buckets) and the requests different max_new_tokens, so rows finish at
different times and slots are refilled while others decode.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bp_jax.decode_job.block_choice import batch_options
from bp_jax.decoding.engine import LEARNED, Engine
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.decoding.scheduler import Scheduler
from bp_jax.errors import BadInputError
from bp_jax.policy.features import feature_dims
from bp_jax.policy.mlp import BlockPolicy, PolicyArch
from toy_models import zeros_drafter_pair

V, D, MAX_LEN, BUCKETS = 64, 32, 128, (16, 32, 64)
SIZES = (1, 2, 4, 6)


def _requests(num: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, V - 1, int(rng.integers(2, 50))).tolist() for _ in range(num)]
  max_news = [int(rng.integers(1, 40)) for _ in range(num)]
  return prompts, max_news


@pytest.fixture(scope="module")
def models():
  return zeros_drafter_pair(V)


@pytest.fixture(scope="module")
def stop_id(models):
  """The token (not 0, what the drafter drafts) whose first occurrence falls inside the most
  requested outputs of `_requests(11)` while absent from at least 3 (rows stop at different
  times, some at their max_new_tokens)."""
  target, drafter = models
  eng = Engine(target, shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  prompts, max_news = _requests(11)
  outs = [eng.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, max_news)]
  best, best_inside = None, -1
  for t in range(1, V):
    firsts = [o.index(t) if t in o else None for o in outs]
    inside = sum(k is not None and 1 <= k < len(o) - 1 for k, o in zip(firsts, outs))
    if sum(k is None for k in firsts) >= 3 and inside > best_inside:
      best, best_inside = t, inside
  return best


def _engine(models, stop_id, batch_size: int, sync_cycles: int = 16, policy=None,
            policy_sizes=(), shrink: bool = False, join_learned: bool = True,
            **loop) -> Engine:
  """A test engine; its batches compute all `batch_size` slots to the end unless `shrink`
  (the tail tests ask for it: each further slot size compiles its own loops)."""
  target, drafter = models
  return Engine(target, stop_ids=[stop_id], drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=SIZES),
                loop=LoopOptions(**loop),
                batching=BatchOptions(batch_size=batch_size, sync_cycles=sync_cycles,
                                      shrink=shrink, join_learned=join_learned),
                policy=policy, policy_sizes=policy_sizes)


@pytest.fixture(scope="module")
def single(models, stop_id):
  return _engine(models, stop_id, 1)


@pytest.fixture(scope="module")
def batched(models, stop_id):
  return _engine(models, stop_id, 4, sync_cycles=3)


def _alone(engine, prompts, max_news, sizes, seed: int = 0, **kw):
  return [engine.generate(p, max_new_tokens=m, block_size=b, seed=seed + i, **kw)
          for i, (p, m, b) in enumerate(zip(prompts, max_news, sizes))]


@pytest.mark.parametrize("b", [1, 4, 6])
def test_every_row_equals_its_request_alone(single, batched, stop_id, b):
  prompts, max_news = _requests(11)
  alone = _alone(single, prompts, max_news, [b] * 11)
  together = batched.generate_batch(prompts, max_new_tokens=max_news, block_size=b)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  assert [g.forward_lengths for g in together] == [g.forward_lengths for g in alone]
  assert [g.forward_is_cycle for g in together] == [g.forward_is_cycle for g in alone]
  # The fixture's requests do finish at different times, some at the stop token.
  lengths = [len(g.output_ids) for g in alone]
  assert len(set(lengths)) >= 5
  assert sum(g.output_ids[-1] == stop_id for g in alone) >= 2
  assert all(g.decode_s > 0 for g in together if len(g.output_ids) > 1)


def test_mixed_block_sizes_share_the_run(single, batched):
  prompts, max_news = _requests(10, seed=2)
  sizes = [SIZES[i % len(SIZES)] for i in range(10)]
  alone = _alone(single, prompts, max_news, sizes)
  together = batched.generate_batch(prompts, max_new_tokens=max_news, block_size=sizes)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  assert [g.block_size for g in together] == sizes


@pytest.mark.parametrize("verify", ["exact", "rejection"])
def test_sampled_rows_equal_their_request_alone_for_the_same_seed(models, stop_id, verify):
  one = _engine(models, stop_id, 1, verify=verify)
  many = _engine(models, stop_id, 3, sync_cycles=2, verify=verify)
  prompts, max_news = _requests(7, seed=3)
  kw = dict(temperature=1.0, top_k=20)
  alone = _alone(one, prompts, max_news, [4] * 7, seed=100, **kw)
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=100, **kw)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  other = many.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=200, **kw)
  assert [g.output_ids for g in other] != [g.output_ids for g in alone]


def test_ar_fallback_rows_equal_their_request_alone(models, stop_id):
  one = _engine(models, stop_id, 1, ar_fallback=4)
  many = _engine(models, stop_id, 4, sync_cycles=5, ar_fallback=4)
  prompts, max_news = _requests(9, seed=4)
  alone = _alone(one, prompts, max_news, [4] * 9)
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=4)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  assert any(g.ar_steps for g in alone)  # the fallback does step in this fixture


def test_static_batching_gives_the_same_outputs(models, stop_id, single):
  prompts, max_news = _requests(6, seed=5)
  static = _engine(models, stop_id, 4, sync_cycles=0)
  alone = _alone(single, prompts, max_news, [4] * 6)
  assert ([g.output_ids for g in static.generate_batch(prompts, max_new_tokens=max_news,
                                                        block_size=4)]
          == [g.output_ids for g in alone])
  assert static.slot_sizes() == (4,)  # one call runs the batch to its end: no tail to shrink


@pytest.mark.parametrize("join", [False, True])
def test_learned_policy_in_batches(models, stop_id, single, join):
  """Learned block sizes in a batch: each request's output and policy scores are its own
  alone. Without `join_learned` each decodes in its pick's bucket; with it (the default) every
  request whose pick is speculative decodes at the middle of the policy's speculative sizes
  (4, 6: the upper, 6), one bucket for all, a pick of 1 plainly; `policy_block_size` keeps
  each pick."""
  target, drafter = models
  dims = feature_dims(V, D, 2, draft_block_size=drafter.cfg.block_size)
  policy = BlockPolicy(PolicyArch("last_hidden", dims["last_hidden"], 16, 2, 3),
                       rngs=nnx.Rngs(7))
  one = _engine(models, stop_id, 1, policy=policy, policy_sizes=(1, 4, 6))
  many = _engine(models, stop_id, 2, sync_cycles=2, policy=policy, policy_sizes=(1, 4, 6),
                 join_learned=join)
  prompts, max_news = _requests(10, seed=6)
  alone = _alone(one, prompts, max_news, [LEARNED] * 10)
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=LEARNED)
  picks = [g.block_size for g in alone]
  assert len(set(picks)) >= 2  # the random policy does pick several sizes
  assert [g.policy_block_size for g in alone] == picks
  assert [g.policy_block_size for g in together] == picks
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  assert [g.policy_probs for g in together] == [g.policy_probs for g in alone]
  used = [g.block_size for g in together]
  if not join:
    assert used == picks
  else:
    assert many.joint_size == 6 and many.learned_sizes == (1, 6)
    assert used == [1 if b == 1 else 6 for b in picks] and {4, 6} & set(picks), (used, picks)
    assert one.joint_size is None and one.learned_sizes == (1, 4, 6)  # batch 1: the picks
    # Fixed sizes beside them keep their own buckets (2: busier than the joint size's).
    mixed = [2, 2, LEARNED, 2, LEARNED, LEARNED]
    outs = many.generate_batch(prompts[:6], max_new_tokens=max_news[:6], block_size=mixed)
    assert [g.block_size for g in outs] == [
        b if b == 2 else 1 if p == 1 else 6 for b, p in zip(mixed, picks)]
    assert [g.output_ids for g in outs] == [g.output_ids for g in alone[:6]]


def test_continuous_batching_refills_slots_in_arrival_order(models, stop_id):
  """With one long request and short ones, the short ones flow through the other slots while
  the long one decodes (it does not hold the batch hostage): the scheduler's insertion order is
  the arrival order, and the long request is still in flight when later requests start."""
  eng = _engine(models, stop_id, 2, sync_cycles=1)
  prompts, _ = _requests(6, seed=7)
  max_news = [60, 3, 3, 3, 3, 3]
  order, in_flight_at = [], []
  real_insert = eng.insert_program

  def spy(carry, row, req, pre, **kw):
    order.append(req.index)
    in_flight_at.append(row)
    return real_insert(carry, row, req, pre, **kw)

  eng.insert_program = spy
  outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=1)
  assert order == list(range(6))
  assert in_flight_at[0] == 0 and set(in_flight_at[1:]) == {1}  # row 0 kept the long request
  assert len(outs[0].output_ids) > 3 or outs[0].output_ids[-1] == stop_id


@pytest.mark.parametrize("b", [1, 4])
def test_a_freed_slot_is_refilled_after_the_cycle_that_freed_it(models, stop_id, b):
  """With requests waiting, a loop call returns as soon as one of its rows finishes (not after
  `sync_cycles`), so the next request takes the slot at once; with none waiting, the call runs
  on. Neither changes a token, and the early return compiles nothing."""
  eng = _engine(models, stop_id, 2, sync_cycles=64)
  prompts, _ = _requests(3, seed=11)
  max_news = [2, 40, 40]
  reqs = [eng.batch_request(i, p, m, seed=i, block_size=b)
          for i, (p, m) in enumerate(zip(prompts, max_news))]
  sched = Scheduler(eng, reqs, track_progress=True)
  first = sched.step()
  # Request 0 finished in this call and request 2 waited: request 1 decoded about as long as
  # request 0 did (one cycle), not its 39 remaining tokens.
  assert set(first.finished) == {0}
  assert len(first.progress[1]) < 10 < max_news[1]
  second = sched.step()  # request 2 took the freed slot; nothing waits now: the call runs on
  assert set(second.progress) == {1, 2}
  assert all(len(t) == max_news[i] or stop_id in t for i, t in second.progress.items())
  outs = sched.run()
  alone = _alone(eng, prompts, max_news, [b] * 3)
  assert [g.output_ids for g in outs] == [g.output_ids for g in alone]
  assert eng.compiled.counts["batch_ar_loop" if b == 1 else "batch_spec_loop"] == 1


def test_batched_loops_compile_once_per_bucket_and_batch(models, stop_id):
  """Once per (block size, state size): without `shrink` one size, with it the tail's sizes too
  (3, 2, 1: `Engine.slot_sizes`), each compiled on its first use only."""
  prompts, max_news = _requests(8, seed=8)
  for shrink in (False, True):
    eng = _engine(models, stop_id, 3, sync_cycles=2, shrink=shrink)
    eng.generate_batch(prompts, max_new_tokens=max_news, block_size=[1, 4] * 4)
    first = dict(eng.compiled.counts)
    eng.generate_batch(prompts, max_new_tokens=max_news, block_size=[1, 4] * 4)
    counts = eng.compiled.counts
    assert dict(counts) == first  # nothing new the second time
    sizes = len(eng.slot_sizes())
    assert sizes == (3 if shrink else 1)
    assert 1 <= counts["batch_ar_loop"] <= sizes and 1 <= counts["batch_spec_loop"] <= sizes
    assert counts["insert"] == 2  # carries with and without a drafter cache
    # Each batch's fresh buffers: one program per bucket kind's full state, one for staging.
    assert counts["slot_carry"] == 2 and counts["staging_buffers"] == 1
  # Per bucket one prefill with the drafter, one without for the plain rows (`plain_prefill`).
  assert counts["prefill"] <= 2 * len(BUCKETS)


def test_fresh_buffers_made_by_one_call_equal_those_made_op_by_op(models, stop_id):
  """A bucket's empty state and the staging caches come from one compiled call each
  (`LoopPrograms.fresh`): the same values, dtypes and shapes as built op by op; the plain
  bucket's without a drafter cache."""
  eng = _engine(models, stop_id, 3)
  for b in (1, 4):
    made, built = eng.slot_carry(b), eng.slot_carry(b, compiled=False)
    assert jax.tree.structure(made) == jax.tree.structure(built)
    for x, y in zip(jax.tree.leaves(made), jax.tree.leaves(built)):
      if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x, y = jax.random.key_data(x), jax.random.key_data(y)
      assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    assert (made.draft_cache is None) == (b == 1)
  cache, draft_cache = eng.staging_buffers()
  assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves((cache, draft_cache)))
  assert cache.lengths.shape == (1,) and draft_cache is not None
  assert eng.compiled.counts["slot_carry"] == 2 and eng.compiled.counts["staging_buffers"] == 1


def test_plain_rows_are_prefilled_without_the_drafter(models, stop_id, single):
  """`Engine.plain_prefill`: a batch's rows routed to the plain bucket before their prefill take
  the target's prefill alone; the drafting rows' fills the drafter's context. Every row's tokens
  are its request's alone."""
  prompts, max_news = _requests(6, seed=12)
  eng = _engine(models, stop_id, 2, sync_cycles=2)
  sizes = [1, 4, 1, 1, 4, 1]
  together = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=sizes)
  alone = _alone(single, prompts, max_news, sizes)
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  prefills = {k for k in eng.compiled.seconds if k[0] == "prefill"}
  bucket = lambda p: min(b for b in BUCKETS if b >= len(p))
  assert prefills == ({("prefill", bucket(p), "target_only") for p, b in zip(prompts, sizes)
                       if b == 1} | {("prefill", bucket(p)) for p, b in zip(prompts, sizes)
                                     if b > 1})


def test_batched_loops_update_the_caches_in_place(models, stop_id):
  """As tests/test_spec_decode.py checks for one request: the batched loops (with fallback
  steps) hold no copy of a cache buffer."""
  eng = _engine(models, stop_id, 2, sync_cycles=2, ar_fallback=4)
  prompts, max_news = _requests(3, seed=9)
  eng.generate_batch(prompts, max_new_tokens=max_news, block_size=[1, 4, 4])
  # A cache buffer per layer is k [Z, S, H] / v [Z, H, S] (Z = 2 rows x 2 kv heads, H = 8),
  # stacked with a leading layer axis in the scanned form.
  cache_shape = re.compile(rf"= f32\[([0-9]+,)?4,({MAX_LEN},8|8,{MAX_LEN})\]\{{[0-9,]*\}} copy\(")
  for key in (("batch_ar_loop", 1, 2, "all"), ("batch_spec_loop", 4, 2, "all")):
    hlo = eng.compiled.program_text(key)
    copies = [line.strip()[:120] for line in hlo.splitlines() if cache_shape.search(line)]
    assert not copies, (key, copies)
    # The pattern does name the loop's cache buffers (it would see their copies).
    assert re.search(rf"f32\[4,{MAX_LEN},8\]", hlo) and re.search(rf"f32\[4,8,{MAX_LEN}\]", hlo)
  # The decline's branch between the full verify and none, like the branch to a run of AR
  # steps (each a `lax.cond` whose other branch passes the state through), copies no cache
  # buffer either.
  declining = _engine(models, stop_id, 2, controller="priced", controller_decline=True,
                      controller_costs="1,1.05,1.1", controller_draft_cost=0.1)
  declining.precompile([4], length_buckets=BUCKETS[:1])
  hlo = declining.compiled.program_text(("batch_spec_loop", 4, 2, "all"))
  assert hlo.count(" conditional(") == 2 and not cache_shape.search(hlo)


@pytest.mark.parametrize("kw, flag", [(dict(batch_size=0), "--config.batch_size"),
                                      (dict(batch_size=2.5), "--config.batch_size"),
                                      (dict(sync_cycles=-1), "--config.sync_cycles"),
                                      (dict(move_plain_after=-1), "--config.move_plain_after")])
def test_bad_batch_settings_name_the_parameter_and_the_flag(models, kw, flag):
  """The library names its parameter, the command line (`batch_options`) the flag."""
  target, _ = models
  param = flag.removeprefix("--config.")
  with pytest.raises(BadInputError, match=rf"(?<![\w.-]){re.escape(param)}="):
    Engine(target, shapes=ShapeOptions(max_len=MAX_LEN), batching=BatchOptions(**kw))
  with pytest.raises(BadInputError, match=re.escape(flag)):
    batch_options(ml_collections.ConfigDict(kw))


def test_bad_batch_requests_are_refused_before_decoding(batched):
  prompts, max_news = _requests(3)
  with pytest.raises(BadInputError, match="2 max_new_tokens for 3 prompts"):
    batched.generate_batch(prompts, max_new_tokens=max_news[:2])
  with pytest.raises(BadInputError, match="block_size=3 is not one of the configured buckets"):
    batched.generate_batch(prompts, max_new_tokens=4, block_size=3)


def test_attention_windows_follow_the_rows_and_change_nothing(models, stop_id, single):
  """With a longer cache (windows 128 and all 256 slots), each loop call attends over the smallest window
  with room for its furthest row and returns early when a row would pass it: outputs are those
  of each request alone, each window compiles once, and a windowed loop holds no cache copy."""
  from bp_jax.decoding.programs import window_buckets, window_for

  assert window_buckets(320) == (128, 256, 320) and window_buckets(256) == (128, 256)
  assert window_for(100, 4, 2, 320) == 128 and window_for(121, 4, 2, 320) == 256
  assert window_for(100, 4, 0, 320) is None and window_for(260, 4, 2, 320) is None
  # Rows that all ask for AR steps first need one slot per step: 121 + 16 fits in 128 where
  # 16 forwards of cycles of 4 would not (rows backed off attend over the smaller window).
  assert window_for(105, 4, 16, 320) == 256 and window_for(105, 4, 16, 320, ar_steps=16) == 128
  assert window_for(105, 4, 16, 320, ar_steps=99) == 128  # at most the call's forwards
  assert window_for(120, 1, 16, 320) == window_for(120, 4, 16, 320, ar_steps=16) == 256
  assert window_for(118, 1, 16, 320) == window_for(118, 4, 16, 320, ar_steps=16) == 128
  assert window_for(105, 4, 16, 320, ar_steps=2) == 256
  target, drafter = models
  long = Engine(target, stop_ids=[stop_id], drafter=drafter,
                shapes=ShapeOptions(max_len=256, length_buckets=BUCKETS, block_sizes=SIZES),
                loop=LoopOptions(ar_fallback=4),
                batching=BatchOptions(batch_size=3, sync_cycles=2, shrink=False))
  long_single = Engine(target, stop_ids=[stop_id], drafter=drafter,
                       shapes=ShapeOptions(max_len=256, length_buckets=BUCKETS, block_sizes=SIZES),
                       loop=LoopOptions(ar_fallback=4))
  prompts, _ = _requests(5, seed=10)
  max_news = [150, 90, 120, 60, 140]
  for b in (1, 4):
    alone = _alone(long_single, prompts, max_news, [b] * 5)
    together = long.generate_batch(prompts, max_new_tokens=max_news, block_size=b)
    assert [g.output_ids for g in together] == [g.output_ids for g in alone], b
  keys = [k for k in long.compiled.counts if k.startswith("batch_")]
  windows = {k[3] for k in long.compiled._fns if k[0].startswith("batch_")}
  assert windows == {128, "all"}  # rows moved from the first window to all slots
  assert all(long.compiled.counts[k] <= len(window_buckets(256)) for k in keys)
  hlo = long.compiled.program_text(("batch_spec_loop", 4, 3, 128))
  cache_shape = re.compile(r"= f32\[([0-9]+,)?6,(256,8|8,256)\]\{[0-9,]*\} copy\(")
  assert not [line for line in hlo.splitlines() if cache_shape.search(line)]
  assert re.search(r"f32\[6,256,8\]", hlo)  # the pattern names the cache buffers


def test_slot_use_counts_the_idle_slots_of_a_batchs_tail(models, stop_id):
  """`Engine.slot_use`: the share of batched slot time holding a decoding request. On a clock
  where every loop call lasts 1 s, a long request beside short ones leaves its neighbour slot
  idle once they are done: slot use is the decoding rows of each call over its slots, summed,
  below 1; before any batched call it is None."""
  target, drafter = models
  ticks = iter(range(10 ** 6))
  eng = Engine(target, stop_ids=[stop_id], drafter=drafter,
               shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=SIZES),
               batching=BatchOptions(batch_size=2, sync_cycles=4, shrink=False),
               clock=lambda: next(ticks))
  assert eng.slot_use is None
  prompts, _ = _requests(3, seed=7)
  reqs = [eng.batch_request(i, p, m, seed=i, block_size=1)
          for i, (p, m) in enumerate(zip(prompts, [40, 3, 3]))]
  sched, rows = Scheduler(eng, reqs), []
  while sched.busy():
    rows.append(sched.step().rows)
  assert eng.slot_use == pytest.approx(sum(rows) / (2 * len(rows)))
  assert 0.5 <= eng.slot_use < 0.8 and rows.count(1) >= 5, rows
  # `Engine.loop_calls`: the same calls by shape (block 1, 2 slots), 1 s each on this clock,
  # their forwards those the engine counted.
  tally = eng.loop_calls[(1, 2)]
  assert list(eng.loop_calls) == [(1, 2)] and tally.calls == len(rows) == tally.seconds
  assert tally.forwards == sum(eng.forwards_run.values())
  assert tally.ms_per_forward == pytest.approx(1e3 * len(rows) / tally.forwards)


def _loop_rows(engine) -> list[int]:
  """The row counts of the batched loop calls `engine` makes from now on (a spy)."""
  rows, real = [], engine.slots_program

  def spy(block_size, carry, *args, **kw):
    rows.append(int(carry.pos_B.shape[0]))
    return real(block_size, carry, *args, **kw)

  engine.slots_program = spy
  return rows


@pytest.mark.parametrize("b", [1, 4])
def test_a_batchs_tail_runs_in_fewer_slots_and_changes_nothing(models, stop_id, single, b):
  """`BatchOptions.shrink`: once no request waits, the bucket's last requests move into a state
  of 2, then 1 slot (`Engine.slot_sizes` of batch 4), each size compiled once with one resize
  program per change: the same tokens and forwards as without it and as alone, and more of the
  slot time holds a decoding request."""
  prompts, max_news = _requests(11)
  alone = _alone(single, prompts, max_news, [b] * 11)
  on, off = (_engine(models, stop_id, 4, sync_cycles=3, shrink=s) for s in (True, False))
  rows_on, rows_off = _loop_rows(on), _loop_rows(off)
  outs = {e: e.generate_batch(prompts, max_new_tokens=max_news, block_size=b) for e in (on, off)}
  for e in (on, off):
    assert [g.output_ids for g in outs[e]] == [g.output_ids for g in alone]
    assert [g.forward_lengths for g in outs[e]] == [g.forward_lengths for g in alone]
  assert set(rows_off) == {4} and on.slot_sizes() == (4, 2, 1) and off.slot_sizes() == (4,)
  assert rows_on[0] == 4 and min(rows_on) < 4 and rows_on == sorted(rows_on, reverse=True)
  name = "batch_ar_loop" if b == 1 else "batch_spec_loop"
  assert on.compiled.counts[name] == len(set(rows_on)) and off.compiled.counts[name] == 1
  resizes = on.compiled.counts["resize"]
  assert resizes == len(set(rows_on)) - 1 and "resize" not in off.compiled.counts
  assert on.slot_use > off.slot_use
  again = on.generate_batch(prompts, max_new_tokens=max_news, block_size=b)
  assert [g.output_ids for g in again] == [g.output_ids for g in alone]
  assert on.compiled.counts["resize"] == resizes  # nothing new the second time


def test_a_shrunk_bucket_grows_back_when_requests_come(models, stop_id):
  """A server's scheduler: a long request left alone in its bucket decodes in one slot; requests
  that arrive later grow the bucket back to batch_size slots around it (its tokens, caches and
  back-off carried over), and every request gets the tokens it gets alone."""
  eng = _engine(models, stop_id, 4, sync_cycles=2, ar_fallback=4, shrink=True)
  prompts, _ = _requests(6, seed=12)
  max_news = [39, 2, 2, 2, 30, 30]
  one = _engine(models, stop_id, 1, ar_fallback=4)
  alone = _alone(one, prompts, max_news, [4] * 6)
  reqs = [eng.batch_request(i, p, m, seed=i, block_size=4)
          for i, (p, m) in enumerate(zip(prompts, max_news))]
  sched, done = eng.scheduler(track_progress=False), {}
  for req in reqs[:4]:
    sched.submit(req)
  while 0 not in done and len(sched.buckets.get(4).rows if 4 in sched.buckets else ()) != 1:
    done.update(sched.step().finished)
  assert 0 not in done and len(sched.buckets[4].rows) == 1  # the long request, alone
  for req in reqs[4:]:
    sched.submit(req)
  done.update(sched.step().finished)
  assert len(sched.buckets[4].rows) == 4
  while sched.busy():
    done.update(sched.step().finished)
  assert [done[i].output_ids for i in range(6)] == [g.output_ids for g in alone]
  assert ("resize", 1, 4, True, False) in eng.compiled  # grown from one slot back to four
