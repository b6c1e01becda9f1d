"""The priced back-off's gate (`evidence`, `LoopOptions.controller_persist`): after a miss the
rows take AR steps only while the cycles right after misses commit clearly less than cycles do
on average.

The rule is unit-tested on made-up evidence; the loop on `toy_models.zeros_drafter_pair` with
forced drafts (the target's own tokens, wrong at chosen positions): where wrong positions fall
independently the gated engine takes far fewer AR steps than one whose every miss backs off,
where they come in runs it still backs off, and the outputs are AR's either way.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bp_jax.decode_job.records import backoff_gate_of
from bp_jax.decoding import evidence
from toy_models import toy_engine, toy_requests

B = 4
# A b = 4 cycle costs 0.5 + 2 = 2.5 AR steps: one committing 1 or 2 tokens is a miss.
COSTS = dict(controller_costs="1,1.5,2", controller_draft_cost=0.5, start_backoff=False)


def _seen(cycles) -> jnp.ndarray:
  """The evidence after full cycles given as (accepted drafts per row, after a miss)."""
  state = jnp.asarray(evidence.empty_state())
  for a, after in cycles:
    state = evidence.observed(state, B - 1, B, jnp.asarray(a), jnp.bool_(after))
  return state


def test_misses_persist_until_the_cycles_after_them_commit_as_much_as_the_others():
  assert bool(evidence.persists(jnp.asarray(evidence.empty_state())))  # nothing seen: back off
  every = [([3, 3], False)] * 30  # 4 tokens per row-cycle on average
  # Cycles after misses commit 4 tokens too: a miss says nothing of the next cycle.
  assert not bool(evidence.persists(_seen(every + [([3, 3], True)] * 10)))
  # They commit 1 token (a hard stretch goes on): back off.
  assert bool(evidence.persists(_seen(every + [([0, 0], True)] * 10)))
  # The bar is PERSIST_RATIO of the mean: 3.7 of 4.0-ish lifts it, 3.0 does not.
  assert not bool(evidence.persists(_seen(every * 3 + [([3, 3], True), ([2, 3], True)] * 20)))
  assert bool(evidence.persists(_seen(every * 3 + [([2, 2], True)] * 40)))
  # The prior (2 row-cycles of 1 token) holds the back-off until cycles after misses outweigh it.
  assert bool(evidence.persists(_seen(every + [([3], True)])))


def test_the_evidence_counts_full_cycles_rows_that_committed_and_forgets():
  state = _seen([([3, -1, 1], False)])  # a row that committed nothing (-1) does not count
  np.testing.assert_allclose(np.asarray(state[evidence.PERSIST]), [0, 0, 2, 6])
  state = _seen([([3, -1, 1], False), ([0, 2], True)])
  f = evidence.FORGET
  np.testing.assert_allclose(np.asarray(state[evidence.PERSIST]), [2, 4, 2 * f + 2, 6 * f + 4],
                             rtol=1e-6)
  # A declined cycle (k = 0) and a cycle where no row committed tell nothing; the decline's
  # entries are left alone.
  same = evidence.observed(state, 0, B, jnp.asarray([0, 0]), jnp.bool_(True))
  np.testing.assert_array_equal(np.asarray(same), np.asarray(state))
  same = evidence.observed(state, B - 1, B, jnp.asarray([-1, -1]), jnp.bool_(True))
  np.testing.assert_array_equal(np.asarray(same), np.asarray(state))
  assert np.all(np.asarray(state[evidence.DECLINE]) == 0)


def test_a_row_follows_a_miss_by_its_own_last_full_cycle():
  """The gate reads "after a miss" per row, from the row's own last full cycle
  (`LoopState.missed_B`), not from the batch's back-off: a row whose last cycle committed less
  than its price counts as after a miss whether or not the batch backed off, a row the cycle
  finished still counts, and a declined cycle leaves every row's flag as it was."""
  from bp_jax.decoding.controllers import controller_of
  from bp_jax.decoding.options import LoopOptions
  from bp_jax.decoding.state import LoopState
  from bp_jax.models.kv_cache import KVCache
  ctl = controller_of(LoopOptions(block_size=B, controller="priced", ar_fallback=16,
                                  controller_decline=False, **COSTS))
  s = LoopState.empty(jnp.zeros((3, 16), jnp.int32), KVCache.create(1, 3, 16, 1, 4, jnp.float32),
                      evidence_7=evidence.empty_state())
  # Row 0 missed its last cycle and this cycle finished it; row 1 did not miss; row 2 missed
  # and commits nothing in this cycle. No row's back-off level is above 0 (misses_B).
  s = s.replace(missed_B=jnp.asarray([True, False, True]),
                done_B=jnp.asarray([True, False, False]),
                n_gen_B=jnp.asarray([5, 5, 5], jnp.int32),
                max_new_B=jnp.asarray([9, 9, 9], jnp.int32))
  a_B = jnp.asarray([2, 0, -1], jnp.int32)
  out = ctl.observed(s, B - 1, a_B)
  f = evidence.FORGET
  # Post-miss: row 0 alone (3 tokens); all: rows 0 and 1 (3 + 1 tokens).
  np.testing.assert_allclose(np.asarray(out.evidence_7[evidence.PERSIST]), [1, 3, 2, 4])
  # A b = 4 cycle costs 2.5 AR steps: row 0's 3 tokens are no miss, row 1's 1 token is one,
  # row 2 (no commit) keeps its flag.
  assert np.asarray(out.missed_B).tolist() == [False, True, True]
  again = ctl.observed(out, B - 1, jnp.asarray([3, 3, 3], jnp.int32))
  np.testing.assert_allclose(np.asarray(again.evidence_7[evidence.PERSIST]),
                             [f * 1 + 2, f * 3 + 8, f * 2 + 3, f * 4 + 12], rtol=1e-6)
  assert not np.asarray(again.missed_B).any()
  declined = ctl.observed(out, 0, jnp.asarray([0, 0, 0], jnp.int32))
  assert np.asarray(declined.missed_B).tolist() == [False, True, True]
  np.testing.assert_array_equal(np.asarray(declined.evidence_7), np.asarray(out.evidence_7))


