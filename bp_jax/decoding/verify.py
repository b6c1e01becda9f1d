"""How a speculative cycle proposes its drafts and decides which the target keeps
(docs/design.md §3, §11).

Both rules are lossless: every committed token is distributed exactly as the target's processed
distribution (`sampling.processed_logits`) given the committed prefix; at T = 0 both are the
greedy rule (the drafter's argmax, kept while it equals the target's argmax).

`exact` (the DFlash reference, vLLM's and SGLang's default): the drafts are the drafter's
argmax; the target samples y_i at every block position with the position's key (the same draw
plain AR decoding makes there) and keeps the longest prefix with d_{i+1} == y_i. A draft
survives with probability p(d); at T > 0 the output is token-identical to AR for a seed.

`rejection` (speculative rejection sampling, Leviathan et al. / Chen et al. 2023): at T > 0 each
draft d_k is drawn from the drafter's own processed distribution q_k at its position. The
block's positions are drafted in one parallel pass from the committed context alone, so q_k
does not depend on d_<k and is a valid proposal for position k whatever was drafted before.
Draft k is accepted with probability min(1, p_k(d_k) / q_k(d_k)), p_k being the target's
processed distribution after the accepted prefix; the first rejected position takes a draw from
normalize(max(0, p_k - q_k)); when all b-1 drafts are accepted the bonus token is a draw from
p at the next position. Each accepted position keeps a token with probability 1 - TV(p_k, q_k).

Random streams: the draft draws, the acceptance uniforms and the residual draws each have their
own stream (`stream_key`), and every draw is keyed by its absolute position; the bonus token
(and every AR step) uses the target's stream, as in plain AR decoding. The draft and residual
draws invert the running sum of their distribution with one uniform each
(`sampling.draw_by_cdf`: a third of the Gumbel draws' cost on XLA:CPU, where the b-1 draft
draws over the vocabulary cost about half an AR step of the demo); the target's draws keep
`draw`, so plain AR decoding and `exact` give the tokens they always gave for a seed. A key's
draw decides a committed token at most once: a draw at position x is only consulted when every
earlier draft of its cycle was accepted, and then position x is committed in that cycle; a
later cycle redrawing at x (after an earlier rejection) meets a draw that influenced nothing
yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bp_jax.decoding.sampling import (SamplingParams, as_sampling, draw, draw_by_cdf,
                                      first_argmax, is_greedy, position_keys, processed_logits,
                                      sample)
from bp_jax.errors import BadInputError

VERIFY_MODES = ("exact", "rejection")  # the names of `RULES`

# Stream ids folded into the seed key (far above any position, which are the target stream's
# own fold-ins).
DRAFT_STREAM = 0xFFFF_FF01
ACCEPT_STREAM = 0xFFFF_FF02
RESIDUAL_STREAM = 0xFFFF_FF03


def stream_key(seed_key: jax.Array, stream: int) -> jax.Array:
  """The seed key of one random stream (draft draws, acceptance uniforms or residual draws)."""
  return jax.random.fold_in(seed_key, stream)


def accept_length(draft: jax.Array, y: jax.Array) -> jax.Array:
  """Length a of the longest prefix with draft[i] == y[i] (the exact-match rule, lossless)."""
  return jnp.sum(jnp.cumprod((draft == y[:draft.shape[0]]).astype(jnp.int32)))


def exact_match(target_logits_bV: jax.Array, draft_k: jax.Array, sp: SamplingParams,
                seed_key: jax.Array, pos: jax.Array, p_logits_bV: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
  """(y [b], a): the target's own samples at positions pos+1..pos+b and the accepted drafts
  (`p_logits_bV`: the target's processed logits, where the caller has them)."""
  b = target_logits_bV.shape[0]
  keys = None if is_greedy(as_sampling(sp)) else position_keys(seed_key, pos + 1 + jnp.arange(b))
  y = sample(target_logits_bV, sp, keys, p_logits_bV)
  return y, accept_length(draft_k, y)


def residual_logits(p_kV: jax.Array, q_kV: jax.Array) -> jax.Array:
  """log normalize(max(0, p - q)) per row (log p where p == q: a row that is never rejected)."""
  res = jnp.maximum(p_kV - q_kV, 0.0)
  empty = jnp.sum(res, axis=-1, keepdims=True) <= 0
  return jnp.log(jnp.where(empty, p_kV, res))


def rejection_sample(p_logits_bV: jax.Array, q_logits_kV: jax.Array, draft_k: jax.Array,
                     seed_key: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(y [b], a) of speculative rejection sampling (T > 0) from the target's and the drafter's
  processed logits (`sampling.processed_logits`: the distributions p and q): y[:a] are the
  accepted drafts, y[a] the residual draw at the first rejection (or the bonus draw from p when
  a == b-1)."""
  b = p_logits_bV.shape[0]
  k = jnp.arange(b - 1)
  draft_pos = pos + 1 + k
  logp_bV = jax.nn.log_softmax(p_logits_bV, axis=-1)
  logq_kV = jax.nn.log_softmax(q_logits_kV, axis=-1)
  logp_k = jnp.take_along_axis(logp_bV[:-1], draft_k[:, None], axis=-1)[:, 0]
  logq_k = jnp.take_along_axis(logq_kV, draft_k[:, None], axis=-1)[:, 0]
  u_k = jax.vmap(jax.random.uniform)(position_keys(stream_key(seed_key, ACCEPT_STREAM),
                                                   draft_pos))
  # u < p/q, in logs; q(d) > 0 always (d was drawn from q).
  accepted_k = jnp.log(u_k) < logp_k - logq_k
  a = jnp.sum(jnp.cumprod(accepted_k.astype(jnp.int32)))
  # Only the first rejected position's residual is ever committed: one row is drawn (at
  # a = b-1 nothing was rejected and the row is unused).
  j = jnp.minimum(a, b - 2)
  res_1V = residual_logits(jnp.exp(logp_bV[j][None]), jnp.exp(logq_kV[j][None]))
  residual = draw_by_cdf(res_1V, position_keys(stream_key(seed_key, RESIDUAL_STREAM),
                                               (pos + 1 + j)[None]))[0]
  bonus = draw(logp_bV[-1:], position_keys(seed_key, (pos + b)[None]))[0]
  y = jnp.concatenate([draft_k, jnp.zeros((1,), draft_k.dtype)])
  return y.at[a].set(jnp.where(a == b - 1, bonus, residual)), a


class VerifyRule:
  """A verify rule as the speculative loop calls it, on a batch: each row r with its own seed
  key and position. `propose` gives the cycle's drafts from the drafter's logits, and the
  drafter's processed distribution where the rule reads it (`reads_q`); `verify` takes that
  distribution (sliced to the drafts verified) and gives (y [B, b], a [B]): row r commits
  y[r, :a_r + 1] (a_r drafts accepted).

  The processed distributions a rule reads (`sampling.processed_logits`: the target's at T > 0,
  the drafter's with `reads_q`) are computed once per cycle, for the whole batch, before the
  rows' own work (`propose_row`, `verify_row`, vmapped): their truncation's one run-time branch
  (whether some row needs the bisection) stays a branch, where under the rows' vmap it would be
  a select that computes both sides."""
  name: str
  reads_q: bool = False  # whether the rule reads the drafter's processed distribution

  def propose_row(self, draft_logits_kV, q_kV, sp: SamplingParams, seed_key, pos) -> jax.Array:
    raise NotImplementedError

  def verify_row(self, target_logits_bV, p_bV, q_kV, draft_k, sp: SamplingParams, seed_key,
                 pos) -> tuple[jax.Array, jax.Array]:
    raise NotImplementedError

  def q_of(self, draft_logits: jax.Array, sp: SamplingParams) -> jax.Array | None:
    """The drafter's processed logits where the rule reads them (None: greedy or unread)."""
    return processed_logits(draft_logits, sp) if self.reads_q and not is_greedy(sp) else None

  def propose(self, draft_logits_BkV: jax.Array, sp: SamplingParams, seed_keys_B: jax.Array,
              pos_B: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(drafts [B, k], the drafter's processed logits [B, k, V] for `verify`, or None)."""
    q_BkV = self.q_of(draft_logits_BkV, sp)
    drafts_Bk = _per_row(lambda sp, lg, q, key, p: self.propose_row(lg, q, sp, key, p), sp,
                         draft_logits_BkV, q_BkV, seed_keys_B, pos_B)
    return drafts_Bk, q_BkV

  def verify(self, target_logits_BbV: jax.Array, q_BkV: jax.Array | None, draft_Bk: jax.Array,
             sp: SamplingParams, seed_keys_B: jax.Array, pos_B: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """(y [B, b], a [B]) for the target's logits over [tok, drafts] and `propose`'s q, both
    cut to the drafts verified."""
    p_BbV = None if is_greedy(sp) else processed_logits(target_logits_BbV, sp)
    return _per_row(
        lambda sp, tl, p, q, d, key, pos: self.verify_row(tl, p, q, d, sp, key, pos), sp,
        target_logits_BbV, p_BbV, q_BkV, draft_Bk, seed_keys_B, pos_B)


def _per_row(fn, sp: SamplingParams, *rows):
  """`fn(sp_r, *row_r)` for every row r: `sp` shared (scalars, or all None: greedy by form) or
  per row ([B] leaves; top-k / top-p may be None: off for every row). A row may be None (a
  distribution the rule does not read).

  Which sampling the rows may need is the program's form (`sampling.SamplingForm`, `in_form`),
  chosen on the host for the requests a call decodes: a greedy program draws nothing, an
  untruncated one computes no top-k / top-p, and none branches on the settings at run time."""
  if is_greedy(sp) or jnp.ndim(sp.temperature) == 0:
    return jax.vmap(lambda *r: fn(sp, *r))(*rows)
  return jax.vmap(fn)(sp, *rows)


class ExactMatch(VerifyRule):
  """`exact`: the drafter's argmax, kept while it equals the target's own sample there."""
  name = "exact"

  def propose_row(self, draft_logits_kV, q_kV, sp, seed_key, pos):
    return first_argmax(draft_logits_kV)

  def verify_row(self, target_logits_bV, p_bV, q_kV, draft_k, sp, seed_key, pos):
    return exact_match(target_logits_bV, draft_k, sp, seed_key, pos, p_bV)


class RejectionSampling(VerifyRule):
  """`rejection`: at T > 0 drafts drawn from the drafter's processed distribution and
  speculative rejection sampling; at T = 0 the greedy rule of `exact`."""
  name = "rejection"
  reads_q = True

  def propose_row(self, draft_logits_kV, q_kV, sp, seed_key, pos):
    def drawn(q_kV):
      draft_pos = pos + 1 + jnp.arange(q_kV.shape[0])
      return draw_by_cdf(q_kV, position_keys(stream_key(seed_key, DRAFT_STREAM), draft_pos))

    if is_greedy(sp):  # a greedy program (`sampling.SamplingForm.GREEDY`)
      return first_argmax(draft_logits_kV)
    return jax.lax.cond(sp.temperature > 0, lambda: drawn(q_kV),
                        lambda: first_argmax(draft_logits_kV))

  def verify_row(self, target_logits_bV, p_bV, q_kV, draft_k, sp, seed_key, pos):
    def greedy():  # T = 0: the argmax, no draw (what `exact_match` samples there)
      y = first_argmax(target_logits_bV)
      return y, accept_length(draft_k, y)

    if is_greedy(sp):  # a greedy program (`sampling.SamplingForm.GREEDY`)
      return greedy()
    # Under `_per_row`'s vmap over rows with their own temperatures this `cond` becomes a
    # select that computes both sides for every row: the greedy side must stay cheap (a
    # `sample` there drew b Gumbel vectors over the vocabulary per row and cycle for nothing).
    return jax.lax.cond(sp.temperature > 0,
                        lambda: rejection_sample(p_bV, q_kV, draft_k, seed_key, pos), greedy)


RULES: dict[str, VerifyRule] = {r.name: r for r in (ExactMatch(), RejectionSampling())}


def propose(draft_logits_kV: jax.Array, mode: str, sp: SamplingParams, seed_key: jax.Array,
            pos: jax.Array) -> jax.Array:
  """The cycle's b-1 drafts at positions pos+1.. of one row under `mode` (`VERIFY_MODES`): the
  drafter's argmax, or (`rejection` at T > 0) draws from its processed distribution."""
  rule = RULES[mode]
  return rule.propose_row(draft_logits_kV, rule.q_of(draft_logits_kV, sp), sp, seed_key, pos)


def same_tokens_as_ar(mode: str, temperature: float) -> bool:
  """Whether `mode` gives plain AR decoding's very tokens for a seed (greedy always does;
  `rejection` at T > 0 gives the same distribution with other draws)."""
  return not (mode == "rejection" and temperature > 0)


def check_verify_mode(mode: str, flag: str = "--config.verify") -> str:
  if mode not in VERIFY_MODES:
    raise BadInputError(f"{flag}={mode!r} is not one of {list(VERIFY_MODES)}")
  return mode
