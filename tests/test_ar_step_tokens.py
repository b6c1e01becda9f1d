"""AR steps run as two-token forwards (`LoopOptions.ar_step_tokens`): the same tokens, chosen by
the costs in effect (an H200 at Qwen3-4B shapes priced a forward over 2 tokens at 0.62 of one)."""

from __future__ import annotations

from unittest import mock

import ml_collections
import pytest

from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decode_job.records import costs_line
from bp_jax.decoding.compiled import shared_programs_set_aside
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.errors import BadInputError
from bp_jax.models.qwen3 import Qwen3
from toy_models import assert_sampled_like_ar, toy_engine, toy_requests

# Forwards over 2 and 4 tokens cheaper than the AR step (the H200's 0.62-0.68): a b = 4 cycle
# costs 0.75 AR steps.
UNDER = dict(controller="priced", controller_costs="1,0.6,0.65", controller_draft_cost=0.1)


def test_auto_pads_where_the_costs_price_two_tokens_below_one():
  in_effect = lambda **kw: LoopOptions(**kw).in_effect().ar_step_tokens
  assert in_effect() == 1  # no costs: nothing says a one-token forward is dear
  assert in_effect(**UNDER) == 2
  assert in_effect(controller="priced", controller_costs="1,0.95,1.1",
                   controller_draft_cost=0.1) == 1  # within noise of one AR step
  assert in_effect(controller="priced", controller_costs="1,1.1,1.3",
                   controller_draft_cost=0.5) == 1  # the development CPU
  assert in_effect(ar_step_tokens=1, **UNDER) == 1 and in_effect(ar_step_tokens=2) == 2
  for bad in (3, -1, True):
    with pytest.raises(BadInputError, match="ar_step_tokens"):
      LoopOptions(ar_step_tokens=bad)
  cfg = lambda v: ml_collections.ConfigDict(dict(controller="priced", ar_step_tokens=v))
  assert loop_options(cfg(2))["ar_step_tokens"] == 2
  for bad in (3, "two"):
    with pytest.raises(BadInputError, match="--config.ar_step_tokens"):
      loop_options(cfg(bad))


def test_padded_ar_steps_decode_ar_s_tokens_alone_in_batches_and_at_the_cache_end(
    zeros_models, zeros_ar_outputs):
  """The AR loop and the speculative loop's AR steps (priced, costs that pad) give AR's tokens,
  alone and in a batch, greedy and sampled; a request that fills the cache too (its last step's
  copy writes the last slot). The forwards traced are two-token ones."""
  shapes = []
  real_call = Qwen3.__call__

  def spy(self, tokens_BT, *a, **kw):
    shapes.append(tuple(tokens_BT.shape))
    return real_call(self, tokens_BT, *a, **kw)

  prompts, max_news = toy_requests(6)
  # Only the padded AR loops are traced under the spy, afresh (programs the tests before
  # compiled are set aside for it, and those traced under it forgotten after).
  with mock.patch.object(Qwen3, "__call__", spy), shared_programs_set_aside():
    padded = toy_engine(zeros_models, "none", ar_step_tokens=2)
    assert [padded.generate(p, max_new_tokens=m).output_ids
            for p, m in zip(prompts, max_news)] == zeros_ar_outputs
    batch = toy_engine(zeros_models, "none", batch_size=3, ar_step_tokens=2)
    assert [g.output_ids for g in batch.generate_batch(prompts, max_new_tokens=max_news,
                                                       block_size=1)] == zeros_ar_outputs
  assert (1, 2) in shapes and (3, 2) in shapes
  assert (1, 1) not in shapes and (3, 1) not in shapes  # prefills run [1, bucket]
  priced = toy_engine(zeros_models, "priced",
                      **{k: v for k, v in UNDER.items() if k != "controller"})
  assert priced.loop_options.ar_step_tokens == 2
  gens = [priced.generate(p, max_new_tokens=m, block_size=4) for p, m in zip(prompts, max_news)]
  assert [g.output_ids for g in gens] == zeros_ar_outputs
  # A cycle costs 0.75 AR steps here: even one accepting no draft is no miss, no AR step runs
  # (before 17bde9a, measured costs raised to one AR step priced such a cycle above its token).
  assert sum(g.ar_steps for g in gens) == 0 and sum(g.drafter_passes for g in gens) > 0
  plain = toy_engine(zeros_models, "none")
  full = [1 + i % 62 for i in range(64)]  # 64 + 64 new tokens: max_len
  assert (padded.generate(full, max_new_tokens=64).output_ids ==
          plain.generate(full, max_new_tokens=64).output_ids)
  assert_sampled_like_ar(zeros_models, padded, block_size=1)


def test_the_summary_says_ar_steps_are_padded():
  c = {"source": "measured", "verify_costs": [1.0, 0.62], "draft_cost": 0.14,
       "ar_step_tokens": 2}
  assert "AR steps run as two-token forwards" in costs_line(c)
  assert "two-token" not in costs_line({**c, "ar_step_tokens": 1})


def test_an_engine_that_prices_nothing_measures_its_ar_step_where_it_may_pay(zeros_models,
                                                                             monkeypatch):
  """A plain AR engine (no costs, `ar_step_tokens` auto) times its target over one and two
  tokens on an accelerator (`probes_ar_step`) and pads where two cost below PAD_AR_BELOW of
  one; not on a CPU, nor where costs or the form are given. The probe itself, on the toy
  target: two positive times."""
  from bp_jax.decode_job.records import ar_step_line, ar_step_probe_of
  from bp_jax.decoding import costs, engine as engine_lib

  assert not engine_lib.probes_ar_step()  # this CPU: no probe, no compiles for it
  assert toy_engine(zeros_models, "none").ar_step_probe is None
  one, two = costs.measure_ar_step(zeros_models[0], 2, 32, reps=2, repeats=2)
  assert one > 0 and two > 0
  monkeypatch.setattr(engine_lib, "probes_ar_step", lambda: True)
  for probe, form in (((6.19e-3, 4.16e-3), 2), ((1e-3, 0.95e-3), 1)):
    monkeypatch.setattr(engine_lib, "measure_ar_step", lambda *a, probe=probe, **kw: probe)
    eng = toy_engine(zeros_models, "none")
    assert eng.loop_options.ar_step_tokens == form and eng.ar_step_probe == probe
    assert ar_step_probe_of(eng) == {"one_token_ms": round(1e3 * probe[0], 3),
                                     "two_tokens_ms": round(1e3 * probe[1], 3),
                                     "ar_step_tokens": form}
  assert ar_step_line(ar_step_probe_of(eng)) == (
      "one-token forwards (measured here: one token 1.000 ms, two 0.950 ms)")
  monkeypatch.setattr(engine_lib, "measure_ar_step", lambda *a, **kw: pytest.fail("measured"))
  for kw in (dict(ar_step_tokens=1), dict(controller_costs="1,1.1,1.2",
                                          controller_draft_cost=0.2)):
    assert toy_engine(zeros_models, "none", **kw).ar_step_probe is None
  # A caller's measurement at this batch size decides it without a probe, on any machine.
  monkeypatch.setattr(engine_lib, "probes_ar_step", lambda: False)
  measured = costs.ForwardCosts((4e-3, 2.4e-3, 2.5e-3), 1e-3, batch_size=1, block_size=4)
  target, drafter = zeros_models
  eng = Engine(target, drafter=drafter, measured_costs=measured,
               shapes=ShapeOptions(max_len=128, block_sizes=(1, 4)))
  assert eng.ar_step_probe == (4e-3, 2.4e-3) and eng.loop_options.ar_step_tokens == 2
