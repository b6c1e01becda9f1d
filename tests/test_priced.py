"""The cost-priced back-off (`--config.controller=priced`, `controllers.Priced`).

A cycle is a miss when it committed fewer tokens than it cost AR steps (drafter pass + verify of
its k+1 tokens, `controller.break_even`): the rule is unit-tested on given costs (dearer verifies
make the same acceptances misses), and the loops on `toy_models.zeros_drafter_pair` (partial
acceptances of every length): outputs equal AR's (greedy; at T > 0 for a seed under exact),
batched rows equal their request alone, one loop per block size, and dearer costs take more AR
steps.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding import controller as control
from bp_jax.decoding.controllers import Priced, controller_of
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.errors import BadInputError
from compile_counting import BackendCompiles
from toy_models import toy_engine
from toy_models import toy_requests as _requests
from toy_models import assert_one_spec_loop, assert_sampled_like_ar

V, MAX_LEN, BUCKETS, B = 64, 128, (16, 32, 64), 4
# A forward over 1, 2, 4 tokens and a drafter pass, in AR steps: a b=4 cycle (3 drafts) costs
# 1.2 AR steps (an accelerator), 4.0 (a CPU), 9.0 (dearer than any cycle can commit: b = 4).
CHEAP = dict(controller_costs="1,1.05,1.1", controller_draft_cost=0.1)
DEAR = dict(controller_costs="1,2,2.5", controller_draft_cost=1.5)
DEAREST = dict(controller_costs="1,3,6", controller_draft_cost=3.0)


def _engine(zeros_models, controller: str = "priced", batch_size: int = 1, **loop) -> Engine:
  return toy_engine(zeros_models, controller, batch_size=batch_size, sync_cycles=2, **loop)


# -- the rule -----------------------------------------------------------------------------------
def test_break_even_is_the_cycle_cost_in_ar_steps():
  assert control.break_even(3, (1.0, 1.05, 1.1), 0.1) == pytest.approx(1.2)
  assert control.break_even(3, (1.0, 2.0, 2.5), 1.5) == pytest.approx(4.0)
  assert control.break_even(1, (1.0, 2.0, 2.5), 1.5) == pytest.approx(3.5)  # 2 tokens verified
  # Costs in another unit: the AR step (a forward over one token) is the unit.
  assert control.break_even(3, (2.0, 4.0, 5.0), 3.0) == pytest.approx(4.0)


def test_dearer_verifies_make_more_cycles_misses():
  """The same acceptances (-1: nothing committed, 0..3 drafts of 3) are misses under dear costs
  and not under cheap ones: the miss rule follows the costs."""
  a_B = jnp.asarray([-1, 0, 1, 2, 3])
  miss = lambda kw: np.asarray(control.below_break_even(a_B, control.break_even(
      3, control.parse_costs(kw["controller_costs"]), kw["controller_draft_cost"]))).tolist()
  assert miss(CHEAP) == [True, True, False, False, False]     # commits 2+ tokens >= 1.2
  assert miss(DEAR) == [True, True, True, True, False]        # commits 4 tokens >= 4.0
  assert miss(DEAREST) == [True] * 5                          # 9.0 > 4: never worth it
  # A cycle committing exactly its cost is as fast as AR: no miss.
  assert not bool(control.below_break_even(jnp.asarray([1]),
                                           control.break_even(1, (1.0, 1.0), 1.0))[0])
  # Through the options: `priced` is the controller in effect with its costs, 64 steps at most.
  opts = LoopOptions(controller="priced", block_size=B, **DEAR).in_effect()
  ctl = controller_of(opts)
  assert isinstance(ctl, Priced) and ctl.cap == control.PRICED_SKIP_CAP == 64
  assert ctl.buckets == (0, B - 1)  # the decline (k = 0) or all drafts
  no_decline = LoopOptions(controller="priced", block_size=B, controller_decline=False, **DEAR)
  assert controller_of(no_decline.in_effect()).buckets == (B - 1,)
  # A batch decides once for all its rows, by the committed rows' mean (2.5 tokens here; -1
  # committed nothing and does not count): a miss at 4.0 AR steps, none at 1.2.
  assert np.asarray(ctl.miss_B(B - 1, a_B, jnp.bool_(True))).tolist() == [True] * 5
  cheap = controller_of(LoopOptions(controller="priced", block_size=B, **CHEAP).in_effect())
  assert np.asarray(cheap.miss_B(B - 1, a_B, jnp.bool_(True))).tolist() == [False] * 5


def test_a_batch_misses_when_its_rows_mean_is_below_the_price():
  batch = lambda a, price: np.asarray(control.batch_below_break_even(
      jnp.asarray(a), jnp.float32(price))).tolist()
  assert batch([3, 2, 2, 2], 4.0) == [True] * 4        # 13 tokens < 4 x 4.0
  assert batch([3, 3, -1], 4.0) == [False] * 3         # 8 tokens = 2 x 4.0: as fast as AR
  assert batch([0, 0, 6, 6], 4.0) == [False] * 4       # the mean, not each row: 16 >= 16
  assert batch([-1, -1], 4.0) == [False] * 2           # nothing committed: no decision
  # One row: the per-row rule.
  for a in range(4):
    assert batch([a], 2.5) == np.asarray(control.below_break_even(jnp.asarray([a]),
                                                                  2.5)).tolist()


def test_priced_needs_costs_and_the_command_line_carries_it():
  assert LoopOptions(controller="priced").needs_costs()
  assert not LoopOptions(controller="priced", **DEAR).needs_costs()
  with pytest.raises(BadInputError, match="controller='priced' has no costs"):
    controller_of(LoopOptions(controller="priced", block_size=B).in_effect())
  opts = loop_options(ml_collections.ConfigDict(dict(controller="priced", ar_fallback=8)))
  assert opts["controller"] == "priced" and opts["ar_fallback"] == 8
  assert opts["controller_costs"] is None and opts["controller_draft_cost"] is None  # measured
  assert LoopOptions(controller="priced", ar_fallback=8).in_effect().ar_fallback == 8


# -- the loops ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [CHEAP, DEAREST, {}])  # DEAR's outputs: test_dearer_costs...
def test_greedy_outputs_are_ar_and_batched_rows_equal_their_request_alone(zeros_models,
                                                                          zeros_ar_outputs, kw):
  one = _engine(zeros_models, **kw)
  prompts, max_news = _requests(6)
  alone = [one.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in alone] == zeros_ar_outputs
  assert one.controller == "priced" and one.costs_source in ({"measured", "cached"} if not kw else {"given"})
  many = _engine(zeros_models, batch_size=3, **kw)
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert [g.output_ids for g in together] == zeros_ar_outputs
  # A speculative loop's untimed first runs (`programs.WARMUP_START`) took AR steps (two: the
  # steps' loop past its first trip) and cycles, alone and in a batch: each
  # part of the loop body has a first-run cost of its own (kernels set up on first use), which
  # a timed call would otherwise pay.
  for eng, name in ((one, "spec_loop"), (many, "batch_spec_loop")):
    runs = [n for key, n in eng.programs.warmup_forwards.items() if key[0] == name]
    assert runs and all(n[0] >= 2 and sum(n[1:]) >= 1 for n in runs), runs
  if not kw:  # measured costs: every loop call updates them (auto), one request or a batch
    # A request of one new token runs no loop call; a plain start's AR loop feeds nothing.
    ran = sum(m > 1 and not g.plain_start for m, g in zip(max_news, alone))
    assert one.cost_estimate["by_batch_size"]["1"]["calls"] == ran
    est = many.cost_estimate
    assert est["online"] is True and est["by_batch_size"]["3"]["calls"] > 0


def test_precompiled_batched_loops_run_their_body_untimed(zeros_models):
  """`precompile(all_windows=True)` warms each batched loop (`LoopPrograms.warm_batched`) on a
  fresh carry, where no row decodes: its untimed first runs make every row decode
  (`programs._warm_args`), so they reach the loop body, whose first run has a fixed cost of its
  own that a request's first timed call paid otherwise; `WARMUP_FORWARDS` forwards each run,
  not the engine's budget. The speculative loops' runs took AR steps and cycles. Each prefill
  program ran once too (`Engine._warm_prefill`): a batch after it meets no first run."""
  from bp_jax.decoding.programs import WARMUP_FORWARDS
  eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=16, **CHEAP)
  eng.precompile([B], all_windows=True)
  runs = eng.programs.warmup_forwards
  spec = [n for key, n in runs.items() if key[0] == "batch_spec_loop"]
  plain = [n for key, n in runs.items() if key[0] == "batch_ar_loop"]
  assert spec and all(n[0] >= 2 and sum(n[1:]) >= 1 and sum(n) <= 2 * WARMUP_FORWARDS
                      for n in spec), spec
  assert plain and all(0 < sum(n) <= WARMUP_FORWARDS for n in plain), plain
  warmed = set(eng._warmed_prefills)
  assert warmed
  prompts, max_news = _requests(6)
  eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert eng._warmed_prefills == warmed


def test_precompile_warm_runs_each_one_request_loop_before_any_request(zeros_models,
                                                                        zeros_ar_outputs):
  """`precompile(warm=True)` at batch 1 (a benchmark's start-up) runs each one-request loop it
  compiles once, for the attention windows of the given request lengths (`LoopPrograms.warm`):
  the speculative loop's runs took AR steps and cycles, the plain loop's (a plain start's)
  steps. The requests after it make no first run of their own (one that first used a loop made
  it, in its wall time) and decode AR's tokens. Without `warm` nothing runs at precompile."""
  prompts, max_news = _requests(6)
  lengths = [len(p) + m for p, m in zip(prompts, max_news)]
  for warm in (True, False):
    eng = _engine(zeros_models, **CHEAP)
    eng.precompile([B], request_lengths=lengths, warm=warm)
    runs = dict(eng.programs.warmup_forwards)
    if not warm:
      assert runs == {}
      continue
    compiled = {key for key in eng.compiled.seconds if key[0] in ("spec_loop", "ar_loop")}
    assert set(runs) == compiled and len(compiled) >= 2, (runs, compiled)
    spec = [n for key, n in runs.items() if key[0] == "spec_loop"]
    plain = [n for key, n in runs.items() if key[0] == "ar_loop"]
    assert spec and all(n[0] >= 2 and sum(n[1:]) >= 1 for n in spec), spec
    assert plain and all(sum(n) > 0 for n in plain), plain
    before = dict(eng.programs.warmup_seconds)
    outs = [eng.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
    assert [g.output_ids for g in outs] == zeros_ar_outputs
    assert eng.programs.warmup_seconds == before
    assert set(eng.compiled.seconds) >= compiled and eng.compiled.counts["spec_loop"] == len(spec)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_dearer_costs_take_more_ar_steps(zeros_models, zeros_ar_outputs, batch_size):
  """The same requests under dearer given costs count more cycles as misses: more AR steps and
  fewer drafter passes, the same tokens; in a batch too (the rows back off together).
  (Where a cycle costs less than an AR step, no cycle is a miss: test_ar_step_tokens.)"""
  prompts, max_news = _requests(6)
  steps, passes = {}, {}
  for name, kw in (("cheap", CHEAP), ("dear", DEAR), ("dearest", DEAREST)):
    eng = _engine(zeros_models, batch_size=batch_size, **kw)
    outs = ([eng.generate(p, max_new_tokens=m, block_size=B) for p, m in zip(prompts, max_news)]
            if batch_size == 1 else
            eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B))
    assert [g.output_ids for g in outs] == zeros_ar_outputs
    steps[name] = sum(g.ar_steps for g in outs)
    passes[name] = sum(g.drafter_passes for g in outs)
  assert steps["cheap"] < steps["dear"] < steps["dearest"]
  assert passes["cheap"] > passes["dear"] > passes["dearest"]


def test_sampled_output_equals_ar_for_a_seed(zeros_models):
  assert_sampled_like_ar(zeros_models, _engine(zeros_models, verify="exact", **DEAR), B)


def test_one_loop_per_block_size(zeros_models):
  assert_one_spec_loop(_engine(zeros_models, **DEAR), B)


def test_priced_is_labelled_as_backoff():
  """Label sets replay back-off's miss rule: `priced` (back-off's loop, misses priced) labels,
  reports and looks up oracle tables as backoff at the same ar_fallback, so its decode settings
  are back-off's; `confidence`, which no label set replays, is still refused."""
  from bp_jax.data.label_sets import decode_settings
  from bp_jax.decode_job.block_choice import labelling_loop_options, loop_options
  from bp_jax.train.labels import labels_stage
  from configs import demo
  cfg = demo.get_config()
  cfg.controller_costs, cfg.controller_draft_cost = "1,2", "1.0"
  settings = {}
  for name in ("backoff", "priced"):
    cfg.controller = name
    assert labelling_loop_options(cfg) == {**loop_options(cfg), "controller": "backoff",
                                           "priced_cap": 0}
    settings[name] = decode_settings(128, 0.0, False, loop_options(cfg))
  assert settings["priced"] == settings["backoff"]
  assert settings["priced"]["controller"] == "backoff" and settings["priced"]["ar_fallback"] == 16
  cfg.controller = "confidence"
  with pytest.raises(BadInputError, match="--config.controller=confidence: label sets"):
    labels_stage(cfg)


# -- where a request starts the back-off (`start_backoff`) --------------------------------------
def test_start_backoff_starts_deep_after_losing_requests_and_explores():
  """Before enough cycles, or when the recent cycles paid, a request drafts first; after
  requests whose cycles committed below 0.8 x the price, it starts with the cap's AR steps and
  the misses after which one more backs off the whole cap; every 4th such request explores
  (drafts first), whether explorers paid or not, and every 16th while the choice stays deep by
  more than 25% below its flip point (τ < 0.8 x 0.8 x the price) as at the last explorer."""
  from bp_jax.decoding.start_backoff import StartBackoff
  starts = StartBackoff()
  assert starts.tau() is None and starts.start(4.0, 16) == (0, 0)  # nothing seen yet
  for _ in range(4):
    starts.observe([2, 1, 3])  # 2 tokens per cycle
  starts.observe([])  # a request without cycles counts for nothing
  assert starts.tau() == pytest.approx(2.0)
  # 2 < 0.8 x 2.6: deep, near the flip point (2 > 0.8 x 0.8 x 2.6): every 4th explores. A deep
  # start waits the cap (16 here), never more: the loop keeps room for that many AR steps'
  # pending drafter context.
  seen = [starts.start(2.6, 16) for _ in range(12)]
  assert seen == ([(4, 16)] * 3 + [(0, 0)]) * 3
  # 2 < 0.8 x 0.8 x 4: clearly deep, as at the last explorer: the 16th deep start explores.
  seen = [starts.start(4.0, 16) for _ in range(24)]
  assert seen == [(4, 16)] * 15 + [(0, 0)] + [(4, 16)] * 8
  # A price that moves toward the flip point (a second process loading the AR steps) is no
  # longer clear: 8 deep starts since the last explorer, so the next start explores.
  assert starts.start(2.6, 16) == (0, 0)
  assert [starts.start(2.6, 16) for _ in range(4)] == [(4, 16)] * 3 + [(0, 0)]
  assert int(control.backoff_steps(jnp.asarray(4 + 1), 16)) == 16  # the next miss: the cap
  assert all(starts.start(4.0, 16, rows=3) == (4, 16) for _ in range(8))  # a batch's: no explorer
  assert starts.start(2.4, 64) == (0, 0)  # 2 >= 0.8 x 2.4: drafting pays about even
  assert starts.start(9.0, 64) == (6, 64)
  for _ in range(8):  # the recent requests' cycles now pay: draft first again
    starts.observe([4, 4])
  assert starts.start(4.0, 16) == (0, 0)
  for _ in range(8):  # and once they lose again, the 4th deep start explores again
    starts.observe([2, 2])
  assert [starts.start(4.0, 16) for _ in range(4)] == [(4, 16)] * 3 + [(0, 0)]


def test_a_request_alone_weighs_the_recent_taus_spread_over_requests():
  """`StartBackoff.tau_upper`: the recent τ plus one standard error over the requests (a ratio
  estimator, each request a cluster of its cycles). Requests alike read their τ; three hard
  prompts among easy ones (T = 0: a prompt's τ says nothing of the next one's) leave the next
  request drafting where the pooled τ alone would start it deep, and a window of hard prompts
  alone still starts deep. `spread_z` 0: the pooled τ, the rule before."""
  import math
  from bp_jax.decoding.start_backoff import StartBackoff
  alike = StartBackoff()
  for _ in range(8):
    alike.observe([2, 2, 2])
  assert alike.tau_upper() == pytest.approx(2.0) and alike.start(4.0, 16) == (4, 16)
  mixed, before = StartBackoff(), StartBackoff(spread_z=0.0)
  easy, hard = [6] * 20, [2] * 6 + [1] * 4  # 120 tokens in 20 cycles; 16 in 10
  for rule in (mixed, before):
    for cycles in [easy] * 5 + [hard] * 3:
      rule.observe(cycles)
  tau = (5 * 120 + 3 * 16) / (5 * 20 + 3 * 10)
  assert mixed.tau() == before.tau() == pytest.approx(tau)  # 4.98
  res = [120 - tau * 20] * 5 + [16 - tau * 10] * 3
  se = math.sqrt(sum(e * e for e in res) / (8 * 7 * (130 / 8) ** 2))
  assert mixed.tau_upper() == pytest.approx(tau + se) and before.tau_upper() == tau
  price = (tau + se / 2) / 0.8  # the pooled τ below 0.8 x the price, within one error of it
  assert before.start(price, 16) == (4, 16) and before.alone_plain_now(price)
  assert mixed.start(price, 16) == (0, 0) and not mixed.alone_plain_now(price)
  assert mixed.start((tau + 2 * se) / 0.8, 16) == (4, 16)  # below by more than its error
  for _ in range(8):  # the window all hard prompts: deep, its spread small
    mixed.observe(hard)
  assert mixed.tau_upper() == pytest.approx(1.6) and mixed.start(price, 16) == (4, 16)


@pytest.mark.parametrize("probes", [False, True])
def test_a_batchs_start_weighs_the_plain_price_with_runs_of_explorers(probes):
  """`batch_plain` (a batch's deep start decodes in the plain AR bucket): a request drafts when
  the recent τ reaches 1.2 x the cycle's price in plain steps; the last run of `rows` requests
  in every 8 takes the other side: drafting where the rule says plain, plain where it says
  draft unless drafting is decisive (τ >= 2 x the price: no plain explorers); one request alone
  keeps its own rule. With `plain_probes` (the default) no request decodes plain where the rule
  says draft: the run's first start asks for a probe (`probe_due`) instead."""
  from bp_jax.decoding.start_backoff import StartBackoff
  starts = StartBackoff(batch_plain=True, plain_probes=probes)
  deep, draft = (4, 16), (0, 0)

  def runs(price: float) -> tuple[list, list[int]]:
    """16 starts at `price`, and those after which a probe was newly due (cleared at each, as
    the plain bucket's next call does)."""
    sides, due = [], []
    for i in range(16):
      sides.append(starts.start(price, 16, rows=2))
      if starts.probe_due:
        due.append(i)
        starts.probe_due = False
    return sides, due

  plain_run = [draft] * 16 if probes else [draft] * 14 + [deep] * 2
  asked = [14] if probes else []
  assert runs(4.0) == (plain_run, asked)  # no τ yet: draft; the 8th run of 2 plain (a probe)
  for _ in range(4):
    starts.observe([4, 5])  # τ 4.5
  assert runs(4.0) == ([deep] * 14 + [draft] * 2, [])  # 4.5 < 1.2 x 4: plain, explorers draft
  assert runs(3.5) == (plain_run, asked)  # 4.5 >= 1.2 x 3.5: draft, explorers plain (a probe)
  assert runs(2.0) == ([draft] * 16, [])  # 4.5 >= 2 x 2: decisive, no plain explorers
  # Alone, its own rule: deep below 0.8 x the price (4.5 >= 0.8 x 4; 4.5 < 0.8 x 6).
  assert starts.start(4.0, 16) == draft and starts.start(6.0, 16) == deep


def test_a_batch_starts_plain_until_the_plain_loop_is_timed():
  """Until the plain loop's step has been timed at the batch size (`plain_priced` False), the
  price is the speculative loop's own, in its dearer AR steps: a batch's request starts plain
  unless drafting is decisive (τ >= 2 x that price); before any τ it drafts."""
  from bp_jax.decoding.start_backoff import StartBackoff
  starts = StartBackoff(batch_plain=True)
  deep, draft = (4, 16), (0, 0)
  assert starts.start(3.0, 16, rows=2, plain_priced=False) == draft  # no τ yet
  for _ in range(4):
    starts.observe([4, 5])  # τ 4.5
  # 4.5 >= 1.2 x 3: the rule would draft, but the plain loop is not timed yet (4.5 < 2 x 3)
  assert starts.start(3.0, 16, rows=2, plain_priced=False) == deep
  assert starts.batch_plain_now(3.0, plain_priced=False) and not starts.batch_plain_now(3.0)
  assert starts.start(3.0, 16, rows=2) == draft  # timed: the rule's own margin
  starts.batch_plain_first = False  # the rule before: the loop's own price as if in plain steps
  assert starts.start(3.0, 16, rows=2, plain_priced=False) == draft
  starts.batch_plain_first = True
  assert starts.start(2.0, 16, rows=2, plain_priced=False) == draft  # 4.5 >= 2 x 2: decisive
  assert starts.start(5.0, 16, plain_priced=False) == draft  # alone: its own rule (4.5 >= 0.8 x 5)


def test_a_batchs_start_before_the_plain_loop_is_timed_weighs_the_start_up_forward(
    zeros_models):
  """`StartBackoff.forward_prior`: where the engine measured a one-token forward at its batch
  size (1 ms) and the speculative loop's calls priced a cycle (1.2 ms), a batch's rule weighs
  the cycle in that forward, at its own margin (1.2), until the plain loop is timed: τ 2
  against a price of 1.2 drafts. Without the switch, without such a forward (one measured at
  another size does not count), or before the loop's calls priced the cycle (the start-up
  costs time forwards alone), the plain loop is not priced: plain unless drafting is decisive
  (2 x 1.2 > 2)."""
  counts = np.zeros(B + 1, np.int64)
  counts[0], counts[B] = 2, 10
  for prior, floor_rows, calls, plain in ((True, 2, 12, False), (False, 2, 12, True),
                                          (True, 4, 12, True), (True, 2, 0, True)):
    eng = toy_engine(zeros_models, "priced", batch_size=2, online_costs=True, **CHEAP)
    eng.starts.forward_prior = prior
    eng.prices.set_ar_step_floor(1e-3, floor_rows)
    for _ in range(calls):  # AR steps of 1 ms, cycles of 1.2 ms
      eng.prices.observe(2 * 1e-3 + 10 * 1.2e-3, counts, rows=2)
    for _ in range(4):
      eng.starts.observe([2, 2])
    choice = eng.start_choice(B)
    assert choice.tau == pytest.approx(2.0) and choice.price == pytest.approx(1.2, rel=1e-5)
    assert choice.plain == plain, (prior, floor_rows, calls)
    assert eng.start_priced(B) == (not plain)
    assert eng.plain_seconds(10, 2) is None  # the plain loop is not timed
    forward = prior and floor_rows == 2
    assert eng.plain_seconds(10, 2, prior=True) == (pytest.approx(0.01) if forward else None)


def test_a_batch_weighs_its_prior_tau_until_it_has_seen_cycles():
  """`batch_prior_tau` (a learned policy's expectation, `Engine.batch_prior_tau`): a batch's
  rule weighs it before `min_cycles` cycles were seen (so a cold batch starts plain where the
  prices say drafting is not decisive, rather than drafting first), the recent cycles' τ once
  they were; `batch_tau` and `batch_plain_now` say the same; one request alone ignores it and
  drafts first, as before any τ."""
  from bp_jax.decoding.start_backoff import StartBackoff
  deep, draft = (4, 16), (0, 0)
  starts = StartBackoff(batch_plain=True, batch_prior_tau=4.3)
  assert starts.tau() is None and starts.batch_tau() == 4.3
  # 4.3 < 2 x 3 (the plain loop not timed yet): plain; timed, 4.3 >= 1.2 x 3: drafting.
  assert starts.start(3.0, 16, rows=2, plain_priced=False) == deep
  assert starts.batch_plain_now(3.0, plain_priced=False) and not starts.batch_plain_now(3.0)
  assert starts.start(3.0, 16, rows=2) == draft
  assert starts.start(6.0, 16) == draft  # alone: no τ yet, it drafts first
  assert StartBackoff(batch_plain=True).start(3.0, 16, rows=2, plain_priced=False) == draft
  for _ in range(4):
    starts.observe([8, 8])  # τ 8 seen: it replaces the prior
  assert starts.batch_tau() == 8.0
  assert starts.start(3.0, 16, rows=2, plain_priced=False) == draft  # 8 >= 2 x 3: decisive


def test_an_explorer_run_moves_plain_after_a_short_first_call(zeros_models, monkeypatch):
  """Where the start rule says plain (recent τ 3 against a cycle priced at 100 plain steps,
  `OnlineCosts.start_break_even`: the plain loop far cheaper than the speculative loop's AR
  steps; cheap costs, so no cycle misses against those), requests start plain and the
  4th-6th are an explorer run (`StartBackoff.batch_explore_every` 2 runs of 3). Its first call
  runs `scheduler.VERDICT_FORWARDS` (4) forwards, not the engine's 16, after which its rows,
  whose own cycles say plain (`Engine.cycles_lose`), move to the plain bucket: 4 cycles each,
  their cycles reaching the start rule at once. With the engine's whole budget they draft
  15-16 cycles first (where these 60-token requests end or move); without
  `StartBackoff.batch_move` nothing misses, so they draft to their end. AR's very tokens every
  way."""
  from bp_jax.decoding import scheduler
  prompts, _ = _requests(6)
  max_news = [60] * 6
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, max_news)]
  runs = {}
  for verdict, move in ((scheduler.VERDICT_FORWARDS, True), (16, True),
                        (scheduler.VERDICT_FORWARDS, False)):
    monkeypatch.setattr(scheduler, "VERDICT_FORWARDS", verdict)
    eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=16, **CHEAP)
    eng.prices.start_break_even = lambda n, rows, *_: 100.0
    eng.starts.batch_explore_every, eng.starts.batch_move = 2, move
    for _ in range(4):
      eng.starts.observe([3, 3])
    outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
    assert [g.output_ids for g in outs] == want
    assert [g.plain_start for g in outs] == [True] * 3 + [False] * 3
    runs[verdict, move] = outs[3:]
    if (verdict, move) == (4, True):
      assert len(eng.starts._recent) == 4 + 3  # the moved rows' cycles, once each
  short, whole, stay = runs[4, True], runs[16, True], runs[4, False]
  assert all(g.moved_plain and g.cycles == g.drafter_passes == 4 and g.ar_steps > 0
             for g in short), [(g.moved_plain, g.cycles) for g in short]
  assert all(g.cycles >= 15 for g in whole)
  assert not any(g.moved_plain for g in stay) and all(g.cycles >= 15 for g in stay)


