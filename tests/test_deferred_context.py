"""The drafter context of AR steps, added late: the speculative loop keeps an AR step's drafter
inputs aside (`LoopState.pending_BPX`) and writes them into the drafter's context cache before
the next drafter pass, CONTEXT_CHUNK positions at a time. The context a loop call leaves must be
the one a prefill over the same tokens builds, whatever mix of cycles and AR steps made it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.decoding import loops
from bp_jax.decoding.options import LoopOptions
from bp_jax.decoding.sampling import sampling_params
from bp_jax.decoding.state import MAX_ROW_STOP_IDS, LoopState
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.qwen3 import Qwen3

S, V, B_SIZE = 128, 64, 4


def _pair():
  cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=False, max_position_embeddings=S)
  target = Qwen3(cfg, rngs=nnx.Rngs(0))
  layers = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": 2})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=B_SIZE, num_target_layers=3,
                                       mask_token_id=V - 1, target_layer_ids=(0, 2)),
                          rngs=nnx.Rngs(2))
  return target, drafter


@nnx.jit  # one program per length (run eagerly, each operation compiled apart)
def _prefill_context(target, drafter, tokens_1n):
  n = tokens_1n.shape[1]
  out = target(tokens_1n, target.init_cache(1, S), drafter.cfg.target_layer_ids)
  ctx = drafter.add_context(out.layer_hiddens, drafter.init_cache(1, S))
  k, v = ctx.with_lengths(jnp.asarray([n])).as_LBSKH()
  return k[:, 0, :n], v[:, 0, :n]


def _context_of(target, drafter, tokens: list[int]):
  """(k [L, n, K, H], v) of the drafter context a prefill over `tokens` builds."""
  k, v = _prefill_context(target, drafter, jnp.asarray([tokens], jnp.int32))
  return np.asarray(k), np.asarray(v)


@functools.lru_cache(maxsize=None)
def _programs(graph, dgraph):
  """The jitted prefill, slot insertion and batched b=4 loop (every cycle a miss: back-off 2, 4,
  8, 16 AR steps), one of each for the file: a call's budget of forwards is an argument."""
  opts = LoopOptions(block_size=B_SIZE, controller="backoff", ar_fallback=16,
                     ar_fallback_accept=B_SIZE - 1)
  return (jax.jit(loops.make_prefill(graph, dgraph)), jax.jit(loops.make_insert()),
          jax.jit(loops.make_batched_spec_loop(graph, dgraph, opts)))


def _run(target, drafter, sync_cycles: int, max_news: tuple[int, int], min_active: int = 0,
         start: tuple[int, int] = (0, 0)):
  """(the state after one batched loop call over two rows at different positions, their
  prompts); every cycle is a miss (back-off 2, 4, 8, 16 AR steps); each row starts with
  `start` (misses, AR steps)."""
  graph, state = nnx.split(target)
  dgraph, dstate = nnx.split(drafter)
  prefill, insert, spec = _programs(graph, dgraph)
  stop_ids = jnp.asarray([-1], jnp.int32)
  greedy = sampling_params(0.0, 0, 1.0, 0.0)
  s = LoopState.empty(jnp.zeros((2, S), jnp.int32), target.init_cache(2, S),
                      drafter.init_cache(2, S), max_verify=B_SIZE)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, V - 1, n).tolist() for n in (5, 19)]
  for row, (prompt, max_new) in enumerate(zip(prompts, max_news)):
    n = len(prompt)
    toks = jnp.zeros((1, 32), jnp.int32).at[0, :n].set(jnp.asarray(prompt))
    pre = prefill(state, dstate, toks, jnp.int32(n), target.init_cache(1, S),
                  drafter.init_cache(1, S), jax.random.key(row), greedy)
    s = insert(s, jnp.int32(row), pre.cache, pre.draft_cache, pre.first_tok, jnp.int32(n),
               jnp.int32(max_new), jax.random.key(row), stop_ids, greedy,
               jnp.full((MAX_ROW_STOP_IDS,), -1, jnp.int32), jnp.asarray(start, jnp.int32))
  s = spec(state, dstate, s.replace(min_active=jnp.int32(min_active)), stop_ids,
           jnp.int32(sync_cycles))
  assert s.pending_BPX is None
  return s, prompts


