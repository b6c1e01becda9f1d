"""Token sampling with per-position keys, so that any decoder visiting the same position with
the same prefix draws the same token (AR and speculative decoding agree even at T > 0).

The distribution a token is drawn from is the target's *processed* distribution: its logits
divided by the temperature, then truncated by top-k, top-p and min-p (`processed_logits`), and
renormalised. Every decode mode samples exactly that distribution; T = 0 is the argmax.

Settings are traced values: scalars (one request) or [B] per row of a batch (`SamplingParams`
leaves of the loop state), so one compilation of a sampling form (`SamplingForm`: greedy,
drawing, truncating) serves every value of it and each row of a batch samples with its own
settings.
"""

from __future__ import annotations

import enum
import functools
from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingParams(NamedTuple):
  """The sampling settings of a request, as traced scalars, or of each row of a batch, as [B]
  arrays (one compilation of a `SamplingForm` serves every value of it).

  temperature: 0 = greedy (the other fields are then ignored).
  top_k: keep the k most likely tokens (0 = off). Tokens tied with the k-th are kept too.
  top_p: keep the smallest most-likely-first set whose probability reaches top_p, computed on
    the top-k-truncated distribution (1.0 = off). Tokens tied with the last kept one are kept.
  min_p: keep tokens whose probability is at least min_p times the most likely one's (0 = off),
    computed on the same (temperature-scaled) distribution.
  top_k and top_p may both be None inside a traced function: off, decided at trace time (no
  truncation traced: `SamplingForm.SAMPLED`); all four None: greedy, decided at trace time
  (`SamplingForm.GREEDY`, `in_form`).
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array


class SamplingForm(enum.IntEnum):
  """What a compiled program's sampling may do, chosen on the host per call from the settings of
  the requests it decodes (`form_of`) and compiled once per form used (a static part of the
  program, `in_form`): a greedy program carries no draw, no truncation and no branch on the
  settings, where one program for every setting branched at run time twice per speculative
  cycle (on a GPU each branch is a wait of the host for the device) and compiled every side.

  GREEDY: every request at temperature 0 (the argmax; nothing is drawn). SAMPLED: some request
  draws, none truncates by top-k or top-p (temperature and min_p only: no bisection over the
  vocabulary). ANY: any settings (what a caller that does not say gets)."""
  GREEDY = 0
  SAMPLED = 1
  ANY = 2


def form_of(settings: Iterable[tuple]) -> SamplingForm:
  """The least `SamplingForm` that serves every request of `settings`, each a host tuple
  (temperature, top_k, top_p[, min_p]); no request: GREEDY."""
  form = SamplingForm.GREEDY
  for temperature, top_k, top_p, *_ in settings:
    if float(temperature) > 0:
      form = max(form, SamplingForm.ANY if int(top_k) > 0 or float(top_p) < 1.0
                 else SamplingForm.SAMPLED)
  return form


def in_form(sp: SamplingParams, form: SamplingForm) -> SamplingParams:
  """`sp` as a program of `form` reads it: GREEDY all None (the argmax, decided at trace time),
  SAMPLED without top-k / top-p (None: off), ANY as given. The settings keep their values on
  the host and in a batch's state; only the traced program's use of them changes."""
  if form == SamplingForm.GREEDY:
    return SamplingParams(None, None, None, None)
  if form == SamplingForm.SAMPLED:
    return sp._replace(top_k=None, top_p=None)
  return sp


def sampling_params(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0) -> SamplingParams:
  """SamplingParams of host values (numpy float32 / int32 scalars, which a program's call moves
  with its other arguments; built as jax arrays the four took ~0.2 ms of eager transfers on this
  CPU, but the calls then pay most of that: a prefill measured no difference beyond the noise,
  docs/results/controller.md)."""
  return SamplingParams(np.float32(temperature), np.int32(top_k), np.float32(top_p),
                        np.float32(min_p))


def seed_key(seed: int) -> jax.Array:
  """The PRNG key of a request's seed, `jax.random.key(seed)`, made once per seed and PRNG
  implementation and then reused (keys are immutable and no program donates one). Each
  `jax.random.key` is an eager program of its own: ~0.3-0.5 ms of host time per call on the
  demo's 2-core CPU between a request's calls, and a request made two (its prefill's, its
  loop's or slot's); with the key reused a batch-1 request spent ~0.5 ms less besides its
  prefill and loop calls (docs/results/controller.md)."""
  return _seed_key(int(seed), str(jax.config.jax_default_prng_impl))


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int, impl: str) -> jax.Array:
  del impl  # (part of the cache's key: a key of another implementation is another array)
  return jax.random.key(seed)


def row_params(B: int) -> SamplingParams:
  """[B] greedy settings (temperature 0, nothing truncated): a batch's empty slots."""
  return SamplingParams(jnp.zeros((B,), jnp.float32), jnp.zeros((B,), jnp.int32),
                        jnp.ones((B,), jnp.float32), jnp.zeros((B,), jnp.float32))