def test_a_static_batchs_tail_moves_plain_all_together(zeros_models):
  """A static batch (as many requests as slots: no request waits, a tail from its start)
  whose slowest row would end sooner in the plain loop (`StartBackoff.tail_loses`; here a cycle
  priced at 100 plain steps, `Engine.tail_price`) moves all its decoding rows to the plain
  bucket after its first call, though none is an explorer and no cycle misses (cheap costs);
  with `StartBackoff.tail_move` off, or with requests still waiting, they draft to their end.
  AR's very tokens every way."""
  prompts, _ = _requests(6)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for tail_move, n in ((True, 3), (False, 3), (True, 6)):
    eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=16, **CHEAP)
    eng.prices.start_break_even = lambda n, rows, *_: 1.0  # every request drafts
    assert eng.tail_price(B, 3) is None  # the plain loop not timed at 3 rows yet
    priced_at = []
    eng.starts.tail_move = tail_move  # (the stub as `tail_price`: None with it off)
    eng.tail_price = lambda b, slots: (priced_at.append(slots) or 100.0) if tail_move else None
    for _ in range(4):
      eng.starts.observe([3, 3])
    outs = eng.generate_batch(prompts[:n], max_new_tokens=60, block_size=B)
    assert [g.output_ids for g in outs] == want[:n]
    assert not any(g.plain_start for g in outs)
    moved = [g.moved_plain for g in outs]
    if tail_move and n == 3:
      assert moved == [True] * 3 and priced_at == [3], (moved, priced_at)
      # moved after the first call's 16 forwards
      assert all(g.cycles <= 16 and g.ar_steps > 0 for g in outs), [g.cycles for g in outs]
    else:  # off; or the first 3 while the last 3 waited, which end in the call they join
      assert not any(moved) and priced_at == [] and all(g.cycles >= 15 for g in outs), (
          moved, priced_at)


