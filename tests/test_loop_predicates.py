"""Host waits per cycle. On a GPU, XLA evaluates each predicate of a data-dependent
`while_loop` on the device, copies it to the host and waits there for the device before it
launches what follows, and likewise the branch index of a `lax.cond`, so every predicate and
branch a cycle evaluates is time the device idles. A run of the default's cycles (`priced`, with
its back-off, decline and gate) must evaluate no more of them than the paper's loop (one per
cycle) plus, where it declines, its one branch between the full verify and none; where the costs
leave the decline off, as many as the paper's loop. Greedy requests' programs branch at run time
on nothing else (`sampling.SamplingForm`).

Counted on this CPU by wrapping `jax.lax.while_loop`'s predicates and `jax.lax.cond`'s branch
index, while the loops compile, with a host callback that counts each evaluation.
"""

from __future__ import annotations

import re

import jax
import pytest

from toy_models import toy_engine, toy_requests

B = 4
# Cheap verifies: a cycle that accepts its drafts is never a miss, so a run of cycles takes no
# AR steps (the count below is the cycles' own).
COSTS = dict(controller_costs="1,1.05,1.1", controller_draft_cost=0.1, start_backoff=False)


@pytest.fixture
def evaluations(monkeypatch) -> list[int]:
  """[n]: the loop predicates and branch indices evaluated so far by loops compiled from here
  on."""
  seen = [0]
  count = lambda: jax.debug.callback(lambda: seen.__setitem__(0, seen[0] + 1))
  real_while, real_cond = jax.lax.while_loop, jax.lax.cond

  def while_loop(cond, body, init):
    def counted(s):
      count()
      return cond(s)
    return real_while(counted, body, init)

  def cond(pred, true_fn, false_fn, *operands):
    count()
    return real_cond(pred, true_fn, false_fn, *operands)

  monkeypatch.setattr(jax.lax, "while_loop", while_loop)
  monkeypatch.setattr(jax.lax, "cond", cond)
  return seen


def _decode(eng, prompts, drafts, evaluations) -> tuple[int, int]:
  """(predicates evaluated, cycles) of decoding each prompt alone with its drafts forced."""
  before, cycles = evaluations[0], 0
  for p, d in zip(prompts, drafts):
    g = eng.generate(p, max_new_tokens=48, block_size=B, forced_continuation=d)
    assert g.ar_steps == 0 and g.output_ids == d
    cycles += g.cycles
  return evaluations[0] - before, cycles


def test_a_run_of_cycles_evaluates_one_predicate_besides_its_buckets(zeros_models,
                                                                      evaluations):
  prompts, _ = toy_requests(2, seed=5)
  plain = toy_engine(zeros_models, "none", sync_cycles=0)
  ar = [plain.generate(p, max_new_tokens=48, block_size=1).output_ids for p in prompts]
  declining = toy_engine(zeros_models, "priced", sync_cycles=0, controller_decline=True, **COSTS)
  # Left to the engine at these costs (a declined cycle would save 0.1 AR steps), the decline
  # is off: one verify, no loop of zero or one trips around it.
  default = toy_engine(zeros_models, "priced", sync_cycles=0, **COSTS)
  assert declining.loop_options.controller_decline and default.loop_options.controller_persist
  assert default.loop_options.controller_decline is False
  # First decodes compile (and run their loops' first calls); the counts come from the second.
  for eng in (plain, declining, default):
    _decode(eng, prompts, ar, evaluations)
  n_plain, c_plain = _decode(plain, prompts, ar, evaluations)
  n_declining, c_declining = _decode(declining, prompts, ar, evaluations)
  n_default, c_default = _decode(default, prompts, ar, evaluations)
  assert c_plain == c_declining == c_default > 8 * len(prompts)
  calls = len(prompts)  # one loop call per request (sync_cycles 0)
  # The paper's loop: its one predicate per cycle, and one more per call (the exit).
  assert n_plain == c_plain + calls
  # With the decline: the cycles' loop and the branch to the full verify per cycle; per call,
  # the outer loop's two, the branch to a run of AR steps and the cycles' loop's exit.
  # The full verify in a loop of zero or one trips (the form before) evaluated its predicate
  # twice per cycle that verified (3 per cycle); nested in a loop of zero or one trips after AR
  # steps that ran first, with a nested loop for each of its two verify lengths (the form
  # before that), a cycle evaluated 8 (the outer loop, the AR steps', its own twice, the
  # context flush's, the buckets' 2 + 1).
  per_cycle = (n_declining - 4 * calls) / c_declining
  assert per_cycle == pytest.approx(2.0), (n_declining, c_declining)
  # Without it, the paper's loop's one per cycle.
  assert (n_default - 4 * calls) / c_default == pytest.approx(1.0), (n_default, c_default)
  # Greedy requests run greedy programs (`sampling.SamplingForm`): no run-time branch on the
  # sampling settings (one program for every setting branched twice per cycle and once per AR
  # step, each branch a wait of the host for the device on a GPU), and no other than the
  # run of AR steps' (where the loop backs off) and the decline's.
  for eng, key, branches in ((plain, ("ar_loop", 1), 0), (plain, ("spec_loop_forced", B), 0),
                             (declining, ("spec_loop_forced", B), 2),
                             (default, ("spec_loop_forced", B), 1)):
    assert eng.compiled.program_text(key).count(" conditional(") == branches, key
  # Program size: the paper's loop holds one copy of the target's forward (its verify), the
  # default's one more (its AR step: one copy, not a second one peeled out of the AR steps' loop
  # for its first step).
  key = ("spec_loop_forced", B)
  assert [_target_forwards(e, key) for e in (plain, declining, default)] == [1, 2, 2]


def _target_forwards(eng, key) -> float:
  """Copies of the target's forward in a compiled program: its fused gate|up products
  (`layers.fuse_projections`; [.., 2F] = [.., 96] here, a width nothing else has: the vocabulary
  and the fused q|k|v are 64 wide, the drafter's separate gate and up 48), one per layer."""
  target = eng.cfg
  width = 2 * target.intermediate_size
  products = re.findall(rf"= f32\[[0-9,]*,{width}\]\{{[0-9,]*\}} dot\(",
                        eng.compiled.program_text(key))
  return len(products) / target.num_hidden_layers
