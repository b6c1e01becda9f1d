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


def test_a_cycle_follows_a_miss_by_the_rows_that_decoded_in_it():
  """The gate reads "after a miss" from the rows the cycle decoded (as the decline's choice
  read them before it), not the rows still decoding after it: a row with a miss that the cycle
  finished still makes it a cycle after a miss."""
  from bp_jax.decoding.controllers import controller_of
  from bp_jax.decoding.options import LoopOptions
  from bp_jax.decoding.state import LoopState
  from bp_jax.models.kv_cache import KVCache
  ctl = controller_of(LoopOptions(block_size=B, controller="priced", ar_fallback=16,
                                  controller_decline=False, **COSTS))
  s = LoopState.empty(jnp.zeros((2, 16), jnp.int32), KVCache.create(1, 2, 16, 1, 4, jnp.float32),
                      evidence_7=evidence.empty_state())
  # Row 0 (one miss before this cycle) finished in it; row 1 (none) decodes on.
  s = s.replace(misses_B=jnp.asarray([1, 0], jnp.int32), done_B=jnp.asarray([True, False]),
                n_gen_B=jnp.asarray([5, 5], jnp.int32), max_new_B=jnp.asarray([9, 9], jnp.int32))
  a_B = jnp.asarray([2, 3], jnp.int32)
  seen = np.asarray(ctl.observed(s, B - 1, a_B).evidence_7)
  after = evidence.observed(jnp.asarray(evidence.empty_state()), B - 1, B, a_B, jnp.bool_(True))
  np.testing.assert_allclose(seen, np.asarray(after))
  not_after = evidence.observed(jnp.asarray(evidence.empty_state()), B - 1, B, a_B,
                                jnp.bool_(False))
  assert not np.allclose(seen, np.asarray(not_after))


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
