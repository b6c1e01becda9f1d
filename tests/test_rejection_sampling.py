"""Every verify mode samples exactly the target's processed distribution (temperature, top-k,
top-p, min-p), and deliberately broken rejection rules are caught by the same tests.

Two levels:
  * the cycle rule alone (`verify.propose` + `verify.rejection_sample` on fixed logits): the
    first committed token is distributed as p~_0, and, given the first draft was accepted, the
    second as p~_1 — 60,000 seeds per setting in one vmapped call;
  * the whole compiled pipeline (prefill + speculative loop, b=4) on a tiny 16-token target:
    the joint distribution of the first three generated tokens over 12,000 seeds (one vmapped
    call) against the target's own, enumerated in float64 with transformers and truncated by an
    independent numpy implementation (`sampling_stats.reference_probs`).
Chi-square tests at ALPHA = 1e-6 (`sampling_stats.chi_square`).
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from bp_jax.decoding import loops, sampling, verify
from bp_jax.decode_job.block_choice import loop_options
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.decoding.sampling import (SamplingForm, SamplingParams, in_form, processed_logits,
                                      sampling_params)
from bp_jax.errors import BadInputError
from sampling_stats import (PROMPT, V, chi_square, counts_of, exact_joint, reference_probs,
                            tiny_models)

SETTINGS = {  # name -> (temperature, top_k, top_p, min_p)
    "T=1": (1.0, 0, 1.0, 0.0),
    "T=0.6,top_k=5": (0.6, 5, 1.0, 0.0),
    "T=1,top_p=0.8": (1.0, 0, 0.8, 0.0),
    "T=1,min_p=0.1": (1.0, 0, 1.0, 0.1),
}
N_RULE = 60_000
N_LOOP = 12_000
B = 4
MAX_LEN = 16


def _kw(setting):
  t, k, p, m = SETTINGS[setting]
  return dict(temperature=t, top_k=k, top_p=p, min_p=m)


# ---- the cycle rule alone ----------------------------------------------------------------------

def _rule_logits():
  """Fixed target logits [3, V] (positions 0..2) and drafter logits [2, V] that half agree
  (1 - TV between 0.19 and 0.51 in every setting): acceptances, rejections and residual draws
  are all frequent."""
  p = 1.5 * jax.random.normal(jax.random.key(11), (3, V))
  q = p[:2] + jax.random.normal(jax.random.key(12), (2, V))
  return p, q


@jax.jit
def _run_rule(p, q, sp, seeds):
  pos = jnp.int32(5)

  def one(seed):
    key = jax.random.key(seed)
    d = verify.propose(q, "rejection", sp, key, pos)
    y, a = verify.rejection_sample(processed_logits(p, sp), processed_logits(q, sp), d, key, pos)
    return y, a

  return jax.vmap(one)(seeds)


def _rule_checks(setting, seeds):
  p, q = _rule_logits()
  sp = sampling_params(**_kw(setting))
  y, a = (np.asarray(x) for x in _run_rule(p, q, sp, seeds))
  want = reference_probs(np.asarray(p), **_kw(setting))
  first = np.bincount(y[:, 0], minlength=V)
  second = np.bincount(y[a >= 1, 1], minlength=V)
  return a, [("1st token", first, want[0]), ("2nd token | 1st draft accepted", second, want[1])]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_rejection_rule_commits_the_target_distribution(setting):
  a, checks = _rule_checks(setting, jnp.arange(N_RULE))
  assert 0.05 < np.mean(a == 0) < 0.95, np.mean(a == 0)  # rejections and acceptances both
  for what, counts, probs in checks:
    stat, df, thr = chi_square(counts, probs)
    assert stat < thr, f"{setting}, {what}: chi2={stat:.1f} >= {thr:.1f} (df={df})"


def _no_residual(p_kV, q_kV):
  del q_kV
  return jnp.log(p_kV)  # a rejected position redrawn from p instead of max(0, p - q)


BROKEN = {
    "no residual": ("residual_logits", _no_residual),
    # The residual draw reuses the draft draw's stream: the same noise that picked d
    # picks the correction.
    "residual reuses the draft stream": ("RESIDUAL_STREAM", verify.DRAFT_STREAM),
    # The acceptance uniforms reuse the draft stream.
    "acceptance reuses the draft stream": ("ACCEPT_STREAM", verify.DRAFT_STREAM),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_rejection_rules_fail_the_same_test(broken, monkeypatch):
  name, value = BROKEN[broken]
  monkeypatch.setattr(verify, name, value)
  _run_rule.clear_cache()  # traced again with the broken rule
  try:
    _, checks = _rule_checks("T=1", jnp.arange(N_RULE))
  finally:
    _run_rule.clear_cache()
  stats = [chi_square(counts, probs) for _, counts, probs in checks]
  assert any(stat > thr for stat, _, thr in stats), (broken, stats)


def test_truncation_matches_the_reference_implementation():
  logits = 3.0 * jax.random.normal(jax.random.key(3), (64, 40))
  coarse = jnp.round(logits * 2) / 2  # many ties, as low-precision logits have
  for t, k, p, m in list(SETTINGS.values()) + [(0.7, 3, 0.5, 0.05), (1.3, 1, 1.0, 0.0),
                                               (1.0, 0, 0.05, 0.0), (1.0, 100, 1.0, 0.0),
                                               (1.0, 5, 0.6, 0.0), (0.8, 0, 0.3, 0.0)]:
    for x in (logits, coarse):
      got = np.asarray(jax.nn.softmax(processed_logits(x, sampling_params(t, k, p, m))))
      want = reference_probs(np.asarray(x), t, k, p, m)
      np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str((t, k, p, m)))
    kept = (reference_probs(np.asarray(logits), t, k, p, m) > 0).sum(-1)
    if k:
      assert kept.max() <= k
  # Ties at the k-th value are kept together.
  tied = jnp.array([[2.0, 1.0, 1.0, 0.0]])
  got = np.asarray(jax.nn.softmax(processed_logits(tied, sampling_params(1.0, 2))))
  assert (got[0] > 0).tolist() == [True, True, True, False]


def test_thresholds_read_off_the_largest_values_are_the_bisections():
  """`_truncate` reads each row's thresholds off its TOP_CANDIDATES largest values and bisects
  only the rows where those cannot tell: where they tell, they keep the tokens the bisection's
  threshold keeps (flat, peaked and heavily tied logits, ties at the k-th and the last kept
  value); they
  always tell for a top-k within them, never for one beyond them, and a top-p alone reaching
  past them is left to the bisection."""
  n = sampling.TOP_CANDIDATES
  V = 5 * n
  flat = 3.0 * jax.random.normal(jax.random.key(4), (48, V))
  peaked = 4.0 * flat
  coarse = jnp.round(flat * 2) / 2
  # Jitted: run eagerly, each operation of the loops inside compiled apart.
  top_threshold, ordered = jax.jit(sampling._top_threshold), jax.jit(sampling._ordered)
  bisected = jax.jit(sampling._bisected_threshold)
  untold = 0
  for k, p in [(0, 0.5), (0, 0.9), (0, 0.99), (20, 0.95), (50, 1.0), (n, 0.9), (1, 1.0),
               (0, 1.0), (5, 0.3), (n + 1, 1.0), (100, 0.8)]:
    for x in (flat, peaked, coarse):
      top = top_threshold(x, jnp.int32(k), jnp.float32(p))
      want = bisected(x, jnp.int32(k), jnp.float32(p))
      key = np.asarray(ordered(x))
      kept, want_kept = key >= np.asarray(top.last), key >= np.asarray(want)
      found = np.asarray(top.found)[:, 0]
      np.testing.assert_array_equal(kept[found], want_kept[found], err_msg=str((k, p)))
      # A k-th value found is the bisection's own, which then bisects only the top-p mass.
      kth_found = np.asarray(top.kth_found)[:, 0]
      np.testing.assert_array_equal(
          (key >= np.asarray(top.kth))[kth_found],
          (key >= np.asarray(bisected(x, jnp.int32(k), jnp.float32(1.0))))[
              kth_found], err_msg=str((k, p)))
      assert (found <= kth_found).all() and kth_found.all() == (k <= n)
      np.testing.assert_array_equal(
          key >= np.asarray(bisected(x, jnp.int32(k), jnp.float32(p), top)),
          want_kept, err_msg=str((k, p)))
      if k > n:
        assert not found.any(), (k, p)
      elif k > 0 or p >= 1.0:
        assert found.all(), (k, p)
      untold += int((~found).sum())
  assert untold > 0  # the flat rows' top-p sets reach past the candidates


def test_rows_bisected_or_not_each_match_the_reference_and_their_request_alone():
  """A batch whose rows need the bisection (top-k beyond the candidates, a wide top-p set)
  beside rows that do not, and a row at T = 0 whose settings would need it (moot: it takes the
  argmax): every drawing row's distribution is the reference's, and each row's processed
  logits are those of its settings alone."""
  V = 5 * sampling.TOP_CANDIDATES
  x = 3.0 * jax.random.normal(jax.random.key(5), (6, V))
  rows = [(1.0, 100, 1.0, 0.0), (1.0, 20, 0.95, 0.0), (1.0, 0, 0.99, 0.0), (0.7, 0, 0.5, 0.05),
          (0.0, 200, 0.9, 0.0), (1.3, 3, 1.0, 0.0)]
  sp_B = SamplingParams(*(jnp.asarray([r[i] for r in rows], dt) for i, dt in
                          enumerate((jnp.float32, jnp.int32, jnp.float32, jnp.float32))))
  got = np.asarray(jax.jit(processed_logits)(x, sp_B))
  for r, (t, k, p, m) in enumerate(rows):
    if t == 0:
      continue
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(got[r])),
                               reference_probs(np.asarray(x[r]), t, k, p, m)[None][0],
                               atol=2e-6, err_msg=str(rows[r]))
    alone = np.asarray(jax.jit(processed_logits)(x[r:r + 1], sampling_params(t, k, p, m)))
    np.testing.assert_array_equal(got[r], alone[0], err_msg=str(rows[r]))


# ---- the whole pipeline --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
  return tiny_models()


def _pipeline(models, mode: str):
  """seeds [N] -> the first three generated tokens [N, 3] of prefill + the speculative loop."""
  _, target, drafter = models
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  prefill = loops.make_prefill(t_graph, d_graph)
  spec = loops.make_spec_loop(t_graph, d_graph, LoopOptions(block_size=B, verify=mode))
  n = len(PROMPT)
  toks = jnp.zeros((1, 8), jnp.int32).at[0, :n].set(jnp.asarray(PROMPT))
  cache, dcache = target.init_cache(1, MAX_LEN), drafter.init_cache(1, MAX_LEN)
  stop = jnp.asarray([-1], jnp.int32)

  @jax.jit
  def run(sp, seeds):
    def one(seed):
      key = jax.random.key(seed)
      pre = prefill(t_state, d_state, toks, jnp.int32(n), cache, dcache, key, sp)
      out = spec(t_state, d_state, jnp.zeros((1, MAX_LEN), jnp.int32), pre.cache,
                 pre.draft_cache, pre.first_tok, jnp.int32(n), jnp.int32(3), sp, key, stop)
      return out.seq[0, n:n + 3], out.accept_lens[0]
    return jax.vmap(one)(seeds)

  return run


@pytest.mark.parametrize("mode", verify.VERIFY_MODES)
@pytest.mark.parametrize("setting", ["T=1", "T=0.6,top_k=5", "T=1,top_p=0.8"])
def test_speculative_loop_samples_the_target_distribution(models, mode, setting):
  run = _pipeline(models, mode)
  toks, first_cycle = (np.asarray(x) for x in run(sampling_params(**_kw(setting)),
                                                  jnp.arange(N_LOOP)))
  exact = exact_joint(models[0], PROMPT, **_kw(setting))
  # The first cycle rejects often; with rejection sampling it also accepts often (the random
  # drafter's argmax is rarely the target's sample: `exact` accepts ~1%, which
  # test_spec_sampling covers with a perfect-ish drafter).
  accepted = np.mean(first_cycle >= 2)
  assert accepted < 0.97 and (mode == "exact" or accepted > 0.1), accepted
  for k, probs in ((2, exact.sum(2)), (3, exact)):
    stat, df, thr = chi_square(counts_of(toks, k), probs)
    assert stat < thr, f"{mode} {setting}, first {k} tokens: chi2={stat:.1f} >= {thr:.1f}"


def test_speculative_loop_without_residual_fails(models, monkeypatch):
  monkeypatch.setattr(verify, "residual_logits", _no_residual)
  run = _pipeline(models, "rejection")  # traced with the broken rule
  toks, _ = (np.asarray(x) for x in run(sampling_params(1.0), jnp.arange(N_LOOP // 2)))
  stat, df, thr = chi_square(counts_of(toks, 3), exact_joint(models[0], PROMPT, temperature=1.0))
  assert stat > thr, f"no-residual rule not detected: chi2={stat:.1f} < {thr:.1f} (df={df})"


# ---- the engine ---------------------------------------------------------------------------------

def test_rejection_engine_greedy_equals_ar_and_is_reproducible(models):
  _, target, drafter = models
  eng = Engine(target, drafter=drafter,
               shapes=ShapeOptions(max_len=40, length_buckets=(8,), block_sizes=(3, 5)),
               loop=LoopOptions(verify="rejection"))
  rng = np.random.default_rng(1)
  for case in range(6):
    prompt = rng.integers(0, V, int(rng.integers(1, 9))).tolist()
    ar = eng.generate(prompt, max_new_tokens=20, block_size=1).output_ids
    for b in (3, 5):
      assert eng.generate(prompt, max_new_tokens=20, block_size=b).output_ids == ar
      runs = [eng.generate(prompt, max_new_tokens=20, block_size=b, temperature=1.0, top_p=0.9,
                           seed=case).output_ids for _ in range(2)]
      assert runs[0] == runs[1]
  # One prefill and one loop per block size and sampling form (greedy; any: top-p), whatever
  # the values (traced); the AR requests' prefill without the drafter (greedy only, as their
  # loop): greedy 2 prefills + 3 loops, any 1 prefill + 2 loops.
  assert eng.compiled.summary()["compilations"] == (2 + 3) + (1 + 2)


@pytest.mark.parametrize("kw, flag", [
    (dict(verify="argmax"), "--config.verify"),
])
def test_engine_refuses_an_unknown_verify_mode(models, kw, flag):
  """The library names its parameter, the command line (`loop_options`) the flag."""
  _, target, drafter = models
  with pytest.raises(BadInputError, match=rf"(?<![\w.-]){flag.removeprefix('--config.')}="):
    Engine(target, drafter=drafter, shapes=ShapeOptions(max_len=40, block_sizes=(3,)),
           loop=LoopOptions(**kw))
  with pytest.raises(BadInputError, match=flag):
    loop_options(ml_collections.ConfigDict(kw))


@pytest.mark.parametrize("kw, flag", [
    (dict(top_k=-1), "--config.top_k"), (dict(top_k=2.5), "--config.top_k"),
    (dict(top_p=0.0), "--config.top_p"), (dict(top_p=1.5), "--config.top_p"),
    (dict(min_p=1.0), "--config.min_p"), (dict(temperature=-0.1), "--config.temperature"),
])
def test_engine_refuses_bad_sampling_settings(models, kw, flag):
  _, target, _ = models
  eng = Engine(target, shapes=ShapeOptions(max_len=40, length_buckets=(8,)))
  with pytest.raises(BadInputError, match=flag):
    eng.generate([1, 2], max_new_tokens=4, **kw)


def _primitives(jaxpr, through_branches: bool = True) -> set[str]:
  """The primitives of a jaxpr and of its sub-jaxprs (calls, loop bodies and, with
  `through_branches`, the branches of a `cond`; without, only what runs whatever the values)."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    if through_branches or eqn.primitive.name != "cond":
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        names |= _primitives(sub, through_branches)
  return names