# -- the loop -----------------------------------------------------------------------------------
def _forced(outputs: list[list[int]], wrong) -> list[list[int]]:
  """Each request's AR output as its drafts, with another token at the positions `wrong(i, j)`
  picks (a cycle accepts up to the first such position)."""
  return [[(t % 60) + 1 if wrong(i, j) else t for j, t in enumerate(out)]
          for i, out in enumerate(outputs)]


def test_the_gate_lifts_the_back_off_where_misses_do_not_persist(zeros_models):
  prompts, _ = toy_requests(8, seed=3)
  gated = toy_engine(zeros_models, "priced", **COSTS)
  always = toy_engine(zeros_models, "priced", controller_persist=False, **COSTS)
  ar = [gated.generate(p, max_new_tokens=60, block_size=1).output_ids for p in prompts]
  rng = np.random.default_rng(0)
  independent = rng.random((len(prompts), 60)) < 0.25  # each position wrong with p 1/4
  hard = np.repeat(rng.random((len(prompts), 4)) < 0.5, 15, axis=1)  # 15-token stretches
  steps = {}
  for pattern, wrong in (("independent", independent), ("runs", hard)):
    forced = _forced(ar, lambda i, j: wrong[i, j])
    for name, eng in (("gated", gated), ("always", always)):
      eng.evidence_state = evidence.empty_state()
      outs = [eng.generate(p, max_new_tokens=60, block_size=B, forced_continuation=f)
              for p, f in zip(prompts, forced)]
      assert [g.output_ids for g in outs] == ar
      steps[pattern, name] = sum(g.ar_steps for g in outs)
    gate = backoff_gate_of(gated)
    assert gate["backs_off"] is (pattern == "runs"), (pattern, gate)
  assert steps["independent", "always"] > 40
  assert steps["independent", "gated"] < 0.25 * steps["independent", "always"]
  assert steps["runs", "gated"] > 0.5 * steps["runs", "always"] > 0
  assert backoff_gate_of(always) is None and gated.evidence_state.shape == (evidence.SIZE,)


def test_a_batchs_rows_feed_the_gate_with_their_own_misses(zeros_models):
  """A batch of 4 at an accelerator-like price (a b = 4 cycle 1.05 AR steps) whose drafts go
  wrong independently (each position with p 1/4): a row's cycle accepting no draft is a miss of
  that row, while the batch's (its rows' mean under 1.05 tokens) needs all its decoding rows to
  miss at once. The gate counts every row's cycle after its own miss, so it has seen as many
  post-miss cycles as the rows missed, and they commit about the mean: the outputs are AR's."""
  prompts, _ = toy_requests(8, seed=3)
  cheap = dict(controller_costs="1,1,1", controller_draft_cost=0.05, start_backoff=False)
  eng = toy_engine(zeros_models, "priced", batch_size=4, **cheap)
  ar = [eng.generate(p, max_new_tokens=60, block_size=1).output_ids for p in prompts]
  wrong = np.random.default_rng(0).random((len(prompts), 60)) < 0.25
  forced = _forced(ar, lambda i, j: wrong[i, j])
  eng.evidence_state = evidence.empty_state()
  outs = eng.generate_batch(prompts, max_new_tokens=60, block_size=B,
                            forced_continuations=forced)
  assert [g.output_ids for g in outs] == ar
  after_rows, after_tokens, rows, tokens = np.asarray(eng.evidence_state[evidence.PERSIST])
  # (Counted after the batch's back-offs instead: 11.8 post-miss row-cycles of 2.42 tokens
  # against 2.76 overall, and misses read as persisting.)
  assert after_rows > 20, eng.evidence_state
  assert after_tokens / after_rows > 0.95 * tokens / rows, eng.evidence_state
  assert not bool(evidence.persists(jnp.asarray(eng.evidence_state)))


