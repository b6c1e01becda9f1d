"""benchmarks/accelerator.py at a tiny shape on CPU: the accelerator suite cannot rot."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks import accelerator as A


def test_stretched_profile_has_the_asked_mean_and_the_demo_shape():
  survival = A.demo_survival()
  assert survival[0] == 1.0 and np.all(np.diff(survival) <= 0)
  probs = A.stretched_profile(survival, 6.5)
  assert probs.shape == (16,) and np.all(probs >= 0)
  assert np.isclose(probs.sum(), 1.0)
  assert np.isclose(np.dot(np.arange(16) + 1, probs), 6.5, atol=1e-6)
  # A longer mean stretches the same curve: more mass on long acceptances.
  longer = A.stretched_profile(survival, 9.0)
  assert longer[8:].sum() > probs[8:].sum()
  with pytest.raises(ValueError, match="sim_tau"):
    A.stretched_profile(survival, 17.0)


def test_simulated_continuation_places_one_wrong_token_where_each_draw_ends():
  cont = [5] * 40
  rng = np.random.default_rng(0)
  probs = A.stretched_profile(A.demo_survival(), 6.5)
  forced, drawn = A.simulated_continuation(cont, 8, probs, 512, rng)
  assert max(drawn) <= 7
  p = 0
  for a in drawn:  # the cycle at p keeps a drafts, then meets the wrong one (unless full)
    assert forced[p + 1:p + 1 + a] == cont[p + 1:p + 1 + a]
    if a < 7 and p + 1 + a < len(cont):
      assert forced[p + 1 + a] == 6
    p += a + 1
  assert sum(f != c for f, c in zip(forced, cont)) == sum(
      1 for q, a in zip(np.cumsum([0] + [a + 1 for a in drawn]), drawn)
      if a < 7 and q + 1 + a < len(cont))


def test_a_continuation_run_past_the_last_token_keeps_the_draws_before_it():
  """benchmarks/controllers.py's simulated drafts run a block past the requests' last token
  (`tail_from`): the cycles the cut continuation draws keep their draws and wrong tokens; the
  cycles past them draw from the tail's own generator, and the last cut cycle's wrong token,
  past the cut, is placed."""
  cont, cut = [5] * 60, 40
  probs = A.stretched_profile(A.demo_survival(), 6.5)
  short, drawn_short = A.simulated_continuation(cont[:cut], 8, probs, 512,
                                                np.random.default_rng(0))
  long, drawn_long = A.simulated_continuation(cont, 8, probs, 512, np.random.default_rng(0),
                                              tail_from=cut - 1,
                                              tail_rng=np.random.default_rng(9))
  assert drawn_long[:len(drawn_short)] == drawn_short
  assert long[:cut] == short and len(drawn_long) > len(drawn_short)
  last = sum(a + 1 for a in drawn_short[:-1]) + 1 + drawn_short[-1]  # the last cut cycle's end
  assert last >= cut - 1 and (drawn_short[-1] == 7 or long[last] == 6)


def test_the_suite_runs_at_a_tiny_shape(tmp_path):
  opts = A.Options(sizes=("tiny",), batch_sizes=(1, 2), hf_batch_sizes=(1,), block_sizes=(4,),
                   prompt_len=16, new_tokens=24, prompts=1, repeats=1)
  report = A.run(opts, str(tmp_path), "test", log=lambda s: None)
  for name in ("results.json", "results.md", "tok_s_vs_batch.png", "speedup_vs_block.png"):
    assert os.path.getsize(tmp_path / name) > 0, name
  assert json.loads((tmp_path / "results.json").read_text())["sizes"]["tiny"]
  r = report["sizes"]["tiny"]
  assert set(r["methods"]) == {"ar1", "ar2", "hf1", "spec4_perfect", "spec4_sim"}
  # Speculative outputs are the target's own; the simulated drafter accepts exactly its draws.
  assert r["lossless"] == {"checked_requests": 2, "mismatches": 0,
                           "sim_schedule_mismatches": 0}
  # Perfect drafts: every cycle commits the whole block (23 tokens after the prefill's: 5 full
  # cycles of 4 and a last one clipped to 3).
  assert r["methods"]["spec4_perfect"]["tau"] == pytest.approx((5 * 4 + 3) / 6)
  assert r["methods"]["spec4_sim"]["tau"] < r["methods"]["spec4_perfect"]["tau"]
  assert r["methods"]["spec4_sim"]["simulated"] is True
  f = r["per_forward"]["4"]
  assert f["cycle_s"] > 0 and f["draft_s"] > 0 and f["verify_s"] > 0
  assert r["ar_step_bytes"]["weight_bytes"] > 0 and r["ar_step_bytes_per_s"] > 0
  assert r["compilations"]["batch1"] >= 3
  assert "profile" in r and r["profile"]["spec4_perfect"]["cycles"] == 6
  md = (tmp_path / "results.md").read_text()
  assert "SIMULATED" in md and "| spec4_perfect |" in md
