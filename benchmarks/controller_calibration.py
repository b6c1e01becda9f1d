"""How well the drafter's probability of its drafted token predicts acceptance (the confidence
controller's p_i, `controller.drafted_probs`), at T = 0 with verify=exact.

For each prompt the target decodes greedily (plain AR); then at every generated position t the
drafter drafts b-1 tokens after seq[t] from the target features of positions < t, as a cycle
starting there would. Draft i is accepted, given drafts 1..i-1 were, when it equals seq[t+i] (the
target's own greedy token there). Pairs (p_i, accepted) are pooled into equal-width bins of p;
the table printed (and written to --out as JSON) gives per bin the count, the mean p and the
empirical conditional acceptance rate, and per draft position the same means. A well calibrated
drafter has acceptance ~ mean p in every bin. The JSON's "rates" (`controller.fit_calibration`)
is what `--config.controller_calibration` reads.

Prompts: the HumanEval labelling half of configs/demo.py's split, skipping its first --skip
(those `benchmarks.controllers` measures on by default). Example:

  python -m benchmarks.controller_calibration --skip 24 --num_prompts 48 --out /tmp/calib
"""

from __future__ import annotations

import os

import numpy as np
from absl import flags

from benchmarks import common
from benchmarks.replay import teacher_forced
from bp_jax import cli
from bp_jax.decoding import controller as control
from bp_jax.errors import BadInputError

common.define_flags("target", "drafter", "dtype", "max_len", "max_new_tokens", "block_size",
                    num_prompts=48, helps={"num_prompts": "Labelling-half prompts used after "
                                                          "the skipped ones (0 = all)."})
flags.DEFINE_integer("skip", 24, "labelling-half prompts skipped first (the controllers' set)")
flags.DEFINE_integer("bins", 10, "equal-width bins of p over [0, 1]")
flags.DEFINE_string("out", "", "folder for calibration.json (empty: print only)")
FLAGS = flags.FLAGS


def conditional_pairs(p_Tk: np.ndarray, hit_Tk: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
  """(p, accepted, draft position i, each [N]) of the drafts whose predecessors in their block
  were all accepted: the events the controller's E_k multiplies."""
  reached_Tk = np.cumprod(np.concatenate([np.ones_like(hit_Tk[:, :1]), hit_Tk[:, :-1]], 1), 1)
  keep = reached_Tk.astype(bool)
  pos_Tk = np.broadcast_to(np.arange(1, p_Tk.shape[1] + 1), p_Tk.shape)
  return p_Tk[keep], hit_Tk[keep].astype(bool), pos_Tk[keep]


def reliability(p_N: np.ndarray, hit_N: np.ndarray, bins: int) -> list[dict]:
  """Per equal-width bin of p: count, mean p, empirical acceptance rate."""
  idx = np.clip((p_N * bins).astype(int), 0, bins - 1)
  rows = []
  for j in range(bins):
    sel = idx == j
    n = int(sel.sum())
    rows.append({"bin": [j / bins, (j + 1) / bins], "count": n,
                 "mean_p": round(float(p_N[sel].mean()), 4) if n else None,
                 "accept_rate": round(float(hit_N[sel].mean()), 4) if n else None})
  return rows


def main(_):
  if FLAGS.bins < 1 or FLAGS.block_size < 2:
    raise BadInputError("--bins must be >= 1 and --block_size >= 2")
  target, drafter, tok, stop_ids = common.load_models(FLAGS)
  prompts = common.demo_prompts(tok, "label", skip=FLAGS.skip, limit=FLAGS.num_prompts)
  b = FLAGS.block_size
  rows = teacher_forced(target, drafter, prompts, b, FLAGS.max_len, FLAGS.max_new_tokens,
                        stop_ids)
  p_rows = np.concatenate([p for p, _ in rows])
  hit_rows = np.concatenate([h for _, h in rows])
  p_N, hit_N, pos_N = conditional_pairs(np.asarray(p_rows), np.asarray(hit_rows))
  table = reliability(p_N, hit_N, FLAGS.bins)
  by_pos = [{"position": int(i), "count": int((pos_N == i).sum()),
             "mean_p": round(float(p_N[pos_N == i].mean()), 4),
             "accept_rate": round(float(hit_N[pos_N == i].mean()), 4)}
            for i in sorted(set(pos_N.tolist()))]
  print(f"\n  {len(p_N)} conditional drafts from {len(prompts)} prompts "
        f"(overall mean p {p_N.mean():.3f}, acceptance {hit_N.mean():.3f})")
  print(f"  {'p bin':<12}{'count':>8}{'mean p':>8}{'accept':>8}")
  for r in table:
    print(f"  {r['bin'][0]:.1f}-{r['bin'][1]:.1f}    {r['count']:>8}"
          f"{r['mean_p'] if r['mean_p'] is not None else '-':>8}"
          f"{r['accept_rate'] if r['accept_rate'] is not None else '-':>8}")
  print(f"  {'position':<12}{'count':>8}{'mean p':>8}{'accept':>8}")
  for r in by_pos:
    print(f"  {r['position']:<12}{r['count']:>8}{r['mean_p']:>8}{r['accept_rate']:>8}")
  if FLAGS.out:
    common.write_json(os.path.join(FLAGS.out, "calibration.json"),
                      {"rates": control.fit_calibration(p_N, hit_N, FLAGS.bins),
                       "prompts": [key for key, _ in prompts], "block_size": b, "bins": table,
                       "positions": by_pos}, indent=1)


if __name__ == "__main__":
  cli.run(main, __doc__)
