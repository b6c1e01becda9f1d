"""Where reduced-precision speculative output leaves AR's, and whether each such place is a
near-tie (docs/design.md §12, benchmarks/bf16_agreement.py, tests/test_bf16_exactness.py).

At T = 0 a speculative cycle commits the argmax of the target's logits from the verify pass
(b tokens in one forward) where AR decoding takes the argmax of a 1-token step: the same
function of the same prefix, computed with other shapes (and on a KV cache written by other
forwards). In float32 with full-precision matmuls the two agree token for token; in bfloat16
their logits differ by rounding, so where the two best logits nearly tie the argmax can flip, and
from there the outputs differ. A flip is a *rounding* divergence only if the AR step's logit of
its own token exceeds its logit of the speculative token by no more than rounding explains:

  gap = logits_AR[ar_token] - logits_AR[spec_token] <= tolerance = K * eps * max|logits_AR|

(eps = 2^-7 for bfloat16, `gap_tolerance`, K = GAP_TOLERANCE_K = 2). If the two logit vectors
differ by at most d everywhere, both gaps are at most 2 d (each argmax beats the other token in
its own vector): K = 2 states d <= eps * max|logits|, about one bf16 ulp of the largest logit
(measured: at most 0.74 of it on the demo, docs/exactness). A wrong verify rule commits tokens
the target does not rank first: large gaps, flagged by `check_divergences`.

`ForwardReplay` recomputes the logits behind every committed token by replaying a request's
forwards outside the decode loop with the engine's shapes: the padded prefill, then 1-token
steps (AR) or b-token verify blocks advanced by each cycle's acceptance length (speculative).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2^-7: spacing of bfloat16 numbers at 1.0
# K of the stated tolerance (module docstring): a flip counts as rounding when the AR step's gap
# is at most K * eps * max|logits|, i.e. the two shapes' logits differ by <= eps * max|logits|.
GAP_TOLERANCE_K = 2.0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
  """The first index where two token lists differ (or the shorter one ends); None if equal."""
  a, b = list(a), list(b)
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(logits_V: np.ndarray) -> float:
  """The best logit minus the second best."""
  top = np.partition(np.asarray(logits_V, np.float64), -2)[-2:]
  return float(top[1] - top[0])


def gap_tolerance(logits_V: np.ndarray, eps: float = BF16_EPS, k: float = GAP_TOLERANCE_K) -> float:
  """The largest gap rounding explains: k * eps * max|logits| (module docstring)."""
  return float(k * eps * np.max(np.abs(np.asarray(logits_V, np.float64))))


@dataclasses.dataclass
class Divergence:
  """The first place where a speculative output leaves AR's, with the logits behind both."""
  prompt: str
  index: int               # output index (new tokens) of the first differing token
  ar_token: int
  spec_token: int
  ar_gap: float            # AR step's logits: logit[ar_token] - logit[spec_token]
  ar_top2_gap: float       # AR step's logits: best minus second best
  verify_gap: float        # verify pass's logits: logit[spec_token] - logit[ar_token]
  verify_top2_gap: float
  logit_scale: float       # max |AR step's logits| at that position
  tolerance: float         # gap_tolerance of the AR step's logits
  replay_agrees: bool      # the replayed argmaxes are the committed tokens (AR's and spec's)

  @property
  def near_tie(self) -> bool:
    return max(self.ar_gap, self.verify_gap) <= self.tolerance


def divergence_at(prompt: str, index: int, ar_ids: Sequence[int], spec_ids: Sequence[int],
                  ar_logits_V: np.ndarray, verify_logits_V: np.ndarray,
                  eps: float = BF16_EPS, k: float = GAP_TOLERANCE_K) -> Divergence:
  """The `Divergence` at `index` from the AR step's and the verify pass's logits there."""
  a, s = int(ar_ids[index]), int(spec_ids[index])
  la, lv = np.asarray(ar_logits_V, np.float64), np.asarray(verify_logits_V, np.float64)
  return Divergence(prompt, index, a, s, float(la[a] - la[s]), top2_gap(la),
                    float(lv[s] - lv[a]), top2_gap(lv), float(np.max(np.abs(la))),
                    gap_tolerance(la, eps, k),
                    int(np.argmax(la)) == a and int(np.argmax(lv)) == s)