def test_a_servers_tail_moves_plain_only_where_no_request_is_expected_before_it_ends(
    zeros_models):
  """A scheduler stepped as a server steps it (`submit`, `step`): requests may come after its
  tail moved plain, and a request that then drafts runs by turns with the moved rows. The tail
  moves only while fewer than `StartBackoff.tail_quiet` requests are expected to arrive before
  the plain loop would end it: the latest submits' rate (on the engine's clock) x the plain
  loop's time for the longest row's tokens left. Requests 100 s apart on a plain step of 10 ms
  (0.006 expected over 60 steps): the tail moves, as a static batch's does; 0.1 s apart (6
  expected): it drafts to its end, unless arrivals are not weighed (tail_quiet inf). AR's
  very tokens every way."""
  prompts, _ = _requests(3)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for gap_s, quiet, moves in ((100.0, None, True), (0.1, None, False), (0.1, np.inf, True)):
    eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=16, **CHEAP)
    eng.prices.start_break_even = lambda n, rows, *_: 1.0  # every request drafts
    eng.tail_price = lambda b, slots: 100.0            # the tail loses by far
    eng.plain_seconds = lambda steps, slots, *_: steps * 0.01
    if quiet is not None:
      eng.starts.tail_quiet = quiet
    for _ in range(4):
      eng.starts.observe([3, 3])
    now = [0.0]
    eng.clock = lambda: now[0]
    sched = eng.scheduler(track_progress=False)
    for i, p in enumerate(prompts):
      now[0] = i * gap_s
      sched.submit(eng.batch_request(i, p, 60, block_size=B))
    while sched.busy():
      assert not sched.step().failed
    outs = [sched.results[i] for i in range(3)]
    assert [g.output_ids for g in outs] == want
    assert [g.moved_plain for g in outs] == [moves] * 3, (gap_s, quiet)
  sched = eng.scheduler()
  for i, p in enumerate(prompts):  # all at one instant
    sched.submit(eng.batch_request(i, p, 60, block_size=B))
  assert sched._arrival_rate() == np.inf
  sched.closed = True  # as `run` (generate_batch) sets it: every request was given up front
  assert sched._arrival_rate() == 0.0


