"""One meaning per figure on the training side: τ is committed tokens per speculative cycle (the
AR fallback's steps are no cycles), tokens per target forward counts every forward. Checked on
a real engine with the AR fallback through the labels' `measure_prompt`, the label set's
fields, the label rules and cycle costs, the policy stage's choice figures and the report's
rows."""

from __future__ import annotations

import numpy as np
import pytest

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from toy_models import zeros_drafter_pair
from bp_jax.errors import BadInputError
from bp_jax.eval import report as rep
from bp_jax.data import label_sets
from bp_jax.train import labels as lab
from bp_jax.train import policy_stage as ps
from bp_jax.train.report_stage import _run_record

V = 64
SIZES = (1, 3, 4)
MAX_NEW = 30
FALLBACK = dict(ar_fallback=4, ar_fallback_accept=1)


@pytest.fixture(scope="module")
def engine():
  """A random target whose greedy output often is token 0 and a drafter that always drafts 0
  (its final norm is zero): cycles accept runs of 0s of every length, and poor cycles, after
  which the AR fallback steps, are common."""
  target, drafter = zeros_drafter_pair(V)
  return Engine(target, drafter=drafter,
                shapes=ShapeOptions(max_len=96, length_buckets=(32, 64, 96), block_sizes=SIZES),
                loop=LoopOptions(**FALLBACK))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, V - 1, int(rng.integers(3, 30))).tolist() for _ in range(n)]


def _per_size(m, field: str, k: int) -> np.ndarray:
  """Size k's slice of a per-forward field of `measure_prompt`'s output."""
  bounds = np.cumsum(m["forwards"])
  return np.split(np.asarray(m[field]), bounds[:-1])[k]


# ---- the labels' measurements, on a real engine ------------------------------------------------


def test_measure_prompt_tau_counts_cycles_and_tokens_per_forward_all_forwards(engine):
  fell_back = 0
  for prompt in _prompts(4):
    m = lab.measure_prompt(engine, prompt, SIZES, max_new_tokens=MAX_NEW, temperature=0.0,
                           seed=0)
    for k, b in enumerate(SIZES):
      g = engine.generate(prompt, max_new_tokens=MAX_NEW, block_size=b)
      lengths, is_cycle = _per_size(m, "accept_lens", k), _per_size(m, "forward_is_cycle", k)
      # The stored schedule is the loop that ran, every target forward in order.
      assert lengths.tolist() == g.forward_lengths and is_cycle.tolist() == g.forward_is_cycle
      assert m["cycles"][k] == g.cycles == is_cycle.sum()
      assert m["forwards"][k] == g.target_forwards == len(lengths)
      assert m["committed"][k] == lengths.sum() == g.new_tokens - 1 == m["new_tokens"][k] - 1
      # τ: mean over the cycles only; tokens per forward: over every forward.
      assert m["tau"][k] == pytest.approx(lengths[is_cycle].mean()) == pytest.approx(g.tau)
      assert m["tokens_per_forward"][k] == pytest.approx(lengths.mean())
      assert m["tokens_per_forward"][k] == pytest.approx(g.tokens_per_forward)
      if b == 1:  # plain AR: steps are cycles of size 1
        assert is_cycle.all() and m["tau"][k] == 1.0 == m["tokens_per_forward"][k]
      if g.ar_steps:
        fell_back += 1
        # AR steps commit one token each: they pull tokens per forward below τ.
        assert m["tokens_per_forward"][k] < m["tau"][k]
        assert m["cycles"][k] < m["forwards"][k]
  assert fell_back >= 2


