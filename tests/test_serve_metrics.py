"""The server's /metrics page on what the speculation chose and what it rests on: finished
requests' target forwards by verify length, the loop each request ran in, and the priced start
rule's state (`Engine.start_choice`), without a server (tests/test_serve.py runs one)."""

from __future__ import annotations

import math
import types

from bp_jax.decoding.start_backoff import StartChoice
from bp_jax.serving.metrics import PREFIX, Metrics, parse
from toy_models import toy_engine

DEAR = dict(controller_costs="1,2,2.5", controller_draft_cost=1.5)  # a b = 4 cycle: 4 AR steps


def _gen(verified, plain_start=False, moved_plain=False):
  """What `Metrics.finished` reads of a `Generation`: per forward k + 1 after a drafter pass
  verifying k (0: an AR step), one committed token per AR step and per declined cycle."""
  lengths = [1 if v <= 1 else v for v in verified]
  return types.SimpleNamespace(
      cycles=sum(v > 0 for v in verified), acceptance_lengths=[a for a, v in
                                                               zip(lengths, verified) if v > 0],
      target_forwards=len(verified), forward_lengths=lengths, forward_verified=list(verified),
      plain_start=plain_start, moved_plain=moved_plain)


def test_forwards_by_verify_length_and_requests_by_loop():
  m = Metrics()
  m.finished(_gen([8, 8, 0, 1, 0]))           # two full cycles, a declined one, two AR steps
  m.finished(_gen([0, 0, 0], plain_start=True))
  m.finished(_gen([8, 0, 0], moved_plain=True))
  text = m.render()
  got = parse(text)
  assert got[f'{PREFIX}target_forwards_total{{verified="ar"}}'] == 7
  assert got[f'{PREFIX}target_forwards_total{{verified="k=0"}}'] == 1
  assert got[f'{PREFIX}target_forwards_total{{verified="k=7"}}'] == 3
  # "ar" first, then by the drafts verified (k=0 before k=7, not as strings sort)
  order = [line for line in text.splitlines() if line.startswith(f"{PREFIX}target_forwards")]
  assert [line.split('"')[1] for line in order] == ["ar", "k=0", "k=7"]
  assert {p: got[f'{PREFIX}requests_finished_total{{path="{p}"}}']
          for p in ("speculative", "plain", "moved_plain")} == {
              "speculative": 1, "plain": 1, "moved_plain": 1}
  # The figures the page had before keep their meaning: τ over cycles, tokens per forward over
  # every forward (8 + 8 + 1 + 8 committed by 4 cycles; with 7 AR steps' tokens, 32 over 11).
  assert got[f"{PREFIX}tau"] == round(25 / 4, 4)
  assert got[f"{PREFIX}tokens_per_forward"] == round(32 / 11, 4)
  assert not any(k.startswith(f"{PREFIX}start_") for k in got)  # no start rule: no gauges


def test_the_start_rule_gauges():
  m = Metrics()
  m.start_choice = StartChoice(None, 4.25, False)
  got = parse(m.render())
  assert math.isnan(got[f"{PREFIX}start_tau"]) and got[f"{PREFIX}start_price"] == 4.25
  assert got[f"{PREFIX}start_plain"] == 0
  m.start_choice = StartChoice(2.5, 4.25, True)
  got = parse(m.render())
  assert (got[f"{PREFIX}start_tau"], got[f"{PREFIX}start_plain"]) == (2.5, 1)
  assert got[f"{PREFIX}plain_probes_total"] == 0
  m.plain_probes = 3  # (the worker copies `Engine.plain_probes`)
  assert parse(m.render())[f"{PREFIX}plain_probes_total"] == 3


def test_the_engines_start_choice_follows_the_recent_cycles(zeros_models):
  """Alone: plain once the recent cycles commit under 0.8 x a cycle's price (4 AR steps here);
  in a batch: the price in plain steps and the rule's margin (`StartBackoff`). Asking counts no
  start: the explorer schedule is untouched."""
  alone = toy_engine(zeros_models, "priced", **DEAR)
  assert alone.start_choice(1) is None
  first = alone.start_choice(4)
  assert first.tau is None and not first.plain and first.price == alone.break_even_N(4, 1)[4]
  for _ in range(4):
    alone.request_moved([1, 2])  # τ 1.5 < 0.8 x 4
  now = alone.start_choice(4)
  assert now.tau == 1.5 and now.plain
  assert alone.request_start(4) != (0, 0)  # the rule's start agrees; the first deep one is
  for _ in range(8):                        # no explorer (every 4th is)
    alone.request_moved([4, 4])  # the last 8 requests' τ 4 >= 3.2
  assert not alone.start_choice(4).plain
  batch = toy_engine(zeros_models, "priced", batch_size=2, sync_cycles=2, **DEAR)
  choice = batch.start_choice(4)
  assert choice.price == batch.prices.start_break_even(4, 2) and not choice.plain
  for _ in range(4):
    batch.request_moved([1, 1])
  assert batch.start_choice(4).plain == batch.plain_now(4) is True
  assert toy_engine(zeros_models, "none").start_choice(4) is None  # no start rule