def _join_engine(zeros_models, join: bool, price) -> Engine:
  """A batch-3 priced engine whose start rule weighs the recent τ 3 against `price()` plain
  steps, with no explorers of its own and no tail moves, `StartBackoff.join_live` = `join`."""
  eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=4, **CHEAP)
  eng.starts.batch_explore_every = eng.starts.batch_explore_max = 10**6
  eng.starts.join_live = join
  eng.tail_price = lambda b, slots: None
  eng.prices.start_break_even = lambda n, rows, *_: price()
  for _ in range(4):
    eng.starts.observe([3, 3])
  return eng


def _second_request(eng: Engine, sched, prompts, closed: bool) -> list:
  """Request 1 submitted to `sched` (`closed` as `run` sets it, or not), both requests decoded
  to their ends: their Generations."""
  sched.closed = closed
  sched.submit(eng.batch_request(1, prompts[1], 60, block_size=B))
  while sched.busy():
    assert not sched.step().failed
  return [sched.results[i] for i in range(2)]


def test_a_servers_request_routed_plain_drafts_in_the_running_bucket_instead(zeros_models):
  """`StartBackoff.join_live`: a server's request that the start rule routes plain while its
  speculative bucket holds a request drafting by the rule and the plain bucket none drafts in
  that bucket instead (a plain start would open a second bucket, run by turns with the first).
  With the switch off, with every request given up front (`Scheduler.closed`, as `run` sets
  it), or where the bucket holds only an explorer (drafting where the rule says it loses), it
  starts plain. AR's very tokens every way."""
  import dataclasses
  prompts, _ = _requests(2)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for join, closed, explorer in ((True, False, False), (False, False, False),
                                 (True, True, False), (True, False, True)):
    price = [1.0]
    eng = _join_engine(zeros_models, join, lambda: price[0])
    sched = eng.scheduler(track_progress=False)
    sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
    sched.step()  # request 0 drafts: its bucket holds it
    assert sched.occupancy() == {B: 1}
    if explorer:  # as if it drafted as an explorer where the rule said plain
      row = sched.buckets[B].rows[0]
      row.route = dataclasses.replace(row.route, explorer=True)
    price[0] = 100.0  # the start rule now says plain
    outs = _second_request(eng, sched, prompts, closed)
    assert [g.output_ids for g in outs] == want
    assert outs[1].plain_start == (not join or closed or explorer), (join, closed, explorer)
    assert not outs[0].plain_start and not outs[1].moved_plain
    if not outs[1].plain_start:  # joined: no plain bucket's slots were made
      assert 1 not in sched.buckets


def test_a_servers_drafting_explorer_decodes_plain_beside_a_busy_plain_bucket(zeros_models):
  """`StartBackoff.join_live`, the other way: a server's explorer that would draft (the rule
  says plain) while the plain bucket holds a request and its own bucket none decodes plain
  instead (its run would open a second bucket beside a busy plain one). With the switch off, or
  in `run` (`Scheduler.closed`), it drafts. AR's very tokens every way."""
  prompts, _ = _requests(2)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for join, closed in ((True, False), (False, False), (True, True)):
    eng = _join_engine(zeros_models, join, lambda: 100.0)  # plain by the rule
    sched = eng.scheduler(track_progress=False)
    sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
    sched.step()  # request 0 starts plain: the plain bucket holds it
    assert sched.occupancy() == {1: 1}
    eng.request_start = lambda b, rows=1: (0, 0)  # the next one drafts, an explorer
    eng.starts.last_explored = True
    outs = _second_request(eng, sched, prompts, closed)
    assert [g.output_ids for g in outs] == want
    assert outs[0].plain_start
    assert outs[1].plain_start == (join and not closed), (join, closed)


