"""Per-request sampling in one batch (`LoopState.sp_B`, `stop_BK`): rows with different
temperature / top-k / top-p / min-p / seed / stop ids decode together, each row's tokens are
those its request gets decoded alone, and new values compile nothing (the settings are traced
[B] leaves of the loop state, not compile-time constants).

Models: `toy_models.zeros_drafter_pair`, as tests/test_batched_decode.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.errors import BadInputError
from compile_counting import BackendCompiles
from toy_models import zeros_drafter_pair

V, MAX_LEN, BUCKETS = 64, 128, (16, 32, 64)

# (temperature, top_k, top_p, min_p) per row: greedy and sampled rows side by side.
SETTINGS = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 8, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
            (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.2), (0.9, 5, 0.9, 0.05)]
OTHER_SETTINGS = [(0.5, 3, 0.7, 0.1), (0.0, 0, 1.0, 0.0), (2.0, 0, 0.95, 0.0),
                  (1.1, 12, 1.0, 0.0), (0.8, 0, 1.0, 0.3), (0.0, 0, 1.0, 0.0),
                  (0.6, 2, 0.5, 0.0)]


@pytest.fixture(scope="module")
def models():
  return zeros_drafter_pair(V)


def _engine(models, batch_size: int, verify: str = "exact", shrink: bool = False) -> Engine:
  """With `exact`, AR fallback steps too (a row's tokens do not depend on when it steps); with
  `rejection` at T > 0 they would (the batch's schedule is not the row's own), so none. Its
  batches compute all slots unless `shrink` (each further slot size compiles its own loops)."""
  target, drafter = models
  return Engine(target, stop_ids=[V - 1], drafter=drafter,
                shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=(1, 4)),
                loop=LoopOptions(verify=verify, ar_fallback=4 if verify == "exact" else 0),
                batching=BatchOptions(batch_size=batch_size, sync_cycles=3, shrink=shrink))


def _requests(num: int, seed: int):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, V - 1, int(rng.integers(2, 40))).tolist() for _ in range(num)]
  return prompts, [int(rng.integers(8, 30)) for _ in range(num)]


def _columns(settings):
  return {name: [s[i] for s in settings]
          for i, name in enumerate(("temperature", "top_k", "top_p", "min_p"))}


@pytest.mark.parametrize("verify,b", [("exact", 4), ("rejection", 4), ("exact", 1)])
def test_rows_with_their_own_settings_equal_their_request_alone(models, verify, b):
  one, many = _engine(models, 1, verify), _engine(models, 3, verify)
  prompts, max_news = _requests(len(SETTINGS), seed=11)
  seeds = [100 + 7 * i for i in range(len(SETTINGS))]
  alone = [one.generate(p, max_new_tokens=m, block_size=b, seed=s, temperature=t, top_k=k,
                        top_p=tp, min_p=mp)
           for p, m, s, (t, k, tp, mp) in zip(prompts, max_news, seeds, SETTINGS)]
  together = many.generate_batch(prompts, max_new_tokens=max_news, block_size=b, seeds=seeds,
                                 **_columns(SETTINGS))
  assert [g.output_ids for g in together] == [g.output_ids for g in alone]
  # The settings do matter: the same rows with others' settings decode differently.
  swapped = many.generate_batch(prompts, max_new_tokens=max_news, block_size=b, seeds=seeds,
                                **_columns(OTHER_SETTINGS))
  assert [g.output_ids for g in swapped] != [g.output_ids for g in alone]


def test_per_row_stop_ids_and_no_compilation_for_new_values(models):
  eng = _engine(models, 2, shrink=True)  # its tail runs in 1 slot too
  prompts, max_news = _requests(len(SETTINGS), seed=12)
  first = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=1,
                             **_columns(SETTINGS))
  # A row's own stop id (its second token): its first occurrence stops the row.
  stops = [[g.output_ids[1]] if len(g.output_ids) > 2 else [] for g in first]
  assert sum(bool(s) for s in stops) >= 3
  # Every program a batch may take (its tail's sizes and windows too: rows that stop elsewhere
  # shrink the batch at other calls; each sampling form: a tail's rows may all be greedy, or
  # none truncating), so that only new values could compile anything.
  eng.precompile([4], all_windows=True, forms=tuple(SamplingForm))
  compiled = dict(eng.compiled.counts)
  with BackendCompiles() as c:
    again = eng.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=1,
                               stop_token_ids=stops, **_columns(SETTINGS))
    eng.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=99,
                       **_columns(OTHER_SETTINGS))
  assert c.n == 0 and dict(eng.compiled.counts) == compiled
  for g, h, s in zip(first, again, stops):
    cut = g.output_ids.index(s[0]) + 1 if s else len(g.output_ids)
    assert h.output_ids == g.output_ids[:cut]


def test_a_full_precompile_leaves_a_fresh_engine_nothing_to_compile(models):
  """A server's start-up (`precompile(all_windows=True)`) compiles every program its batches
  take, a request's insertion into a slot included: its first requests compile nothing."""
  eng = _engine(models, 2, shrink=True)
  eng.precompile([4], all_windows=True, forms=tuple(SamplingForm))
  compiled = dict(eng.compiled.counts)
  assert compiled["insert"] == 1  # into its bucket (this engine starts no request plain)
  prompts, max_news = _requests(len(SETTINGS), seed=5)
  eng.generate_batch(prompts, max_new_tokens=max_news, block_size=4, seeds=1,
                     **_columns(SETTINGS))
  assert dict(eng.compiled.counts) == compiled


def test_bad_per_request_settings_name_the_field(models):
  eng = _engine(models, 2)
  with pytest.raises(BadInputError, match="top_p"):
    eng.generate_batch([[1, 2]], max_new_tokens=4, top_p=[1.5])
  with pytest.raises(BadInputError, match="temperature"):
    eng.generate_batch([[1, 2], [3]], max_new_tokens=4, temperature=[0.0])
  with pytest.raises(BadInputError, match="stop_token_ids"):
    eng.generate_batch([[1, 2]], max_new_tokens=4, stop_token_ids=[list(range(20))])


def _poisoned(target, token: int):
  """A copy of `target` whose input embedding of `token` is NaN (untied lm_head: the logits stay
  finite until the token is fed in)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graph, state = nnx.split(target)
  copy = nnx.merge(graph, jax.tree.map(jnp.copy, state))
  copy.embed.value = copy.embed.value.at[token].set(jnp.nan)
  return copy


def test_a_request_with_nonfinite_logits_fails_alone(models):
  """Driven step by step as a server does (`Engine.scheduler`): a request whose prompt holds a
  token with a NaN embedding fails in its prefill, one that generates it fails at that decode
  step; the request beside them in the batch finishes with its own tokens."""
  target, drafter = models
  ref = _engine(models, 3)
  for seed in range(13, 60):  # requests where request 1 generates a token request 2 never sees
    prompts, max_news = _requests(3, seed=seed)
    clean = ref.generate_batch(prompts, max_new_tokens=max_news, block_size=4)
    seen = set(prompts[2]) | set(clean[2].output_ids) | set(prompts[1]) | {0, V - 1}
    bad = next((t for t in clean[1].output_ids[2:]
                if t not in seen and t not in clean[1].output_ids[:2]), None)
    if bad is not None:
      break
  prompts[0] = prompts[0] + [bad]
  eng = Engine(_poisoned(target, bad), stop_ids=[V - 1], drafter=drafter,
               shapes=ShapeOptions(max_len=MAX_LEN, length_buckets=BUCKETS, block_sizes=(4,)),
               loop=LoopOptions(ar_fallback=4),
               batching=BatchOptions(batch_size=3, sync_cycles=3, shrink=False))
  sched = eng.scheduler()
  for i, (p, m) in enumerate(zip(prompts, max_news)):
    sched.submit(eng.batch_request(i, p, m, 0, 4))
  failed, finished = {}, {}
  while sched.busy():
    report = sched.step()
    failed.update(report.failed)
    finished.update(report.finished)
  assert set(failed) == {0, 1} and set(finished) == {2}
  assert "the prefill produced NaN/inf logits" in str(failed[0])
  assert "a decode step produced NaN/inf logits" in str(failed[1])
  assert finished[2].output_ids == clean[2].output_ids