def test_measure_prompt_pools_tau_over_the_seeds_cycles(engine):
  prompt = _prompts(1, seed=3)[0]
  m = lab.measure_prompt(engine, prompt, SIZES, max_new_tokens=MAX_NEW, temperature=1.0,
                         seed=7, num_seeds=2)
  for k, b in enumerate(SIZES):
    gens = [engine.generate(prompt, max_new_tokens=MAX_NEW, temperature=1.0,
                            seed=7 + 7919 * s, block_size=b) for s in range(2)]
    lengths, is_cycle = _per_size(m, "accept_lens", k), _per_size(m, "forward_is_cycle", k)
    assert lengths.tolist() == gens[0].forward_lengths + gens[1].forward_lengths  # seeds in order
    assert is_cycle.tolist() == gens[0].forward_is_cycle + gens[1].forward_is_cycle
    assert m["cycles"][k] == is_cycle.sum() and m["forwards"][k] == len(lengths)
    cycle_tokens = sum(sum(g.acceptance_lengths) for g in gens)
    assert m["tau"][k] == pytest.approx(cycle_tokens / sum(g.cycles for g in gens))
    assert m["tokens_per_forward"][k] == pytest.approx(lengths.mean())
    assert m["new_tokens"][k] == sum(g.new_tokens for g in gens) == m["committed"][k] + 2


def test_label_set_keeps_the_schedule(engine, tmp_path):
  prompt = lab.LabelPrompt("src:0", "src", "some text")
  ids = _prompts(1, seed=5)[0]
  m = lab.measure_prompt(engine, ids, SIZES, max_new_tokens=MAX_NEW, temperature=0.0, seed=0)
  rec = lab.label_record(prompt, "label", len(ids), SIZES, m, ar_fallback=4)
  settings = label_sets.decode_settings(MAX_NEW, 0.0, False, {"scan_layers": False, **FALLBACK})
  ds = label_sets.write_label_set(str(tmp_path), "labels", [rec], "one prompt", settings)
  (back,) = list(ds)
  for field in ("tau", "tokens_per_forward", "committed", "new_tokens", "cycles", "forwards",
                "accept_lens", "forward_is_cycle"):
    np.testing.assert_allclose(back[field], m[field], rtol=1e-6, err_msg=field)
  assert back["forward_is_cycle"].dtype == np.bool_
  assert back["forward_is_cycle"].size == back["accept_lens"].size == back["forwards"].sum()


# ---- label rules and cycle costs ----------------------------------------------------------------


def _rec(forwards, cycles, secs, tau=None, per_forward=None, new=None, sizes=(1, 2, 3)):
  K = len(sizes)
  return {"block_sizes": np.asarray(sizes, np.int32), "forwards": np.asarray(forwards, np.int32),
          "cycles": np.asarray(cycles, np.int32), "decode_s": np.asarray(secs, np.float32),
          "tau": np.asarray(tau if tau is not None else [1.0] * K, np.float32),
          "tokens_per_forward": np.asarray(per_forward if per_forward is not None else [1.0] * K,
                                           np.float32),
          "new_tokens": np.asarray(new if new is not None else [10] * K, np.int32),
          "ar_fallback": 4}


def test_cycle_costs_charge_ar_steps_at_the_ar_step_cost():
  # AR steps cost 1.0 / 1.1 ms (median 1.05). Size 2: (10 - 2 * 1.05) / 4 and 16 / 8 ms;
  # size 3: (12 - 2 * 1.05) / 3 and (12 - 2 * 1.05) / 2 ms.
  recs = [_rec([10, 6, 5], [10, 4, 3], [0.010, 0.010, 0.012]),
          _rec([20, 8, 4], [20, 8, 2], [0.022, 0.016, 0.012])]
  assert label_sets.ar_step_seconds(recs) == pytest.approx(0.00105)
  np.testing.assert_allclose(label_sets.cycle_costs(recs),
                             [0.00105, (0.0079 / 4 + 0.002) / 2, (0.0099 / 3 + 0.0099 / 2) / 2],
                             rtol=1e-5)
  # Without a size-1 candidate to price AR steps, only runs that took none count.
  no_ar = [{**r, **{f: r[f][1:] for f in ("block_sizes", "forwards", "cycles", "decode_s")}}
           for r in recs]
  assert label_sets.ar_step_seconds(no_ar) is None
  costs = label_sets.cycle_costs(no_ar)
  assert costs[0] == pytest.approx(0.002) and np.isnan(costs[1])
  # Records of an older labels stage (no `forwards`) are refused, not misread.
  old = [{k: v for k, v in r.items() if k != "forwards"} for r in recs]
  with pytest.raises(BadInputError, match="'forwards'.*relabel it"):
    label_sets.cycle_costs(old)