@pytest.mark.parametrize("probes", [True, False])
def test_a_batch_times_its_plain_side_by_a_probe_not_by_requests_decoding_plain(
    zeros_models, zeros_ar_outputs, probes):
  """`StartBackoff.plain_probes`: a batch of 3 whose rule drafts (τ 3 against 1.2 x 2 plain
  steps, not decisive: 3 < 2 x 2) reaches its explorer check at the 4th request
  (`batch_explore_every` 2). With probes (the default) no request decodes plain: after the
  next full-size speculative call one call of `PROBE_STEPS` plain steps (at most a call's
  `sync_cycles`) runs on copies of that
  call's decoding rows (its forwards counted, its time booked as the plain loop's at batch size
  3), and the rows decode on as they were: AR's very tokens, the plain bucket empty after it.
  Without them, the 4th-6th requests decode plain (an explorer run). Either way the probe, or
  the run's plain calls, clear `probe_due`."""
  from bp_jax.decoding.scheduler import PROBE_STEPS
  prompts, max_news = _requests(6)
  eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=2, move_plain_after=0,
                   online_costs=True, **CHEAP)  # no move on streaks of misses (timed prices)
  eng.starts.plain_probes = probes
  eng.starts.batch_explore_every = 2
  eng.starts.tail_move = False
  eng.prices.start_break_even = lambda n, rows, *_: 2.0
  eng._start_priced = lambda b, rows: True  # the rule weighs plain steps at its own margin
  for _ in range(4):
    eng.starts.observe([3, 3])
  sched = eng.scheduler(track_progress=False)
  for i, (p, m) in enumerate(zip(prompts, max_news)):
    sched.submit(eng.batch_request(i, p, m, block_size=B))
  sched.closed = True  # every request given up front, as `run` has them
  while sched.busy():
    assert not sched.step().failed
  outs = [sched.results[i] for i in range(6)]
  assert [g.output_ids for g in outs] == zeros_ar_outputs
  plain = [g.plain_start for g in outs]
  assert plain == ([False] * 6 if probes else [False] * 3 + [True] * 3), plain
  assert eng.plain_probes == (1 if probes else 0)
  assert not eng.starts.probe_due
  tally = eng.loop_calls[(1, 3)]
  assert tally.calls >= 1
  if probes:
    assert (tally.calls, tally.forwards) == (1, min(PROBE_STEPS, eng.sync_cycles))
    assert eng.prices.plain_step_s(3) is not None
    assert sched.buckets[1].live() == 0
    assert all(g.cycles > 0 for g in outs[3:])  # the run that would have decoded plain drafted


@pytest.mark.parametrize("compiled, untimed", [(True, True), (True, False), (False, True)])
def test_an_untimed_plain_loop_is_probed_where_it_is_compiled(
    zeros_models, zeros_ar_outputs, compiled, untimed):
  """`StartBackoff.probe_untimed`: a batch of 3 whose rule drafts (τ 3 against 1.2 x 2 plain
  steps) and whose plain loop is untimed, no probe due (no explorer run begins within 3
  requests). Where that loop is compiled for every window (as `precompile(all_windows=True)`
  compiles it), one probe runs after the first full-size speculative call and times the plain
  step, so the start-up forward prices it no longer. Not compiled, or the switch off: no probe,
  the plain step untimed. AR's very tokens, no request plain, every way."""
  from bp_jax.decoding.programs import window_buckets
  from bp_jax.decoding.sampling import SamplingForm
  prompts, max_news = (x[:3] for x in _requests(6))  # `zeros_ar_outputs`' first three
  eng = toy_engine(zeros_models, "priced", batch_size=3, sync_cycles=2, move_plain_after=0,
                   online_costs=True, **CHEAP)
  eng.starts.probe_untimed = untimed
  eng.starts.tail_move = False
  eng.prices.start_break_even = lambda n, rows, *_: 2.0
  eng._start_priced = lambda b, rows: True
  for _ in range(4):
    eng.starts.observe([3, 3])
  if compiled:  # the plain loop of every window a call may pick, as a server's start-up
    for w in window_buckets(eng.max_len):
      eng.slots_program(1, eng.slot_carry(1, compiled=False),
                        max_pos=max(0, w - 1 - eng.sync_cycles // 2), form=SamplingForm.GREEDY)
  assert eng.plain_probe_untimed(B) == (untimed and compiled)
  sched = eng.scheduler(track_progress=False)
  for i, (p, m) in enumerate(zip(prompts, max_news)):
    sched.submit(eng.batch_request(i, p, m, block_size=B))
  sched.closed = True
  while sched.busy():
    assert not sched.step().failed
  outs = [sched.results[i] for i in range(3)]
  assert [g.output_ids for g in outs] == zeros_ar_outputs[:3]
  assert not any(g.plain_start for g in outs)
  probed = compiled and untimed
  assert eng.plain_probes == int(probed), (compiled, untimed)
  assert (eng.prices.plain_step_s(3) is not None) == probed
  assert not eng.plain_probe_untimed(B)  # probed: timed now; else untimed but not compiled
  assert (1 in sched.buckets) == probed and all(b.live() == 0 for b in sched.buckets.values())


def test_a_servers_probe_waits_for_a_lull(zeros_models):
  """`Scheduler._busy_within`: a server's due probe (`StartBackoff.probe_due`) runs only while
  fewer than `StartBackoff.tail_quiet` requests are expected to arrive within a request's
  decode (its 60 tokens) in the plain loop: submits 1000 s apart on a plain step of 1 s, it
  runs after the second request's first call (0.06 expected); 0.1 s apart it waits to the end
  (600 expected), unless the switch is off or every request was given up front
  (`Scheduler.closed`). AR's very tokens every way, the probe or not."""
  prompts, _ = _requests(2)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for gap_s, lulls, closed, probes in ((1000.0, True, False, 1), (0.1, True, False, 0),
                                       (0.1, False, False, 1), (0.1, True, True, 1)):
    eng = _join_engine(zeros_models, True, lambda: 1.0)  # the rule says draft
    eng.starts.explore_lulls = lulls
    eng.plain_seconds = lambda steps, slots, *_: steps * 1.0
    eng.plain_probe_due = lambda b: eng.starts.probe_due  # (its prices are not timed)
    now = [0.0]
    eng.clock = lambda: now[0]
    sched = eng.scheduler(track_progress=False)
    sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
    while sched.busy():
      assert not sched.step().failed
    now[0] = gap_s
    eng.starts.probe_due = True
    outs = _second_request(eng, sched, prompts, closed)
    assert [g.output_ids for g in outs] == want
    assert eng.plain_probes == probes, (gap_s, lulls, closed)
    assert eng.starts.probe_due == (probes == 0)  # (the probe's plain call clears it)


def test_a_servers_plain_explorer_opens_the_plain_bucket_only_in_a_lull(zeros_models):
  """`StartBackoff.explore_lulls`: a server's plain explorer (a run decoding plain where the
  rule says draft) with both buckets idle opens the plain bucket only while fewer than
  `StartBackoff.tail_quiet` requests are expected to arrive before it would end there (the
  latest submits' rate x the plain loop's time for its tokens); else it drafts, as the requests
  that would come do (the two buckets would run by turns). Submits 100 s apart on a plain step
  of 10 ms (0.006 expected over 60 steps): it decodes plain; 0.1 s apart (6 expected): it
  drafts, unless the switch is off, every request was given up front (`Scheduler.closed`), or
  the start rule has no plain step's price, timed or the start-up forward's (an explorer there
  is what prices it). AR's very tokens every way."""
  prompts, _ = _requests(2)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for gap_s, lulls, closed, timed, plain in ((100.0, True, False, True, True),
                                             (0.1, True, False, True, False),
                                             (0.1, False, False, True, True),
                                             (0.1, True, True, True, True),
                                             (0.1, True, False, False, True)):
    eng = _join_engine(zeros_models, True, lambda: 1.0)  # the rule says draft
    eng.starts.explore_lulls = lulls
    eng.plain_seconds = lambda steps, slots, *_: steps * 0.01
    eng.start_priced = lambda b, t=timed: t  # the rule has a plain step's price (or not)
    now = [0.0]
    eng.clock = lambda: now[0]
    sched = eng.scheduler(track_progress=False)
    sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
    while sched.busy():  # request 0 drafts to its end: both buckets idle
      assert not sched.step().failed
    now[0] = gap_s
    eng.request_start = lambda b, rows=1: (6, 64)  # the next one starts plain, an explorer
    eng.starts.last_explored = True
    outs = _second_request(eng, sched, prompts, closed)
    assert [g.output_ids for g in outs] == want
    assert not outs[0].plain_start
    assert outs[1].plain_start == plain, (gap_s, lulls, closed, timed)


def test_a_servers_request_routed_plain_waits_for_a_full_running_bucket(zeros_models):
  """`StartBackoff.join_live` where the running speculative bucket is full: a server's request
  routed plain waits for that bucket's next free slot and drafts there, as a drafting request
  would, rather than open the plain bucket beside it (run by turns: batch 8, T = 1, load 8 on an
  H200's simulated clock, 49 of 71 calls left two buckets holding requests). With the switch
  off, it starts plain at once. AR's very tokens every way."""
  prompts, _ = _requests(4)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for join in (True, False):
    price = [1.0]
    eng = _join_engine(zeros_models, join, lambda: price[0])
    sched = eng.scheduler(track_progress=False)
    for i in range(3):
      sched.submit(eng.batch_request(i, prompts[i], 60, block_size=B))
    sched.step()  # the three draft: their bucket is full
    assert sched.occupancy() == {B: 3}
    price[0] = 100.0  # the start rule now says plain
    sched.submit(eng.batch_request(3, prompts[3], 60, block_size=B))
    while sched.busy():
      assert not sched.step().failed
    outs = [sched.results[i] for i in range(4)]
    assert [g.output_ids for g in outs] == want
    assert outs[3].plain_start == (not join), join
    assert (1 in sched.buckets) == (not join), join  # joined: no plain bucket was made


def test_a_servers_draining_bucket_runs_before_the_fuller_one(zeros_models):
  """`StartBackoff.drain_first`: where a server's plain bucket holds requests beside a
  speculative one and the start rule routes new requests to draft, the plain bucket runs first
  (it only drains: its calls delay the drafting rows as long whenever they run; each drafting
  call before them adds to its own rows' wait). A request decoding plain, then two drafting
  beside it (the rule now says draft): the plain bucket runs until its request ends, then the
  speculative one. With the switch off, or in `run` (`Scheduler.closed`), the fuller bucket
  runs first; so it does the other way (a drafting request, then two plain beside it: the rule
  says plain, and a speculative bucket there holds explorers or rows from before the rule
  turned). AR's very tokens every way."""
  prompts, _ = _requests(3)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=60).output_ids for p in prompts]
  for drain, closed in ((True, False), (False, False), (True, True)):
    price = [100.0]
    eng = _join_engine(zeros_models, True, lambda: price[0])
    eng.starts.drain_first = drain
    sched = eng.scheduler(track_progress=False)
    sched.closed = closed
    sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
    sched.step()  # request 0 starts plain
    assert sched.occupancy() == {1: 1}
    price[0] = 1.0  # the start rule now says draft
    for i in (1, 2):
      sched.submit(eng.batch_request(i, prompts[i], 60, block_size=B))
    ran, done_at = [], None
    while sched.busy():
      report = sched.step()
      assert not report.failed
      ran.append(report.ran)
      if 0 in report.finished:
        done_at = len(ran)
    outs = [sched.results[i] for i in range(3)]
    assert [g.output_ids for g in outs] == want
    assert outs[0].plain_start and not outs[1].plain_start and not outs[2].plain_start
    if drain and not closed:
      assert ran[:done_at] == [1] * done_at and B in ran[done_at:], ran
    else:
      assert ran[0] == B and 1 in ran[ran.index(B):], ran
  price = [1.0]
  eng = _join_engine(zeros_models, False, lambda: price[0])  # (joined, they would draft)
  sched = eng.scheduler(track_progress=False)
  sched.submit(eng.batch_request(0, prompts[0], 60, block_size=B))
  sched.step()  # request 0 drafts
  price[0] = 100.0  # the start rule now says plain
  for i in (1, 2):
    sched.submit(eng.batch_request(i, prompts[i], 60, block_size=B))
  report = sched.step()
  assert sched.occupancy() == {B: 1, 1: 2} and report.ran == 1  # the fuller: plain
  while sched.busy():
    assert not sched.step().failed
  assert [sched.results[i].output_ids for i in range(3)] == want


