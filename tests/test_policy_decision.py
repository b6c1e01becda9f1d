"""The value head and its expected-value decision (bp_jax/policy/mlp.py `BlockPolicy.decide`,
bp_jax/train/policy_stage.py `choose_lam`): an uninformative value policy decodes with the
static size, strong evidence moves it, the head learns a known rule, checkpoints keep the
decision rule, and lam chosen on noise gives static-size behaviour. The priced head: its counts
priced by the costs in effect pick what those costs make cheapest (a middle size at a CPU's, the
longest at an accelerator's), lam = 0 is the best static size of the prices, checkpoints keep
its rule and prices, and counts learned at one machine's prices decide right at another's."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bp_jax.errors import BadInputError
from bp_jax.optim_config import opt_config
from bp_jax.data import label_sets
from bp_jax.policy.mlp import BlockPolicy, PolicyArch, load_policy, save_policy
from bp_jax.train.policy_stage import (best_static, choice_metrics, choose_lam, count_prior,
                                       count_targets, crossfit_choice, fit_policy, label_prices,
                                       parse_heads, parse_lams, predict, relative_values,
                                       rule_totals, shrunk_choice, value_prior)

SIZES = (2, 3, 5, 8)
LAMS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _value_policy(F: int = 6, hidden: int = 8, depth: int = 1, seed: int = 0) -> BlockPolicy:
  return BlockPolicy(PolicyArch("last_hidden", F, hidden, depth, len(SIZES), head="value"),
                     rngs=nnx.Rngs(seed))


def _x(n: int, F: int = 6, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(n, F)).astype(np.float32)


# ---- the decision rule -----------------------------------------------------------------------


def test_classify_decide_is_softmax_and_argmax():
  policy = BlockPolicy(PolicyArch("last_hidden", 6, 8, 2, len(SIZES)), rngs=nnx.Rngs(1))
  x = jnp.asarray(_x(20))
  scores, cls = policy.decide(x)
  want = np.asarray(jnp.exp(policy(x)) / jnp.exp(policy(x)).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(scores), want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(cls), np.argmax(want, -1))
  assert policy.arch.signature == "last_hidden-6:8x2r-4-d0.2"  # unchanged by the head field


def test_uninformative_value_policy_picks_the_static_size():
  """lam = 0 (random weights), or rhat constant across sizes (any lam): the static class for
  every input, even where the prior ties another class with the static one."""
  x = jnp.asarray(_x(64))
  prior = np.array([0.9, 1.0, 1.0, 0.7])  # class 2 ties the static class 1
  policy = _value_policy(seed=3)
  policy.set_decision(prior, 0.0, 1)
  scores, cls = policy.decide(x)
  assert np.asarray(cls).tolist() == [1] * 64
  np.testing.assert_allclose(np.asarray(scores), np.tile(prior, (64, 1)), rtol=1e-6)
  policy.w_out[...] = jnp.zeros_like(policy.w_out[...])
  policy.b_out[...] = jnp.full((len(SIZES),), 1.3)
  for lam in LAMS:
    policy.set_decision(prior, lam, 1)
    assert np.asarray(policy.decide(x)[1]).tolist() == [1] * 64, lam
  policy.set_decision(np.array([1.0, 0.8, 0.8, 1.0]), 1.0, 3)  # another static class
  assert np.asarray(policy.decide(x)[1]).tolist() == [3] * 64


def test_strong_evidence_moves_the_decision():
  """rhat_j = 1 + 10 * relu(x_0), other sizes 1: inputs with x_0 > 0 pick j at lam = 1 (and
  at lam = 0.5 where the evidence outweighs the prior's deficit), the rest the static size."""
  F, j, static = 6, 3, 1
  policy = _value_policy(F=F, hidden=4, depth=1)
  w_in = np.zeros((F, 4), np.float32)
  w_in[0, 0] = 1.0
  w_out = np.zeros((4, len(SIZES)), np.float32)
  w_out[0, j] = 10.0
  policy.w_in[...] = jnp.asarray(w_in)
  policy.b_in[...] = jnp.zeros((4,))
  policy.w_out[...] = jnp.asarray(w_out)
  policy.b_out[...] = jnp.ones((len(SIZES),))
  x = _x(200, F, seed=5)
  prior = np.array([0.9, 1.0, 0.95, 0.8])
  policy.set_decision(prior, 1.0, static)
  cls = np.asarray(policy.decide(jnp.asarray(x))[1])
  np.testing.assert_array_equal(cls, np.where(x[:, 0] > 0, j, static))
  policy.set_decision(prior, 0.5, static)
  cls = np.asarray(policy.decide(jnp.asarray(x))[1])
  # 0.5 * (1 + 10 x0) + 0.5 * 0.8 > 1  <=>  x0 > 0.02
  np.testing.assert_array_equal(cls, np.where(x[:, 0] > 0.02, j, static))
  # The numpy decision of lam selection is the same rule.
  rhat = np.asarray(policy(jnp.asarray(x)))
  np.testing.assert_array_equal(shrunk_choice(rhat, prior, 0.5, static), cls)


def test_decision_rule_misuse_is_refused():
  policy = _value_policy()
  with pytest.raises(BadInputError, match="not maximal at the static class"):
    policy.set_decision(np.array([1.0, 1.2, 1.0, 1.0]), 0.5, 0)
  with pytest.raises(BadInputError, match="lam=1.5"):
    policy.set_decision(np.ones(4), 1.5, 0)
  with pytest.raises(BadInputError, match="static class 4"):
    policy.set_decision(np.ones(4), 0.5, 4)
  classify = BlockPolicy(PolicyArch("last_hidden", 6, 8, 1, 4), rngs=nnx.Rngs(0))
  with pytest.raises(BadInputError, match="only head='value'"):
    classify.set_decision(np.ones(4), 0.5, 0)
  with pytest.raises(BadInputError, match="unknown policy head 'regress'"):
    PolicyArch("last_hidden", 6, 8, 1, 4, head="regress")
  with pytest.raises(BadInputError, match="--config.blockpilot.heads"):
    parse_heads("classify,ranking")
  with pytest.raises(BadInputError, match="--config.blockpilot.value_lams"):
    parse_lams("0.5,1")
  assert parse_lams("1, 0.5,0") == (0.0, 0.5, 1.0)


# ---- checkpoints -----------------------------------------------------------------------------


def _save(policy: BlockPolicy, path: str) -> str:
  return save_policy(path, policy, block_sizes=SIZES, label_rule="max_throughput",
                     target_layer_ids=(0, 1), labelled_hashes=["abc"])


def test_value_checkpoint_round_trip_keeps_the_decision_rule(tmp_path):
  policy = _value_policy(depth=2)
  policy.set_feature_stats(np.full(6, 0.5), np.full(6, 2.0))
  policy.set_decision(np.array([0.8, 0.9, 1.0, 0.6]), 0.75, 2)
  loaded, info = load_policy(_save(policy, str(tmp_path / "value")))
  assert loaded.arch == policy.arch and loaded.arch.head == "value"
  assert loaded.decision() == policy.decision()
  assert loaded.decision()["lam"] == 0.75 and loaded.decision()["static_class"] == 2
  x = jnp.asarray(_x(16))
  for a, b in zip(loaded.decide(x), policy.decide(x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  assert info.meta["decision"]["lam"] == 0.75


def test_classify_checkpoint_without_a_head_field_loads_as_classify(tmp_path):
  """A checkpoint written before the head existed: config.json has no "head"."""
  policy = BlockPolicy(PolicyArch("last_hidden", 6, 8, 2, len(SIZES)), rngs=nnx.Rngs(2))
  path = _save(policy, str(tmp_path / "old"))
  config_path = os.path.join(path, "config.json")
  config = json.load(open(config_path))
  assert config.pop("head") == "classify"
  json.dump(config, open(config_path, "w"))
  loaded, _ = load_policy(path)
  assert loaded.arch == policy.arch and loaded.arch.head == "classify"
  assert loaded.decision() == {}
  x = jnp.asarray(_x(8))
  np.testing.assert_allclose(np.asarray(loaded.decide(x)[0]), np.asarray(policy.decide(x)[0]),
                             rtol=1e-6)


# ---- training and lam selection --------------------------------------------------------------


def test_value_head_learns_a_known_rule():
  """Relative values are a known function of 4 of 16 badly scaled features (the static class 1
  has r = 1 by definition): at lam = 1 the decisions agree with the best size on held-out
  inputs far more often than the static size does."""
  rng = np.random.default_rng(0)
  F, K, static = 16, len(SIZES), 1
  scales = np.exp(rng.normal(0, 1.5, F)).astype(np.float32)
  w = np.zeros((F, K), np.float32)
  w[:4] = rng.normal(size=(4, K))
  w[:, static] = 0.0

  def data(n):
    x = rng.normal(size=(n, F)).astype(np.float32)
    return x * scales - 2.0, (1.0 + 0.3 * np.tanh(x @ w)).astype(np.float32)

  (xt, rt), (xv, rv), (xe, re) = data(3000), data(300), data(1000)
  arch = PolicyArch("last_hidden", F, 64, 2, K, dropout=0.1, head="value")
  fit = fit_policy(xt, rt, xv, rv, arch, opt_cfg=opt_config(lr=3e-3, weight_decay=0.01),
                   steps=800, batch=128, label_smoothing=0.0, eval_every=50, patience=6,
                   seed=0)
  rhat = np.asarray(fit.policy(jnp.asarray(xe)))
  assert np.sqrt(np.mean((rhat - re) ** 2)) < 0.05, fit.history[-1]
  fit.policy.set_decision(np.ones(K), 1.0, static)
  agree = float((predict(fit.policy, xe) == np.argmax(re, 1)).mean())
  assert agree > 0.8, agree
  assert float((np.argmax(re, 1) == static).mean()) < 0.5


def _records(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
  """Synthetic label records of the paper's loop (every forward a cycle) over SIZES: per prompt
  the same new tokens at every size, cycles random around a size profile that makes size 5 the
  best static one; features pure noise. Returns (records, [K] cycle costs)."""
  rng = np.random.default_rng(seed)
  costs = np.array([1.0, 1.2, 1.5, 2.2])
  tau_mean = np.array([1.8, 2.4, 3.2, 4.1])  # tokens/s ~ tau / cost: 1.80, 2.00, 2.13, 1.86
  records = []
  for i in range(n):
    new = int(rng.integers(40, 120))
    tau = np.clip(tau_mean * np.exp(rng.normal(0, 0.25, len(SIZES))), 1.0, None)
    cycles = np.maximum(1, np.rint(new / tau)).astype(np.int32)
    records.append({"key": f"p{i}", "block_sizes": np.asarray(SIZES, np.int32),
                    "new_tokens": np.full(len(SIZES), new, np.int32), "cycles": cycles,
                    "forwards": cycles, "tau": (new / cycles).astype(np.float32),
                    "tokens_per_forward": (new / cycles).astype(np.float32),
                    "decode_s": (cycles * costs).astype(np.float32),
                    "feat_last_hidden": rng.normal(size=8).astype(np.float32)})
  return records, costs


@pytest.mark.parametrize("rule", ["max_throughput", "max_tau"])
def test_lam_chosen_on_noise_features_gives_static_behaviour(rule):
  """Features carry no information about the values: the value head fits noise, and the lam
  chosen on the validation prompts decodes (nearly) like the static size: lam = 0, or
  decisions equal to the static size's on the validation prompts."""
  records, costs = _records(360, seed=1)
  tr, va = np.arange(240), np.arange(240, 360)
  rec_tr = [records[i] for i in tr]
  values = label_sets.label_values(records, rule, costs)
  static = best_static(rec_tr, rule, costs)
  r = relative_values(values, static)
  prior = value_prior(r[tr], static)
  assert prior[static] == 1.0 and prior.max() == 1.0
  x = label_sets.stack(records, "feat_last_hidden").astype(np.float32)
  arch = PolicyArch("last_hidden", 8, 32, 2, len(SIZES), dropout=0.0, head="value")
  # Overfit on purpose (no early stopping signal used beyond the best step).
  fit = fit_policy(x[tr], r[tr], x[va], r[va], arch, opt_cfg=opt_config(lr=3e-3,
                   weight_decay=0.0), steps=300, batch=64, label_smoothing=0.0, eval_every=300,
                   patience=1, seed=0)
  rhat = np.asarray(fit.policy(jnp.asarray(x[va])))
  assert (shrunk_choice(rhat, prior, 1.0, static) != static).any()  # unshrunk: it wanders
  num, den = rule_totals(records, rule, costs)
  lam, grid = choose_lam(rhat, prior, static, num[va], den[va], LAMS, reps=1000, level=0.9,
                         seed=0)
  assert [g["lam"] for g in grid] == list(LAMS)
  assert grid[0] == {"lam": 0.0, "vs_static": 1.0, "lo": 1.0, "hi": 1.0, "changed_frac": 0.0}
  chosen = shrunk_choice(rhat, prior, lam, static)
  assert lam == 0.0 or (chosen == static).all(), (lam, grid)
  # The rule's own figure: est. tokens/s of choice_metrics for the throughput rule.
  if rule == "max_throughput":
    rec_va = [records[i] for i in va]
    for g in grid:
      pick = shrunk_choice(rhat, prior, g["lam"], static)
      got = choice_metrics(rec_va, pick, costs)["est_tokens_per_s"]
      base = choice_metrics(rec_va, np.full(len(va), static), costs)["est_tokens_per_s"]
      assert got / base == pytest.approx(g["vs_static"], rel=1e-9)


def test_lam_selection_takes_real_evidence():
  """When rhat is the truth (an oracle's values), a lam > 0 is chosen and beats static."""
  records, costs = _records(200, seed=2)
  values = label_sets.label_values(records, "max_throughput", costs)
  static = best_static(records, "max_throughput", costs)
  r = relative_values(values, static)
  num, den = rule_totals(records, "max_throughput", costs)
  lam, grid = choose_lam(r, value_prior(r, static), static, num, den, LAMS, reps=500,
                         level=0.9, seed=0)
  assert lam > 0.0
  best = next(g for g in grid if g["lam"] == lam)
  assert best["lo"] >= 1.0 and best["vs_static"] > 1.05


def test_crossfit_decisions_use_lam_chosen_on_the_other_prompts():
  """Cross-fitting: with rhat the truth, each half's decisions follow the evidence of the other
  half (not static); with rhat pure noise they stay static (no lam qualifies on either half);
  fewer than 4 prompts: static."""
  records, costs = _records(200, seed=2)
  values = label_sets.label_values(records, "max_throughput", costs)
  static = best_static(records, "max_throughput", costs)
  r = relative_values(values, static)
  num, den = rule_totals(records, "max_throughput", costs)
  prior = value_prior(r, static)
  kw = dict(reps=300, level=0.9, seed=0)
  cf = crossfit_choice(r, prior, static, num, den, LAMS, **kw)
  assert (cf != static).mean() > 0.3
  m_cf = choice_metrics(records, cf, costs)["est_tokens_per_s"]
  m_static = choice_metrics(records, np.full(len(records), static), costs)["est_tokens_per_s"]
  assert m_cf > 1.05 * m_static
  noise = np.random.default_rng(0).normal(1.0, 0.3, r.shape)
  assert (crossfit_choice(noise, prior, static, num, den, LAMS, **kw) == static).mean() > 0.9
  assert (crossfit_choice(r[:3], prior, static, num[:3], den[:3], LAMS, **kw) == static).all()


# ---- the priced head: counts priced by the running machine's costs ---------------------------


def _priced_policy(counts=None, lam: float = 1.0, prior=None, F: int = 6, seed: int = 0
                   ) -> BlockPolicy:
  """A priced policy over SIZES; with `counts` ([2K]) every input predicts them (w_out zero)."""
  K = len(SIZES)
  policy = BlockPolicy(PolicyArch("last_hidden", F, 8, 2, K, head="priced"), rngs=nnx.Rngs(seed))
  if counts is not None:
    policy.w_out[...] = jnp.zeros_like(policy.w_out[...])
    policy.b_out[...] = jnp.asarray(counts, jnp.float32)
  policy.set_priced_decision(np.asarray(prior if prior is not None else np.r_[np.ones(K),
                                                                             np.zeros(K)]), lam)
  return policy


# Sizes 2, 3, 5, 8: τ 1.8, 2.5, 3.5, 4.4 (cycles per token 1/τ), no fallback step.
TAU = np.array([1.8, 2.5, 3.5, 4.4])
COUNTS = np.r_[1.0 / TAU, np.zeros(4)]
CPU_CYCLES = np.array([1.5, 2.0, 3.2, 5.0])     # a verify costs several AR steps
FLAT_CYCLES = np.array([1.0, 1.02, 1.05, 1.1])  # an accelerator's: about one AR step


def test_priced_decision_follows_the_machines_prices():
  """The same counts priced by a CPU's costs pick a middle size, by an accelerator's the
  longest; the scores are tokens per AR step's time (1 / (cycles x price + steps x price))."""
  policy = _priced_policy(COUNTS, prior=COUNTS)
  x = jnp.asarray(_x(5))
  for cycles, want in ((CPU_CYCLES, 1), (FLAT_CYCLES, 3)):
    policy.set_prices(cycles, np.ones(4))
    scores, cls = policy.decide(x)
    cost = COUNTS[:4] * cycles
    assert int(np.argmin(cost)) == want
    assert np.asarray(cls).tolist() == [want] * 5
    np.testing.assert_allclose(np.asarray(scores)[0], 1.0 / cost, rtol=1e-5)
    assert policy.prices() == {"cycle": [round(float(c), 4) for c in cycles],
                               "step": [1.0] * 4}
  # Fallback steps count at their own price: dear steps move the choice off sizes that take them.
  steps = np.r_[1.0 / TAU, 0.0, 0.0, 0.0, 0.6]
  policy.b_out[...] = jnp.asarray(steps, jnp.float32)
  policy.set_prices(FLAT_CYCLES, np.ones(4))
  assert np.asarray(policy.decide(x)[1]).tolist() == [2] * 5


def test_priced_decision_at_lam_0_is_the_best_static_size_of_the_prices():
  """lam = 0: the prior (the labelling set's counts) priced at the costs in effect, whatever the
  network says; it moves with the prices as the per-prompt choice does."""
  wild = np.r_[np.full(4, 0.01), np.zeros(4)]  # the network would pick anything
  policy = _priced_policy(wild, lam=0.0, prior=COUNTS)
  x = jnp.asarray(_x(7))
  policy.set_prices(CPU_CYCLES, np.ones(4))
  assert np.asarray(policy.decide(x)[1]).tolist() == [1] * 7
  policy.set_prices(FLAT_CYCLES, np.ones(4))
  assert np.asarray(policy.decide(x)[1]).tolist() == [3] * 7


def test_priced_decision_misuse_is_refused():
  policy = _priced_policy()
  with pytest.raises(BadInputError, match="2 cycle and 4 step costs"):
    policy.set_prices([1.0, 2.0], np.ones(4))
  with pytest.raises(BadInputError, match="finite and > 0"):
    policy.set_prices([1.0, 2.0, 0.0, 3.0], np.ones(4))
  with pytest.raises(BadInputError, match="give 8 counts >= 0"):
    policy.set_priced_decision(np.ones(4), 0.5)
  with pytest.raises(BadInputError, match="give 8 counts >= 0"):
    policy.set_priced_decision(-np.ones(8), 0.5)
  with pytest.raises(BadInputError, match="lam=2"):
    policy.set_priced_decision(np.ones(8), 2.0)
  with pytest.raises(BadInputError, match="only head='priced'"):
    _value_policy().set_prices(np.ones(4), np.ones(4))
  with pytest.raises(BadInputError, match="only head='priced'"):
    _value_policy().set_priced_decision(np.ones(8), 0.5)
  assert _value_policy().prices() == {}


def test_priced_checkpoint_round_trip_keeps_prior_lam_and_prices(tmp_path):
  policy = _priced_policy(COUNTS, lam=0.5, prior=COUNTS * 1.1)
  policy.set_prices(CPU_CYCLES, np.full(4, 1.2))
  loaded, info = load_policy(_save(policy, str(tmp_path / "priced")))
  assert loaded.arch == policy.arch and loaded.arch.num_outputs == 8
  assert loaded.arch.signature.endswith("-priced")
  assert loaded.decision() == policy.decision()
  assert info.meta["decision"]["prices"]["step"] == [1.2] * 4
  x = jnp.asarray(_x(9))
  for a, b in zip(loaded.decide(x), policy.decide(x)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_priced_head_learns_counts_that_price_right_on_another_machine():
  """Counts are a known function of 4 of 16 features; trained with one machine's prices as
  weights, the decisions priced by another machine's costs agree with the best size there far
  more often than that machine's best static size does."""
  rng = np.random.default_rng(1)
  F, K = 16, len(SIZES)
  w = rng.normal(size=(F, 1)).astype(np.float32)
  w[4:] = 0.0

  def data(n):
    x = rng.normal(size=(n, F)).astype(np.float32)
    # One acceptance level per prompt: τ of size b grows with it, saturating at b.
    q = 1.0 / (1.0 + np.exp(-(x @ w)))                              # [n, 1] in (0, 1)
    tau = (1.0 - q ** np.asarray(SIZES)[None, :]) / np.maximum(1.0 - q, 1e-3)
    return x, np.concatenate([1.0 / tau, np.zeros((n, K))], 1).astype(np.float32)

  (xt, yt), (xv, yv), (xe, ye) = data(3000), data(300), data(1000)
  labelled = np.r_[CPU_CYCLES, np.ones(K)]
  arch = PolicyArch("last_hidden", F, 64, 2, K, dropout=0.0, head="priced")
  fit = fit_policy(xt, yt, xv, yv, arch, opt_cfg=opt_config(lr=3e-3, weight_decay=0.01),
                   steps=800, batch=128, label_smoothing=0.0, eval_every=50, patience=6,
                   seed=0, prices_2C=labelled)
  assert fit.policy.prices()["cycle"] == [round(float(c), 4) for c in CPU_CYCLES]
  fit.policy.set_priced_decision(yt.mean(0), 1.0)
  other = np.array([1.0, 1.3, 1.9, 2.9])  # a machine between the CPU and an accelerator
  fit.policy.set_prices(other, np.ones(K))
  true_cost = ye[:, :K] * other[None, :]
  best = np.argmin(true_cost, 1)
  # The counts' own argmin (the scores: 1 / predicted cost), before the decision's margin.
  cheapest = np.argmax(np.asarray(fit.policy.decide(jnp.asarray(xe))[0]), 1)
  agree = float((cheapest == best).mean())
  static_size = np.bincount(best, minlength=K).argmax()
  static = float((best == static_size).mean())
  assert agree > 0.85 and agree > static + 0.2, (agree, static)
  # The decision (held to the prior's cheapest size but for a margin) costs less than it.
  picked = predict(fit.policy, xe)
  rows = np.arange(len(xe))
  assert true_cost[rows, picked].sum() < true_cost[:, static_size].sum()
  with pytest.raises(BadInputError, match="labelling machine's prices"):
    fit_policy(xt, yt, None, None, arch, opt_cfg=opt_config(), steps=1, batch=8,
               label_smoothing=0.0, eval_every=1, patience=1, seed=0)


def test_count_targets_prior_and_label_prices():
  """The priced head's training data from label records: cycles and fallback steps per new
  token; the pooled prior; the labelling table's prices in AR steps (size 1 = AR steps)."""
  sizes = (1, 4, 8)
  rec = lambda new, cyc, fwd: {"block_sizes": np.asarray(sizes), "new_tokens": np.asarray(new),
                               "cycles": np.asarray(cyc), "forwards": np.asarray(fwd)}
  records = [rec([10, 10, 10], [10, 4, 2], [10, 6, 2]), rec([30, 30, 30], [30, 10, 5],
                                                            [30, 10, 5])]
  np.testing.assert_allclose(count_targets(records)[0], [1.0, 0.4, 0.2, 0.0, 0.2, 0.0])
  np.testing.assert_allclose(count_prior(records), [1.0, 14 / 40, 7 / 40, 0.0, 2 / 40, 0.0])
  table = {"ar_step_s": 0.5, "cycle_s": {"4": 1.0, "8": 2.0}, "fallback_step_s": {"4": 0.6}}
  np.testing.assert_allclose(label_prices(table, sizes), [1.0, 2.0, 4.0, 1.0, 1.2, 1.0])
  with pytest.raises(BadInputError, match="priced by a cost table"):
    label_prices(np.ones(3), sizes)


def test_the_priced_loss_weighs_the_sizes_priced_costs_relative_to_each_other():
  """`_priced_metrics`' relative term: an error that moves every size's priced cost of a
  prompt alike costs nothing there (the decision does not change), one that reorders the
  sizes does; the counts' own error counts both. A negative weight is refused."""
  from bp_jax.train.policy_stage import _priced_metrics
  prices = jnp.asarray([2.0, 3.0, 4.0, 1.0, 1.0, 1.0])  # [cycles of sizes, their steps]
  y = jnp.asarray([[0.5, 0.4, 0.35, 0.1, 0.1, 0.1]])
  alike = y + jnp.asarray([[0.1 / 2.0, 0.1 / 3.0, 0.1 / 4.0, 0.0, 0.0, 0.0]])  # +0.1 each size
  reorder = y + jnp.asarray([[0.1, 0.0, -0.15, 0.0, 0.0, 0.0]])  # size 3 cheapest now
  loss = lambda pred, rel: float(_priced_metrics(pred, y, prices, rel)[0])
  assert loss(alike, 0.0) > 0 and loss(alike, 30.0) == pytest.approx(loss(alike, 0.0), rel=1e-5)
  assert loss(reorder, 30.0) > loss(reorder, 0.0) + 1.0
  assert float(_priced_metrics(reorder, y, prices, 30.0)[1]["accuracy"]) == 0.0
  x = np.zeros((4, 3), np.float32)
  arch = PolicyArch("last_hidden", 3, 8, 1, 3, head="priced")
  with pytest.raises(BadInputError, match="priced_relative_weight"):
    fit_policy(x, np.ones((4, 6), np.float32), None, None, arch, opt_cfg=opt_config(),
               steps=1, batch=2, label_smoothing=0.0, eval_every=1, patience=1, seed=0,
               prices_2C=np.asarray(prices), priced_relative_weight=-1.0)


def test_a_priced_policy_leaves_the_static_size_only_for_a_margin():
  """A size other than the prior's cheapest at the prices in effect is picked only where its
  predicted cost is lower by more than `PRICED_DEPART_MARGIN`: a size predicted 3% cheaper
  than the static one is not picked, one 8% cheaper is; the scores are the costs' own."""
  from bp_jax.policy.mlp import PRICED_DEPART_MARGIN

  assert PRICED_DEPART_MARGIN == pytest.approx(0.05)
  x = jnp.asarray(_x(4))
  for cheaper, want in ((0.03, 1), (0.08, 2)):
    # Sizes 2, 3, 5, 8 at CPU prices; the prior's cheapest is 3 (class 1); the network
    # predicts size 5's cycles so that its cost is `cheaper` below size 3's.
    counts = COUNTS.copy()
    static_cost = COUNTS[1] * CPU_CYCLES[1]
    counts[2] = (1.0 - cheaper) * static_cost / CPU_CYCLES[2]
    policy = _priced_policy(counts, lam=1.0, prior=COUNTS)
    policy.set_prices(CPU_CYCLES, np.ones(4))
    scores, cls = policy.decide(x)
    cost = counts[:4] * CPU_CYCLES
    np.testing.assert_allclose(np.asarray(scores)[0], 1.0 / cost, rtol=1e-5)
    assert int(np.argmin(cost)) == 2 and int(np.argmin(COUNTS[:4] * CPU_CYCLES)) == 1
    assert np.asarray(cls).tolist() == [want] * 4, (cheaper, cost)