@pytest.mark.parametrize("mode", ["exact", "rejection"])
def test_batch_sampling_sorts_nothing_and_each_form_traces_only_what_it_needs(mode):
  """Top-k / top-p thresholds are read off each row's largest values (XLA's TopK, a partial
  sort), with a bisection over the values for the rows those cannot settle, never a sort of the
  vocabulary (XLA:CPU ~5 ms on [8, 4096] logits, several AR steps). With per-row settings (a
  batch's loop state) the program's sampling form (`SamplingForm`, chosen on the host for the
  rows a call decodes) decides what is traced: a greedy program draws nothing and branches on
  no setting, an untruncated one draws without truncating, and only ANY truncates, its
  bisection behind a branch (per processed distribution, for the whole batch: under the rows'
  vmap it would become a select that runs it always)."""
  B, b = 2, 4
  sp = jax.tree.map(lambda x: jnp.full((B,), x), sampling_params(1.0))
  keys = jax.vmap(jax.random.key)(jnp.arange(B))
  pos = jnp.zeros((B,), jnp.int32)
  rule = verify.RULES[mode]
  d_logits = jnp.zeros((B, b - 1, V))
  for form in SamplingForm:
    view = in_form(sp, form)
    for fn, args in ((rule.propose, (d_logits, view, keys, pos)),
                     (rule.verify, (jnp.zeros((B, b, V)), rule.q_of(d_logits, view),
                                    jnp.zeros((B, b - 1), jnp.int32), view, keys, pos))):
      jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
      prims = _primitives(jaxpr)
      drawing, bisecting = "random_bits" in prims, bool({"scan", "while"} & prims)
      samples = not (fn == rule.propose and mode == "exact")  # exact drafts the argmax
      assert "sort" not in prims, (mode, form, fn.__name__)
      assert not {"scan", "while"} & _primitives(jaxpr, through_branches=False), (mode, form)
      if form == SamplingForm.GREEDY:
        assert not drawing and not bisecting and "cond" not in prims, (mode, fn.__name__)
      else:
        assert drawing == samples, (mode, form, fn.__name__)
        truncates = samples and form == SamplingForm.ANY
        assert bisecting == truncates == ("top_k" in prims), (mode, form, fn.__name__)