def test_a_servers_row_moves_on_missed_cycles_only_where_its_switches_and_cycles_say(
    zeros_models):
  """`StartBackoff.server_streaks` and `misses_judged`: a server's rows whose cycles missed
  `move_plain_after` times in a row (the dearest costs: every cycle misses) stay in their
  speculative bucket (their plain calls would delay the drafting rows and the requests still
  to come); with `server_streaks` they move plain only where their own cycles so far also say
  plain (`Engine.cycles_lose`, here forced either way): a streak of misses is more often a hard
  stretch of the text than a request that loses; with `misses_judged` off too, on the streak
  alone. In `run` (`Scheduler.closed`) the streak moves them either way. AR's very tokens every
  way."""
  prompts, _ = _requests(3)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=70).output_ids for p in prompts]
  for streaks, judged, closed, lose, moves in ((True, True, False, False, False),
                                               (True, True, False, True, True),
                                               (True, False, False, False, True),
                                               (False, True, False, True, False),
                                               (False, False, False, True, False),
                                               (False, True, True, False, True)):
    eng = _engine(zeros_models, batch_size=3, move_plain_after=3, **DEAREST)
    eng.starts.server_streaks = streaks
    eng.starts.misses_judged = judged
    eng.cycles_lose = lambda b, acceptance_lengths: lose
    eng.tail_price = lambda b, slots: None  # no tail moves
    sched = eng.scheduler(track_progress=False)
    sched.closed = closed
    for i, p in enumerate(prompts):
      sched.submit(eng.batch_request(i, p, 70, block_size=B))
    while sched.busy():
      assert not sched.step().failed
    outs = [sched.results[i] for i in range(3)]
    assert [g.output_ids for g in outs] == want
    assert not any(g.plain_start for g in outs)
    assert any(g.moved_plain for g in outs) == moves, (streaks, judged, closed, lose)


def test_a_servers_move_of_some_rows_opens_no_second_bucket(zeros_models):
  """`StartBackoff.join_live` for moves: a server's explorer whose own cycles say plain stays in
  its speculative bucket while a request drafting by the rule runs there and the plain bucket
  holds none (on a device it rides in calls that run anyway; the plain bucket's would delay the
  drafting rows). With the switch off, or in `run` (`Scheduler.closed`), it moves. AR's very
  tokens every way."""
  import dataclasses
  prompts, _ = _requests(2)
  news = (80, 40)  # request 0 decodes beyond request 1's end: a move of 1 alone is a subset
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  want = [ar.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, news)]
  for join, closed in ((True, False), (False, False), (True, True)):
    eng = _join_engine(zeros_models, join, lambda: 1.0)  # both draft by the rule
    eng.cycles_lose = lambda b, acceptance_lengths: True  # an explorer's cycles say plain
    sched = eng.scheduler(track_progress=False)
    sched.closed = closed
    for i in (0, 1):
      sched.submit(eng.batch_request(i, prompts[i], news[i], block_size=B))
    sched.step()
    assert sched.occupancy() == {B: 2}
    row = sched.buckets[B].rows[1]  # request 1 as if an explorer drafting where the rule said plain
    row.route = dataclasses.replace(row.route, explorer=True)
    while sched.busy():
      assert not sched.step().failed
    outs = [sched.results[i] for i in range(2)]
    assert [g.output_ids for g in outs] == want
    assert not outs[0].moved_plain
    assert outs[1].moved_plain == (not join or closed), (join, closed)
    if join and not closed:
      assert 1 not in sched.buckets  # no plain bucket was made


def test_a_batchs_own_cycles_say_whether_its_drafting_rows_move_plain():
  """`StartBackoff.batch_cycles_lose`: a speculative bucket's rows' own cycles, weighed by the
  batch's rule (plain below `batch_margin` x the price; before the plain loop is timed, below
  `DECISIVE` x the speculative loop's own), never on fewer than `min_cycles` cycles, nor without
  `batch_move`; the recent requests' τ and the prior do not enter."""
  from bp_jax.decoding.start_backoff import StartBackoff
  starts = StartBackoff(batch_plain=True, batch_prior_tau=9.0)
  for _ in range(4):
    starts.observe([8, 8])  # recent τ 8: a new request would draft at a price of 5
  assert not starts.batch_plain_now(5.0)
  assert starts.batch_cycles_lose([5] * 8, 5.0)        # 5 < 1.2 x 5
  assert not starts.batch_cycles_lose([6] * 8, 5.0)    # 6 >= 1.2 x 5
  assert not starts.batch_cycles_lose([1] * 7, 5.0)    # too few cycles to tell
  assert starts.batch_cycles_lose([5] * 8, 3.0, plain_priced=False)  # 5 < 2 x 3
  assert not starts.batch_cycles_lose([7] * 8, 3.0, plain_priced=False)
  starts.batch_move = False
  assert not starts.batch_cycles_lose([1] * 64, 5.0)


def test_a_batchs_tail_moves_plain_where_its_slowest_row_ends_sooner_there():
  """`StartBackoff.tail_loses`: a tail's time is its slowest row's. It weighs the most tokens
  any row has left (plain steps) against the longest row drafting (tokens left / its τ x a
  cycle's price in plain steps) at `tail_margin` (1.0); the mean τ does not decide it. Each
  row's τ is shrunk toward the pooled τ as far as the rows' spread says (`shrunk_taus`): rows
  that differ clearly keep their own, rows whose means differ only by their cycles' noise read
  the pooled τ. Never on fewer than `min_cycles` cycles in all, nor without `tail_move`."""
  from bp_jax.decoding.start_backoff import StartBackoff, shrunk_taus
  starts = StartBackoff(batch_plain=True)
  fast, slow = [6] * 16, [2] * 16
  # No noise within a row: each keeps its own τ. The slow row's 100 tokens at τ 2 take
  # 50 cycles, 125 plain steps at 2.5 a cycle (plain: 100), though the mean τ (4) is above it.
  assert shrunk_taus([fast, slow]) == [6.0, 2.0]
  assert shrunk_taus([fast, slow, []]) == [6.0, 2.0, 4.0]  # no cycle yet: the pooled τ
  assert starts.tail_loses([(fast, 40), (slow, 100)], 2.5)
  assert not starts.tail_loses([(fast, 40), (slow, 100)], 1.9)   # 100 / 2 x 1.9 = 95
  # The slow row nearly done: the fast row's 100 tokens left decide (100 / 6 x 2.5 = 42).
  assert not starts.tail_loses([(fast, 100), (slow, 10)], 2.5)
  # Means 1.75, 2 and 2.25 from cycles of 1 and 3 (variance ~1 over 16 cycles: noise of
  # ~0.25 in a mean): all read the pooled 2, and 100 / 2 x 1.9 = 95 < 100 stays, where the
  # slowest row's own 1.75 would have moved them (109).
  even, low, high = [1, 3] * 8, [1, 3, 1, 3, 1, 3, 1, 1] * 2, [3, 1, 3, 1, 3, 1, 3, 3] * 2
  assert shrunk_taus([even, low, high]) == [2.0, 2.0, 2.0]
  assert not starts.tail_loses([(even, 90), (low, 100), (high, 80)], 1.9)
  assert starts.tail_loses([(even, 90), (low, 100), (high, 80)], 2.1)  # 105 > 100
  # One row of a single cycle (no spread measured): 4 cycles of the pooled τ beside its own,
  # (1 + 4 x 5.7) / 5 = 4.8: 100 / 4.8 x 2.5 = 52 < 100.
  assert not starts.tail_loses([(fast, 100), ([1], 100)], 2.5)
  assert not starts.tail_loses([([1] * 7, 100)], 9.0)            # too few cycles to tell
  starts.tail_margin = 1.3  # plain must win by 30%: 100 x 1.3 > 125
  assert not starts.tail_loses([(fast, 40), (slow, 100)], 2.5)
  starts.tail_margin, starts.tail_move = 1.0, False
  assert not starts.tail_loses([(slow, 100)], 9.0)