def test_max_tau_uses_tau_per_cycle_not_tokens_per_forward():
  recs = [_rec([9, 6, 5], [9, 3, 4], [1, 1, 1], tau=[1.0, 3.0, 2.5], per_forward=[1, 1.5, 2.0])]
  assert label_sets.labels_of(label_sets.label_values(recs, "max_tau")).tolist() == [1]


def test_choice_metrics_names_and_means():
  recs = [_rec([9, 6, 5], [9, 3, 4], [0.009, 0.006, 0.005], tau=[1.0, 3.0, 2.5],
               per_forward=[1.0, 1.5, 2.0], new=[10, 10, 11]),
          _rec([9, 4, 4], [9, 4, 2], [0.009, 0.004, 0.004], tau=[1.0, 2.0, 4.0],
               per_forward=[1.0, 2.0, 2.5], new=[10, 9, 11])]
  m = ps.choice_metrics(recs, np.array([1, 2]), label_sets.cycle_costs(recs))
  assert m["tau"] == pytest.approx((3.0 + 4.0) / 2)  # mean over prompts, as decode.py's tau
  assert m["tau_pooled_over_cycles"] == pytest.approx((3 * 3.0 + 2 * 4.0) / 5)
  assert m["tokens_per_forward"] == pytest.approx((1.5 + 2.5) / 2)
  assert m["est_tokens_per_s"] == pytest.approx((10 + 11) / (0.006 + 0.004))  # measured time
  assert ps.best_static(recs, "max_tau", label_sets.cycle_costs(recs)) == 2  # 3.25 > 2.5


# ---- the report's rows ----------------------------------------------------------------------


def test_report_rows_tell_tau_from_tokens_per_forward():
  runs = [{"new_tokens": 7, "prefill_s": 0.0, "decode_s": 1.0, "block_size": 4,
           "acceptance_lengths": [3, 1], "forward_lengths": [3, 1, 1, 1]},
          {"new_tokens": 5, "prefill_s": 0.0, "decode_s": 1.0, "block_size": 4,
           "acceptance_lengths": [4], "forward_lengths": [4]}]
  row = rep.method_row("fixed b=4", runs)
  assert row["tau"] == pytest.approx((2.0 + 4.0) / 2)
  assert row["tau_pooled_over_cycles"] == pytest.approx(8 / 3)
  assert row["tokens_per_forward"] == pytest.approx((1.5 + 4.0) / 2)
  assert row["cycles"] == 3 and row["ar_steps"] == 2 and row["ar_step_share"] == pytest.approx(0.4)
  head = rep.markdown_table([row]).splitlines()[0]
  assert "τ per spec. cycle" in head and "tokens per target forward" in head
  assert "| 3.000 | 2.667 | 2.750 | 40.0% |" in rep.markdown_table([row])


def test_report_rows_of_real_fallback_runs(engine):
  gens = [engine.generate(p, max_new_tokens=MAX_NEW, block_size=4) for p in _prompts(4)]
  assert any(g.ar_steps for g in gens)
  row = rep.method_row("fixed b=4", [_run_record("b=4", str(i), g) for i, g in enumerate(gens)])
  assert row["tau"] == pytest.approx(np.mean([g.tau for g in gens]))
  assert row["tokens_per_forward"] == pytest.approx(np.mean([g.tokens_per_forward for g in gens]))
  assert row["ar_steps"] == sum(g.ar_steps for g in gens)
  assert row["cycles"] == sum(g.cycles for g in gens)
