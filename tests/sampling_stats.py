"""Shared pieces of the statistical sampling tests: a tiny-vocabulary target and drafter, the
target's exact distribution of its first generated tokens, and a pooled chi-square test.

Chi-square: with observed counts O_j and expected counts E_j = N p_j over cells j (cells with
E_j < 5 are pooled into one cell, and a pooled cell still under 5 is merged into the smallest
kept cell), X^2 = sum_j (O_j - E_j)^2 / E_j, compared against the chi-square(k - 1) quantile at
1 - ALPHA with ALPHA = 1e-6: under a correct sampler each such check is a false alarm with
probability about 1e-6.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import scipy.stats
import torch

from bp_jax.models.config import DFlashConfig
from hf_fixtures import (jax_drafter_from_state_dict, jax_qwen3_from_torch, make_dflash_state_dict,
                         make_hf_qwen3)

V = 16
MASK = V - 1
TARGET_KW = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=64)
DRAFTER_HF = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=10000.0, block_size=4, num_target_layers=2,
                  dflash_config={"mask_token_id": MASK, "target_layer_ids": [0, 1]})
PROMPT = [3, 9, 1, 12, 7]
ALPHA = 1e-6


def tiny_models():
  """(hf target, bp_jax target, bp_jax drafter) over a 16-token vocabulary; the target's head is
  scaled 4x for sharper next-token distributions (fewer, better-filled cells)."""
  hf = make_hf_qwen3(seed=3, **TARGET_KW)
  with torch.no_grad():
    hf.lm_head.weight.mul_(4.0)
  target = jax_qwen3_from_torch(hf)
  cfg = DFlashConfig.from_hf_dict(DRAFTER_HF, "tiny-dflash/config.json")
  drafter = jax_drafter_from_state_dict(cfg, make_dflash_state_dict(cfg, seed=2))
  return hf, target, drafter


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> np.ndarray:
  """The processed distribution [..., V] in float64, written independently of bp_jax: logits /
  T; keep the top_k largest (ties with the k-th kept); of those, the most likely tokens until
  the mass before a token reaches top_p (ties with the last kept kept); then tokens with
  probability >= min_p * max."""
  x = np.asarray(logits, np.float64) / temperature
  out = np.empty_like(x)
  for idx in np.ndindex(x.shape[:-1]):
    row = x[idx]
    keep = np.ones(row.shape, bool)
    order = np.argsort(-row, kind="stable")
    if top_k > 0:
      keep &= row >= row[order[min(top_k, row.size) - 1]]
    if top_p < 1.0:
      p = np.exp(row - row.max()) * keep
      p /= p.sum()
      mass, n_keep = 0.0, 0
      for j in order:
        if not keep[j] or mass >= top_p:
          break
        mass += p[j]
        n_keep += 1
      keep &= row >= row[order[max(n_keep, 1) - 1]]
    p = np.exp(row - row.max()) * keep
    p /= p.sum()
    if min_p > 0:
      p = p * (p >= min_p * p.max())
      p /= p.sum()
    out[idx] = p
  return out


def exact_joint(hf, prompt, **sampling) -> np.ndarray:
  """p[t1, t2, t3] = P(t1) P(t2 | t1) P(t3 | t1, t2) of the target's processed distribution, in
  float64 (every prefix enumerated)."""
  model = copy.deepcopy(hf).double()
  n = len(prompt)
  seqs = [list(prompt) + [t1, t2] for t1, t2 in itertools.product(range(V), repeat=2)]
  with torch.no_grad():
    logits = model(torch.tensor(seqs)).logits.numpy()  # causal: earlier positions, shorter prefixes
  probs = reference_probs(logits[:, n - 1:n + 2], **sampling)
  p1 = probs[0, 0]                                     # [t1]
  p2 = probs[::V, 1].reshape(V, V)                     # [t1, t2]
  p3 = probs[:, 2].reshape(V, V, V)                    # [t1, t2, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def counts_of(toks: np.ndarray, k: int) -> np.ndarray:
  """Counts of the first k tokens' joint outcomes, shaped [V] * k."""
  return np.bincount(np.ravel_multi_index(toks[:, :k].T, (V,) * k), minlength=V ** k).reshape(
      (V,) * k)


def chi_square(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0):
  """(X^2, degrees of freedom, threshold at 1 - ALPHA) of observed counts against probs."""
  counts, probs = counts.ravel().astype(float), probs.ravel()
  assert abs(probs.sum() - 1) < 1e-9
  expected = counts.sum() * probs
  big = expected >= min_expected
  obs, exp = list(counts[big]), list(expected[big])
  if (~big).any():
    o, e = counts[~big].sum(), expected[~big].sum()
    if e >= min_expected:
      obs.append(o)
      exp.append(e)
    else:  # fold a still-small pooled cell into the smallest kept cell
      j = int(np.argmin(exp))
      obs[j] += o
      exp[j] += e
  obs, exp = np.array(obs), np.array(exp)
  stat = float(((obs - exp) ** 2 / exp).sum())
  df = len(obs) - 1
  assert df >= 2, "too few cells for a meaningful test"
  return stat, df, float(scipy.stats.chi2.isf(ALPHA, df))