def test_a_batchs_recent_requests_span_the_batch(zeros_models):
  """A batch's rows finish in the order of their τ (those committing least per cycle decode
  longest), so after a batch that started together the last half to finish are its slowest:
  the engine's start rule counts at least a batch of recent requests. Sixteen requests of τ 7,
  then 5 (finishing last): over the last 8 the next request starts plain (5 < 2 x 2.8, the
  plain loop not timed yet); over all 16 (τ 6) it drafts."""
  from bp_jax.decoding.start_backoff import StartBackoff
  finished = [[7] * 18] * 8 + [[5] * 25] * 8
  for window, start in ((8, (4, 16)), (16, (0, 0))):
    starts = StartBackoff(window=window, batch_plain=True)
    for acceptance in finished:
      starts.observe(acceptance)
    assert starts.start(2.8, 16, rows=16, plain_priced=False) == start, window
  for batch_size, window in ((3, 8), (16, 16)):
    assert _engine(zeros_models, batch_size=batch_size, **CHEAP).starts.window == window
  # The accelerator benchmarks' simulated drafts (τ 6.5 at b = 16): the last 8 of a batch of 16
  # commit clearly less per cycle than the batch, and would send the next batch plain far more
  # often against the H200's price (benchmarks/start_window.py).
  from benchmarks import accelerator, start_window
  probs = accelerator.stretched_profile(accelerator.demo_survival(), 6.5)
  shares = start_window.plain_shares(16, [8, 16], [2.79], 200, probs, 128, seed=1)
  assert shares[16]["tau"] > shares[8]["tau"] + 0.4, shares
  assert shares[16]["plain"][2.79] + 0.3 < shares[8]["plain"][2.79], shares


def test_clearing_an_engines_tallies_keeps_what_it_learned(zeros_models):
  """`Engine.clear_tallies` (a benchmark's warm-up, `--warmup_groups`): the loop calls' tallies
  start again; the prices, the start rule's recent requests and the evidence stay."""
  prompts, max_news = _requests(6)
  eng = _engine(zeros_models, batch_size=3, **CHEAP)
  eng.call_log = []
  eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert eng.forwards_run and eng.loop_calls and eng.call_log and eng.slot_use is not None
  learned = (eng.prices.break_even(B, 3), eng.starts.tau(), eng.evidence_state.tolist())
  eng.clear_tallies()
  assert not eng.forwards_run and eng.loop_calls == {} and eng.call_log == []
  assert eng.slot_use is None
  assert (eng.prices.break_even(B, 3), eng.starts.tau(), eng.evidence_state.tolist()) == learned


def test_a_batchs_explorer_runs_thin_out_while_the_choice_is_clear():
  """A batch's explorer runs come every 32nd run while the choice stays clearly plain (τ below
  0.8 x 1.2 x the price, as at the last explorer run), and every 8th while it is near its flip
  point, has changed side or drafts; a price that moves toward the flip point (a speculative
  call that timed the cycle cheaper) brings an explorer run within 8 runs."""
  from bp_jax.decoding.start_backoff import StartBackoff
  starts = StartBackoff(batch_plain=True)

  def explorer_runs(price: float, runs: int) -> list[int]:
    """The runs that explored: took the other side than the rule's, or (drafting, with
    `plain_probes`) asked for a probe instead of decoding plain."""
    found = []
    for run in range(1, runs + 1):
      sides = {starts.start(price, 16, rows=2) for _ in range(2)}
      assert len(sides) == 1  # a run takes one side
      deep = sides.pop() != (0, 0)
      if deep != (starts.tau() < 1.2 * price) or starts.probe_due:
        found.append(run)
      assert not (deep and starts.probe_due)  # a probe, not a plain run
      starts.probe_due = False
    return found

  for _ in range(4):
    starts.observe([4, 5])  # τ 4.5

  # 4.5 against 1.2 x 5: plain by 25%: clear after the first explorer run, one in 32.
  assert explorer_runs(5.0, 136) == [8, 40, 72, 104, 136]
  assert explorer_runs(7.0, 40) == [32]      # clearer still: one in 32
  assert explorer_runs(4.0, 40) == [8, 16, 24, 32, 40]  # 4.5 against 4.8: near, every 8th
  for _ in range(8):
    starts.observe([6, 7])  # τ 6.5 against 1.2 x 4: drafting, never clear
  assert explorer_runs(4.0, 40) == [8, 16, 24, 32, 40]
  assert explorer_runs(2.0, 40) == []        # decisive (τ >= 2 x the price): no plain explorers


def test_a_batch_miss_backs_every_row_off_to_the_deepest_level():
  """priced's miss is the batch's: its rows back off as one, to the deepest decoding row's
  misses + 1 (a row that had just started drafting no longer asks for 2, 4, 8, ... steps and a
  batch cycle each time while the others wait up to the cap); per row (backoff) each row
  counts its own; a cycle that is no miss resets both, rows not decoding keep theirs."""
  from bp_jax.decoding.state import LoopState
  from bp_jax.models.kv_cache import KVCache
  assert controller_of(LoopOptions(block_size=B, controller="priced", ar_fallback=16,
                                   **CHEAP)).shared_backoff
  assert not controller_of(LoopOptions(block_size=B, controller="backoff",
                                       ar_fallback=16)).shared_backoff
  s = LoopState.empty(jnp.zeros((4, 16), jnp.int32), KVCache.create(1, 4, 16, 1, 4, jnp.float32))
  s = s.replace(misses_B=jnp.asarray([0, 5, 2, 9], jnp.int32))
  active = jnp.asarray([True, True, True, False])
  miss = jnp.ones((4,), bool)
  shared = s.backed_off(miss, active, 16, shared=True)
  assert shared.misses_B.tolist() == [6, 6, 6, 9] and shared.wait_B.tolist() == [16, 16, 16, 0]
  own = s.backed_off(miss, active, 16)
  assert own.misses_B.tolist() == [1, 6, 3, 9] and own.wait_B.tolist() == [2, 16, 8, 0]
  hit = s.backed_off(jnp.zeros((4,), bool), active, 16, shared=True)
  assert hit.misses_B.tolist() == [0, 0, 0, 9] and hit.wait_B.tolist() == [0, 0, 0, 0]


def test_requests_start_deep_where_drafting_loses_and_stay_lossless(zeros_models, zeros_ar_outputs):
  """Under the dearest costs (every cycle a miss) the first requests draft first and later ones
  mostly start with AR steps (fewer drafter passes for the same tokens); greedy output stays
  AR's, and nothing recompiles for the start. With start_backoff=False every request drafts
  first. (start_plain=False: the deep start's AR steps run in the speculative loop.)"""
  prompts, max_news = _requests(6)
  runs = {}
  for on in (True, False):
    eng = _engine(zeros_models, start_backoff=on, start_plain=False, **DEAREST)
    gens = [eng.generate(p, max_new_tokens=m, block_size=B)
            for _ in range(3) for p, m in zip(prompts, max_news)]
    assert [g.output_ids for g in gens] == zeros_ar_outputs * 3
    assert eng.compiled.counts["spec_loop"] == 1
    runs[on] = gens
  first_is_cycle = lambda g: bool(g.forward_is_cycle[0]) if g.forward_is_cycle else None
  fresh = [first_is_cycle(g) for g in runs[False]]
  assert all(f in (True, None) for f in fresh)  # every request drafts first (None: no forward)
  deep = [first_is_cycle(g) for g in runs[True][6:]]
  assert deep.count(False) >= len(deep) // 2, deep
  assert (sum(g.drafter_passes for g in runs[True]) <
          sum(g.drafter_passes for g in runs[False]))