def _assert_context_is_the_prefills(target, drafter, s, row: int, prompt: list[int]) -> None:
  ctx = s.draft_cache.stacked()
  k, v = ctx.as_LBSKH()
  pos = int(s.pos_B[row])
  assert int(ctx.lengths[row]) == pos
  tokens = prompt + np.asarray(s.seq_BS[row, len(prompt):pos]).tolist()  # seq: from n on
  want_k, want_v = _context_of(target, drafter, tokens)
  np.testing.assert_allclose(np.asarray(k[:, row, :pos]), want_k, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(v[:, row, :pos]), want_v, atol=2e-5, rtol=2e-5)


def test_context_after_ar_steps_is_the_prefills():
  """Two rows at different positions, every cycle a miss, one call of 35 target forwards: 5
  cycles and AR steps 2, 4, 8, 16 between them (the last run pending as two chunks before the
  5th cycle): each row's
  context cache at slots [0, pos) equals a prefill's over the row's tokens. A flush that
  skipped a chunk, wrote at the wrong slot or never ran fails here (the drafts alone would not
  show it: the output is lossless either way)."""
  target, drafter = _pair()
  s, prompts = _run(target, drafter, 5 + 30, (90, 90))
  counts = np.asarray(s.forward_counts_N)
  assert counts[B_SIZE] == 5 and counts[0] == 2 + 4 + 8 + 16, counts  # batch forwards
  for row, prompt in enumerate(prompts):
    assert int(s.pos_B[row]) >= len(prompt) + 5 + 30
    _assert_context_is_the_prefills(target, drafter, s, row, prompt)


def test_a_call_that_ends_on_ar_steps_adds_their_context():
  """A call that returns after AR steps with no cycle since (here: the other row finished
  during them, `min_active`, so no cycle follows) adds the row's pending context before it
  returns."""
  target, drafter = _pair()
  s, prompts = _run(target, drafter, 0, (24, 90), min_active=2)
  last = int(s.records.forwards_B[1]) - 1
  assert int(s.n_gen_B[0]) >= 24 and not bool(s.records.is_cycle_BS[1, last])
  _assert_context_is_the_prefills(target, drafter, s, 1, prompts[1])


def test_a_call_counts_its_budget_in_target_forwards():
  """`sync_cycles` bounds a call's target forwards, AR steps included: a call of 6 under every
  cycle a miss runs cycle, 2 AR steps, cycle, 2 of the next 4 AR steps, and returns with the
  other 2 still asked for (a run of AR steps does not hold the host for its length) and their
  predecessors' context added."""
  target, drafter = _pair()
  s, prompts = _run(target, drafter, 6, (90, 90))
  counts = np.asarray(s.forward_counts_N)
  assert counts[B_SIZE] == 2 and counts[0] == 4 and counts.sum() == 6, counts
  np.testing.assert_array_equal(np.asarray(s.wait_B), [2, 2])
  for row, prompt in enumerate(prompts):
    _assert_context_is_the_prefills(target, drafter, s, row, prompt)


def test_a_deep_start_keeps_the_context_of_its_ar_steps():
  """A row that starts deep (`start_backoff.StartBackoff`, the cap of 16 AR steps here) takes
  its AR steps before its first cycle, and their context is a prefill's: a deep start longer than
  the cap (64 steps, as before this test) overflowed the loop's room for pending context and
  left the drafter a wrong one (the output stays lossless; the drafts do not)."""
  from bp_jax.decoding.start_backoff import StartBackoff
  target, drafter = _pair()
  starts = StartBackoff(min_cycles=1, explore_every=10 ** 6)
  starts.observe([1])
  start = starts.start(break_even=4.0, cap=16)
  assert start == (4, 16)
  s, prompts = _run(target, drafter, 16 + 1 + 3, (90, 90), start=start)
  is_cycle = np.asarray(s.records.is_cycle_BS[:, :20])
  assert (is_cycle.sum(axis=1) == 1).all() and is_cycle[:, 16].all()  # 16 AR steps, a cycle
  for row, prompt in enumerate(prompts):
    _assert_context_is_the_prefills(target, drafter, s, row, prompt)