def test_misses_back_off_where_cycles_lose_on_average_persisting_or_not():
  """Independent acceptances (misses do not persist) but cycles that commit less than their
  price on average: a miss still backs off, as the next cycle is expected to lose too."""
  every = [([1, 1], False)] * 10 + [([1, 1], True)] * 10  # 2 tokens per row-cycle, after or not
  state = _seen(every)
  assert not bool(evidence.persists(state))
  assert bool(evidence.cycles_lose(state, 2.5)) and bool(evidence.backs_off(state, 2.5))
  assert not bool(evidence.cycles_lose(state, 1.5)) and not bool(evidence.backs_off(state, 1.5))
  assert not bool(evidence.cycles_lose(jnp.asarray(evidence.empty_state()), 2.5))


def test_misses_back_off_nothing_where_the_cycles_after_them_pay_several_prices():
  """Misses persist against the mean (cycles after them commit ~2.9 tokens of ~3.5) but those
  cycles commit at least PAYS_MULTIPLE prices: no AR steps at a cheap cycle's price; at a dearer
  one, and before any post-miss cycle outweighs the prior, the back-off holds."""
  state = _seen([([3, 3], False)] * 90 + [([1, 3], True)] * 40)
  after = float(evidence.after_miss_tokens(state))
  assert 2.8 < after < 3.0 and bool(evidence.persists(state))
  cheap, dear = after / evidence.PAYS_MULTIPLE - 0.01, after / evidence.PAYS_MULTIPLE + 0.01
  assert bool(evidence.pays_after_miss(state, cheap)) and not bool(evidence.backs_off(state, cheap))
  assert not bool(evidence.pays_after_miss(state, dear)) and bool(evidence.backs_off(state, dear))
  # The rule before the pay test backs off at any price.
  assert bool(evidence.backs_off(state, cheap, pays_multiple=float("inf")))
  # Nothing seen: the prior (1 token per post-miss cycle) pays no price >= 1 AR step.
  empty = jnp.asarray(evidence.empty_state())
  assert bool(evidence.backs_off(empty, 1.0)) and not bool(evidence.pays_after_miss(empty, 1.0))


def test_the_gate_keeps_the_back_off_where_independent_cycles_lose(zeros_models):
  """Wrong positions independent but frequent (p 0.6: a b = 4 cycle commits ~1.6 tokens against
  its price of 2.5 AR steps): the gated engine backs off as the ungated one does, the same
  tokens as AR."""
  prompts, _ = toy_requests(6, seed=4)
  gated = toy_engine(zeros_models, "priced", **COSTS)
  always = toy_engine(zeros_models, "priced", controller_persist=False, **COSTS)
  ar = [gated.generate(p, max_new_tokens=60, block_size=1).output_ids for p in prompts]
  wrong = np.random.default_rng(1).random((len(prompts), 60)) < 0.6
  forced = _forced(ar, lambda i, j: wrong[i, j])
  steps = {}
  for name, eng in (("gated", gated), ("always", always)):
    eng.evidence_state = evidence.empty_state()
    outs = [eng.generate(p, max_new_tokens=60, block_size=B, forced_continuation=f)
            for p, f in zip(prompts, forced)]
    assert [g.output_ids for g in outs] == ar
    steps[name] = sum(g.ar_steps for g in outs)
  gate = backoff_gate_of(gated)
  assert not gate["misses_persist"] and gate["cycles_lose"] and gate["backs_off"], gate
  assert steps["always"] > 40 and steps["gated"] > 0.8 * steps["always"], steps


def test_the_summary_says_when_cycles_after_misses_pay(zeros_models, capsys):
  """An engine at cheap prices (a b = 4 cycle 1.05 AR steps) whose evidence has misses persist
  (cycles after them commit ~3.25 tokens, cycles 4 on average) but those cycles commit over 3
  prices: the gate lifts the back-off and the decode summary says why."""
  import ml_collections
  from bp_jax.decode_job import records as rec
  eng = toy_engine(zeros_models, "priced", controller_costs="1,1,1", controller_draft_cost=0.05,
                   start_backoff=False)
  state = evidence.empty_state()
  state[evidence.PERSIST] = [100.0, 330.0, 200.0, 800.0]
  eng.evidence_state = state
  gate = backoff_gate_of(eng)
  assert gate["misses_persist"] and gate["cycles_after_misses_pay"] and not gate["backs_off"]
  assert gate["cycle_price"] == 1.05
  record = {"new_tokens": 3, "prefill_s": 0.01, "decode_s": 0.1, "acceptance_lengths": [2],
            "tau": 2.0, "tokens_per_forward": 1.5, "cycles": 1, "ar_steps": 1,
            "forward_verified": [4, 0], "block_size": B, "ids_beyond_tokenizer": 0}
  cfg = ml_collections.ConfigDict(dict(mode="spec", block_policy="fixed", temperature=0.0))
  rec.print_summary(rec.summarize([record], eng, cfg, wall_s=1.0))
  assert ("persist, but the cycles after them pay 3x their price (1.05 AR steps)"
          in capsys.readouterr().out)