def test_a_request_alone_that_would_start_deep_decodes_plain(zeros_models, zeros_ar_outputs):
  """start_plain (the default): where the recent requests' drafting lost (dearest costs), a
  request alone that would start deep runs the plain AR loop: no drafter pass, its forwards AR
  steps (not τ = 1 cycles), its bucket kept, AR's very tokens; an
  explorer still takes the speculative loop, so τ stays current. Without start_plain no request
  runs plain and more drafter passes run."""
  prompts, max_news = _requests(6)
  runs = {}
  for plain in (True, False):
    eng = _engine(zeros_models, start_plain=plain, **DEAREST)
    gens = [eng.generate(p, max_new_tokens=m, block_size=B)
            for _ in range(3) for p, m in zip(prompts, max_news)]
    assert [g.output_ids for g in gens] == zeros_ar_outputs * 3
    assert eng.compiled.counts["spec_loop"] == 1
    runs[plain] = gens
  plain_gens = [g for g in runs[True] if g.plain_start]
  assert len(plain_gens) >= 6, [g.plain_start for g in runs[True]]
  for g in plain_gens:
    assert (g.block_size, g.drafter_passes, g.cycles, g.tau) == (B, 0, 0, None)
    assert g.ar_steps == g.target_forwards  # none when the prefill's token was the last
  assert sum(g.ar_steps for g in plain_gens) > 0
  # Explorers still take the speculative loop (here the 4th deep start; dearest costs keep the
  # choice clear after it, so the next comes 16 deep starts later: test_start_backoff_...).
  assert [g.plain_start for g in runs[True][4:8]] == [True, True, True, False]
  assert all(g.plain_start for g in runs[True][8:])
  assert not any(g.plain_start for g in runs[False])


def test_precompile_includes_the_plain_loop_a_start_may_take(zeros_models):
  """An engine that may start requests plain compiles the AR loop with its buckets (a batched
  one: the plain bucket's batched loop), so that no plain start compiles mid-run; without
  start_plain it does not."""
  for plain, want in ((True, {"spec_loop": 1, "ar_loop": 1}), (False, {"spec_loop": 1})):
    eng = _engine(zeros_models, start_plain=plain, **DEAREST)
    by_function = eng.precompile([B], length_buckets=(16,))["by_function"]
    assert {k: v for k, v in by_function.items() if k != "prefill"} == want, by_function
  # A batch's plain starts take the plain AR bucket: its batched loop too.
  # (and each bucket's fresh state of batch_size slots, and the staging buffers)
  for plain, want in ((True, {"batch_spec_loop": 1, "batch_ar_loop": 1, "slot_carry": 2,
                              "staging_buffers": 1}),
                      (False, {"batch_spec_loop": 1, "slot_carry": 1, "staging_buffers": 1})):
    eng = _engine(zeros_models, batch_size=3, start_plain=plain, **DEAREST)
    by_function = eng.precompile([B], length_buckets=(16,))["by_function"]
    assert {k: v for k, v in by_function.items() if k != "prefill"} == want, by_function


def test_batched_rows_start_deep_where_drafting_loses(zeros_models, zeros_ar_outputs):
  """A request taking a batch's slot starts where the requests before it say (as one request
  alone does): under the dearest costs later rows start with AR steps, fewer drafter passes
  than with every row drafting first, the same tokens, one insertion and one loop program.
  (start_plain=False: the deep start's AR steps run in the speculative loop.)"""
  prompts, max_news = _requests(6)
  passes = {}
  for on in (True, False):
    eng = _engine(zeros_models, batch_size=3, start_backoff=on, start_plain=False, **DEAREST)
    for _ in range(3):
      outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
      assert [g.output_ids for g in outs] == zeros_ar_outputs
      assert not any(g.plain_start for g in outs)
    passes[on] = sum(g.drafter_passes for g in outs)
    assert eng.compiled.counts["insert"] == 1 and eng.compiled.counts["batch_spec_loop"] == 1
    assert "batch_ar_loop" not in eng.compiled.counts
  assert passes[True] < passes[False], passes


@pytest.mark.parametrize("costs", ["dearest", "cheap"])
def test_batched_requests_that_would_start_deep_decode_in_the_plain_bucket(zeros_models,
                                                                           zeros_ar_outputs, costs):
  """start_plain (the default) in a batch of 3: where drafting loses (the dearest costs) a
  request that would start deep takes a slot of the plain AR bucket: no drafter pass, its
  forwards AR steps, its block size kept, AR's very tokens. Explorers come in runs of the batch
  size: the 4th run of 3 requests (starts 10-12; every 8th by default) drafts. Where drafting
  pays at least twice its price (cheap costs, an accelerator's) no request decodes plain,
  explorers included (their other side elsewhere:
  test_a_batchs_start_weighs_the_plain_price_with_runs_of_explorers)."""
  prompts, max_news = _requests(6)
  eng = _engine(zeros_models, batch_size=3, **(DEAREST if costs == "dearest" else CHEAP))
  eng.starts.batch_explore_every = 4
  gens = []
  for _ in range(3):
    outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
    assert [g.output_ids for g in outs] == zeros_ar_outputs
    gens += outs
  plain = [g.plain_start for g in gens]
  if costs == "dearest":
    assert all(plain[6:9]) and not any(plain[9:12]) and all(plain[12:]), plain
  else:
    assert eng.starts.tau() >= 2 * 1.2 and not any(plain), plain
  for g in gens:
    assert g.block_size == B
    if g.plain_start:
      assert (g.drafter_passes, g.cycles) == (0, 0) and g.ar_steps == g.target_forwards
  assert eng.compiled.counts["batch_spec_loop"] >= 1
  assert ("batch_ar_loop" in eng.compiled.counts) == (costs == "dearest")


def test_a_batchs_requests_move_to_the_plain_bucket_where_its_cycles_keep_missing(zeros_models):
  """Plain starts on, batch 3, the dearest costs (every cycle misses): the first requests draft
  (no τ is known yet) and, once their batch missed 3 cycles in a row, move to the plain AR
  bucket mid-decode (`BatchOptions.move_plain_after`): AR's very tokens at T = 1 for each
  seed (exact), and greedy (the server warm-up's engine at the end), their drafted forwards counted as cycles and the plain loop's as AR
  steps, fewer drafter passes than staying (move_plain_after = 0: none moves, and the rows
  probe again after 8, 16, 32 AR steps); their cycles reach the start rule when they move, so
  the requests after them start plain, even one routed to draft before the moves (no explorer:
  `Scheduler._reroute`). Under cheap
  costs (an accelerator's) nothing misses and nothing moves."""
  prompts, _ = _requests(6)
  max_news = [70] * 6  # long enough for the probes after a deep back-off (8, 16, 32 AR steps)
  ar = Engine(zeros_models[0], shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS))
  passes = {}
  ar_outputs = lambda T: [ar.generate(p, max_new_tokens=m, temperature=T, top_k=20,
                                      seed=7 + i).output_ids
                          for i, (p, m) in enumerate(zip(prompts, max_news))]
  for T in (1.0,):
    want = ar_outputs(T)
    for after in (3, 0):
      eng = _engine(zeros_models, batch_size=3, move_plain_after=after, **DEAREST)
      outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B, temperature=T,
                                top_k=20, seeds=7)
      assert [g.output_ids for g in outs] == want, (T, after)
      moved = [g for g in outs if g.moved_plain]
      assert len(moved) >= 3 if after else not moved
      for g in moved:
        assert not g.plain_start and g.block_size == B
        assert 1 <= g.cycles == g.drafter_passes and g.ar_steps > 0
        assert all(v > 0 for v, c in zip(g.forward_verified, g.forward_is_cycle) if c)
      assert ("move" in eng.compiled.counts) == bool(after)
      passes[T, after] = sum(g.drafter_passes for g in outs)
      if after:
        # The moved requests' cycles reach the start rule when they move, once each, and the
        # requests after them start plain: the 4th too, routed to draft before the moves.
        assert all(g.moved_plain for g in outs[:3]) and all(g.plain_start for g in outs[3:])
        assert len(eng.starts._recent) == 3 < eng.starts.window
    assert passes[T, 3] < passes[T, 0], passes
  cheap = _engine(zeros_models, batch_size=3, **CHEAP)
  outs = cheap.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert not any(g.moved_plain for g in outs) and "move" not in cheap.compiled.counts
  # A server's warm-up (every window, size and move) leaves no move to compile.
  eng = _engine(zeros_models, batch_size=3, shrink=True, **DEAREST)
  moves = eng.precompile([B], length_buckets=BUCKETS, all_windows=True)["by_function"]["move"]
  assert moves == len(eng.slot_sizes())  # from each size of the speculative state
  with BackendCompiles() as compiles:  # nor anything else: the emptied slots included
    outs = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=B)
  assert any(g.moved_plain for g in outs) and eng.compiled.counts["move"] == moves
  assert compiles.n == 0, compiles
  assert [g.output_ids for g in outs] == ar_outputs(0.0)  # greedy: AR's tokens, moved or not