def set_row(sp_B: SamplingParams, row, sp: SamplingParams) -> SamplingParams:
  """`sp_B` with row `row` holding the scalar settings `sp`."""
  return SamplingParams(*(b.at[row].set(jnp.asarray(v, b.dtype)) for b, v in zip(sp_B, sp)))


def _rows(leaf: jax.Array, ndim: int) -> jax.Array:
  """A setting (a scalar, or [B] per row) shaped to broadcast over arrays of `ndim` dims whose
  leading axis is the row."""
  leaf = jnp.asarray(leaf)
  return leaf.reshape(leaf.shape + (1,) * (ndim - leaf.ndim))


def is_greedy(sp: SamplingParams) -> bool:
  """Whether `sp` is greedy by form (`in_form(.., GREEDY)`): known at trace time."""
  return sp.temperature is None


def as_sampling(sp) -> SamplingParams:
  """`sp` itself, or plain temperature-only sampling from a temperature scalar."""
  if isinstance(sp, SamplingParams):
    return sp
  return SamplingParams(jnp.asarray(sp, jnp.float32), jnp.int32(0), jnp.float32(1.0),
                        jnp.float32(0.0))


def position_keys(seed_key: jax.Array, pos: jax.Array) -> jax.Array:
  """One typed PRNG key per absolute position, shaped like `pos`."""
  flat = jax.vmap(lambda p: jax.random.fold_in(seed_key, p))(pos.reshape(-1))
  return flat.reshape(pos.shape)