def check_divergences(divs: Sequence[Divergence]) -> list[str]:
  """One line per divergence that is not a near-tie (empty: every flip is rounding)."""
  return [f"{d.prompt} @ {d.index}: AR {d.ar_token} vs spec {d.spec_token}, gaps AR "
          f"{d.ar_gap:.4g} / verify {d.verify_gap:.4g} > tolerance {d.tolerance:.4g}"
          for d in divs if not d.near_tie]


def forward_schedule(g, block_size: int) -> list[tuple[int, int]]:
  """(width, advance) of each target forward of a `Generation` after its prefill: AR steps are
  (1, 1); a cycle of block size b that committed a tokens is (b, a)."""
  if block_size == 1:
    return [(1, 1)] * max(len(g.output_ids) - 1, 0)
  return [(block_size if c else 1, a) for a, c in zip(g.forward_lengths, g.forward_is_cycle)]


class ForwardReplay:
  """Recomputes, outside the decode loop and with the engine's shapes, the target logits that
  chose each committed token of a request (see the module docstring)."""

  def __init__(self, engine):
    self.engine = engine
    d = engine.drafter
    self.layer_ids = () if d is None else tuple(d.cfg.target_layer_ids)

  @functools.partial(jax.jit, static_argnums=(0, 6))
  def _prefill(self, state, layers, tokens_1P, n, cache, layer_ids):
    """The engine's prefill forward: on the engine's own per-layer weights
    (`loops.LoopWeights`; None: scanned, with `scan_layers`)."""
    model = nnx.merge(self.engine.t_graph, state)
    zero = jnp.zeros((1,), jnp.int32)
    out = model(tokens_1P, cache.with_lengths(zero), layer_ids, logits_at=(n - 1)[None],
                layers=None if layers is None else list(layers))
    return out.logits[0], out.cache.per_layer()

  @functools.partial(jax.jit, static_argnums=(0, 6))
  def _step(self, state, layers, tokens_1w, cache, pos, layer_ids):
    model = nnx.merge(self.engine.t_graph, state)
    out = model(tokens_1w, cache.with_lengths(pos[None]), layer_ids,
                layers=model.layers.per_layer() if layers is None else list(layers))
    return out.logits[0], out.cache

  def logits(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
             schedule: Sequence[tuple[int, int]], upto: int | None = None) -> np.ndarray:
    """[m, V] float32: row j holds the logits that chose output_ids[j] (row 0: the prefill's),
    for j <= upto (default: all). `schedule`: `forward_schedule` of the request. Block slots
    past a cycle's committed tokens (its rejected drafts) hold later output tokens instead:
    causal attention keeps them out of every row read here."""
    eng = self.engine
    n, out = len(prompt_ids), [int(t) for t in output_ids]
    upto = len(out) - 1 if upto is None else upto
    toks, _ = eng.encode_padded(prompt_ids)
    cache = eng.cache.with_lengths(jnp.zeros((1,), jnp.int32))
    weights = eng.t_weights
    first, cache = self._prefill(weights.state, weights.layers, toks, jnp.int32(n), cache,
                                 self.layer_ids)
    rows, pos, seq = [np.asarray(first[0])], n, list(prompt_ids) + out
    # The engine's speculative loop asks its forwards for the drafter's features, its AR loop not.
    ids = self.layer_ids if any(w > 1 for w, _ in schedule) else ()
    for width, advance in schedule:
      if len(rows) > upto:
        break
      block = seq[pos:pos + width]
      block += [0] * (width - len(block))
      logits, cache = self._step(weights.state, weights.layers,
                                 jnp.asarray([block], jnp.int32), cache, jnp.int32(pos), ids)
      rows += list(np.asarray(logits[:advance]))
      pos += advance
    return np.stack(rows[:upto + 1])