def first_argmax(x: jax.Array) -> jax.Array:
  """int32 argmax over the last axis (the first index of the maximum, as `jnp.argmax`).

  Computed as a max and then a min over the indices where the max is reached: two plain
  reductions, which XLA:CPU vectorises, instead of the variadic (value, index) reduce of
  `jnp.argmax` (~3x slower on [8, 4096] logits, twice per speculative cycle).
  """
  V = x.shape[-1]
  at_max = x == jnp.max(x, axis=-1, keepdims=True)
  return jnp.min(jnp.where(at_max, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def _ordered(x: jax.Array) -> jax.Array:
  """uint32 keys of float32 values in the same order (-inf lowest; no NaN)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


# How many of a row's largest values `_truncate` reads first: top-k settings up to this many
# (Hugging Face's default 50, Qwen3's recommended 20) and every top-p set inside them are read
# off their partial sort, one pass of XLA's TopK over the vocabulary (~17 us per row of 4,096 on
# the development CPU, against ~50 us for the two bisections). Wider costs more per row: TopK of
# 256 there took 3x that of 64. 0: every row bisected (benchmarks compare the two: a TopK over
# a GPU's 151,936-token rows has not been timed against the bisection).
TOP_CANDIDATES = 64


def _bisect(holds, shape) -> jax.Array:
  """uint32 keys [shape]: per row the smallest key at which `holds(key [..., 1]) -> [..., 1]
  bool` is true, for a predicate false below some key and true from it on, true at the
  largest key (32 halvings of the key range)."""
  def halve(_, lo_hi):
    lo, hi = lo_hi
    mid = lo + ((hi - lo) >> 1)
    ok = holds(mid)
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
  lo = jnp.zeros(shape, jnp.uint32)
  hi = jnp.full(shape, 0xFFFFFFFF, jnp.uint32)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


class _Thresholds(NamedTuple):
  """Per row of logits [..., V], uint32 keys [..., 1] of the values a truncation cuts at, and
  whether each is settled ([..., 1] bool; elsewhere the key is meaningless)."""
  kth: jax.Array  # the k-th largest value's (top-k; all values kept: that of -inf or the least)
  kth_found: jax.Array
  last: jax.Array  # the smallest value kept's (top-k, then top-p)
  found: jax.Array


def _bisected_threshold(x: jax.Array, top_k: jax.Array, top_p: jax.Array,
                        known: _Thresholds | None = None) -> jax.Array:
  """uint32 keys [..., 1] of the smallest value `_truncate` keeps in each row of x [..., V],
  found by bisection over the values (reductions only: no sort, which costs XLA:CPU ~5 ms on
  [8, 4096] logits). The k-th largest value: the largest t with at least k values >= t (ties
  with it kept); bisected only where some row's is not `known` already. Of the values kept,
  the most likely first until the mass before a token reaches top_p: the smallest kept value v
  whose strictly larger values weigh < top_p (ties with it kept); the mass is the
  top-k-truncated distribution's (its ties included)."""
  V = x.shape[-1]
  key = _ordered(x)
  shape = x.shape[:-1] + (1,)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  # The k-th value: the smallest key with fewer than k values above it is that value's key.
  bisect_kth = lambda: _bisect(lambda t: jnp.sum(key > t, axis=-1, keepdims=True) < k, shape)
  if known is None:
    kth = bisect_kth()
  else:
    kth = jax.lax.cond(jnp.all(known.kth_found), lambda: known.kth,
                       lambda: jnp.where(known.kth_found, known.kth, bisect_kth()))
  p = jax.nn.softmax(jnp.where(key >= kth, x, -jnp.inf), axis=-1)
  last = _bisect(lambda t: jnp.sum(jnp.where(key > t, p, 0.0), axis=-1, keepdims=True)
                 < top_p, shape)
  return jnp.where(top_p >= 1.0, kth, jnp.maximum(last, kth))


def _top_threshold(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> _Thresholds:
  """The thresholds of `_bisected_threshold`, read off each row's TOP_CANDIDATES largest values
  of x [..., V]. Everything above a candidate is a candidate, so a candidate's top-k rank and
  the mass strictly above it are exact; the top-p threshold is the smallest candidate with less
  than top_p above it. The k-th value is found for a top-k within the candidates (or none); the
  last kept one where, besides, there is no top-p, a top-k within the candidates (whose set lies
  inside them), or the mass above the last candidate already reaching top_p."""
  V = x.shape[-1]
  n = min(TOP_CANDIDATES, V)
  shape = x.shape[:-1] + (1,)
  top_k, top_p = jnp.broadcast_to(top_k, shape), jnp.broadcast_to(top_p, shape)
  # The barrier keeps XLA's TopK whole: with its output fused into the consumers below, XLA:CPU
  # sorted the whole vocabulary instead (~5 ms on [8, 4096]).
  vals_n = jax.lax.optimization_barrier(jax.lax.top_k(x, n)[0])  # descending
  ranked = (top_k > 0) & (top_k <= n)
  kth = jnp.where(ranked, jnp.take_along_axis(vals_n, jnp.clip(top_k - 1, 0, n - 1), axis=-1),
                  -jnp.inf)
  top = vals_n[..., :1]
  mass = jnp.sum(jnp.where(x >= kth, jnp.exp(x - top), 0.0), axis=-1, keepdims=True)
  p_n = jnp.where(vals_n >= kth, jnp.exp(vals_n - top), 0.0) / mass
  above_n = jnp.sum(jnp.where(vals_n[..., None, :] > vals_n[..., :, None], p_n[..., None, :], 0.0),
                    axis=-1)
  smallest = jnp.min(jnp.where(above_n < top_p, vals_n, jnp.inf), axis=-1, keepdims=True)
  last = jnp.where(top_p >= 1.0, kth, jnp.maximum(smallest, kth))
  kth_found = (top_k <= 0) | ranked
  found = kth_found & ((top_p >= 1.0) | ranked | (above_n[..., -1:] >= top_p) | (n == V))
  return _Thresholds(_ordered(kth), kth_found, _ordered(last), found)


def _truncate(x: jax.Array, top_k: jax.Array, top_p: jax.Array, moot: jax.Array) -> jax.Array:
  """x [..., V] scaled logits with -inf outside the top-k and then the top-p set (see
  `SamplingParams`). Each row's threshold is read off its largest values (`_top_threshold`);
  only where some row's is not found there, and its result counts (`moot` false: a row at
  T = 0 takes the argmax of its raw logits), the bisection runs (`_bisected_threshold`, for the
  k-th value only where that is not found either), and only those rows take its threshold: a
  row's result depends on its own values and settings alone, whatever the other rows hold."""
  if TOP_CANDIDATES <= 0:
    return jnp.where(_ordered(x) >= _bisected_threshold(x, top_k, top_p), x, -jnp.inf)
  known = _top_threshold(x, top_k, top_p)
  known = known._replace(kth_found=known.kth_found | moot, found=known.found | moot)
  last = jax.lax.cond(
      jnp.all(known.found), lambda: known.last,
      lambda: jnp.where(known.found, known.last, _bisected_threshold(x, top_k, top_p, known)))
  return jnp.where(_ordered(x) >= last, x, -jnp.inf)


def processed_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """float32 logits [..., V] / temperature, -inf outside the top-k / top-p / min-p set: the
  distribution every mode samples (softmax of this). Only for temperature > 0 (a row at T = 0
  gets a meaningless result). `sp`: scalars, or per row (leaves [B] for logits [B, ..., V]).
  With top_k and top_p both None (`SamplingParams`) the truncation is not traced at all;
  otherwise every row's is computed (rows without either keep every token), for a batch at
  once: under a `vmap` over rows its one branch (`_truncate`) would compute both sides."""
  nd = logits.ndim
  temperature, min_p = _rows(sp.temperature, nd), _rows(sp.min_p, nd)
  x = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  if sp.top_k is not None or sp.top_p is not None:  # both None: off (`SamplingParams`)
    x = _truncate(x, _rows(sp.top_k, nd), _rows(sp.top_p, nd),
                  jnp.broadcast_to(temperature <= 0, x.shape[:-1] + (1,)))
  floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))
  return jnp.where((min_p > 0) & (x < floor), -jnp.inf, x)


def draw(logits: jax.Array, keys: jax.Array) -> jax.Array:
  """int32 draws [...] from softmax(logits [..., V]) with typed keys [...] (one per row): the
  Gumbel-max draws of `jax.random.categorical` (the same noise, so the same tokens for a key),
  their argmax taken by `first_argmax` instead of the variadic reduce behind `jnp.argmax`."""
  flat = logits.reshape(-1, logits.shape[-1])
  noisy = jax.vmap(lambda key, x: jax.random.gumbel(key, x.shape, x.dtype) + x)(
      keys.reshape(-1), flat)
  return first_argmax(noisy).reshape(logits.shape[:-1])


# Tokens per block of `draw_by_cdf`'s two-level running sum.
CDF_BLOCK = 64


def draw_by_cdf(logits: jax.Array, keys: jax.Array) -> jax.Array:
  """int32 draws [...] from softmax(logits [..., V]) with typed keys [...] (one per row), by the
  inverse of the distribution's running sum: one uniform per row instead of `draw`'s V (its
  Gumbel noise costs XLA:CPU ~3x this over the vocabulary). u is taken in (0, 1] of the total,
  so a token of probability 0 is never drawn. Other draws than `draw`'s for the same keys: for
  streams whose tokens no caller compares with plain AR decoding's (the drafts and residuals of
  rejection sampling), never for the target's own.

  The running sum is taken in two levels, over blocks of CDF_BLOCK tokens and then within the
  one block where it crosses u: XLA's cumulative sum over the whole vocabulary is a
  log-depth scan (on [56, 4096] on the development CPU 1.15 ms, 7x a softmax), where the
  block sums are one reduction. The token counted is the same: every token of an earlier
  block lies below u, none of a later one."""
  V = logits.shape[-1]
  flat = logits.reshape(-1, V)
  R, n = flat.shape[0], -(-V // CDF_BLOCK)
  p = jax.nn.softmax(flat.astype(jnp.float32), axis=-1)
  p = jnp.pad(p, ((0, 0), (0, n * CDF_BLOCK - V))).reshape(R, n, CDF_BLOCK)  # padding: p = 0
  block_R_n = jnp.sum(p, axis=-1)
  upto_R_n = jnp.cumsum(block_R_n, axis=-1)  # inclusive, over the blocks
  u = (1.0 - jax.vmap(jax.random.uniform)(keys.reshape(-1))) * upto_R_n[:, -1]
  j = jnp.minimum(jnp.sum(upto_R_n < u[:, None], axis=-1), n - 1)  # the block crossing u
  before = jnp.take_along_axis(upto_R_n - block_R_n, j[:, None], axis=-1)[:, 0]
  within = jnp.take_along_axis(p, j[:, None, None], axis=1)[:, 0]  # [R, CDF_BLOCK]
  cdf = before[:, None] + jnp.cumsum(within, axis=-1)
  out = jnp.minimum(j * CDF_BLOCK + jnp.sum(cdf < u[:, None], axis=-1), V - 1)
  return out.reshape(logits.shape[:-1]).astype(jnp.int32)


def sample(logits: jax.Array, sp, keys: jax.Array | None, processed: jax.Array | None = None
           ) -> jax.Array:
  """Samples [...] tokens from logits [..., V] with typed keys [...] (None where `sp` is greedy
  by form: a greedy program derives no keys).

  `sp`: SamplingParams (scalars, or [B] per row of logits [B, ..., V]; all None: greedy by
  form, `in_form`), or a temperature scalar. Temperature 0 gives the argmax; otherwise one
  draw from softmax(processed_logits(logits, sp)) (`processed`: that, where the caller has it
  already). A row's tokens depend on its own settings and keys only, whatever the other rows
  ask.

  Greedy by form, nothing is drawn. Otherwise the draws are computed for every row and a row at
  temperature 0 takes the argmax, with no run-time branch: a program of a drawing form runs
  because some request draws (`form_of`), and a branch on the rows' temperatures would cost
  every AR step a wait of the host for the device on a GPU.
  """
  sp = as_sampling(sp)
  if is_greedy(sp):  # a greedy program (`SamplingForm.GREEDY`): nothing drawn
    return first_argmax(logits)
  if processed is None:
    processed = processed_logits(logits, sp)
  hot = _rows(sp.temperature, logits.ndim - 1) > 0
  return jnp.where(hot, draw(processed, keys), first_argmax(logits))
