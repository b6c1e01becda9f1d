"""Sharding (docs/design.md §9): the `--config.mesh` flag, the logical-axis rule table, KV-cache
placement; and, on 8 simulated CPU devices (`sharding_checks.py`, one subprocess), that sharded
decoding is token-identical to one device with unchanged compile counts, that checkpoints
restore onto their shardings, and that data-parallel drafter and policy steps match the
unsharded losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from bp_jax.errors import BadInputError
from bp_jax.parallel import mesh as pmesh
from bp_jax.parallel import rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def abstract_mesh(data: int, model: int) -> AbstractMesh:
  return AbstractMesh((data, model), pmesh.MESH_AXES, axis_types=(AxisType.Auto,) * 2)


# ---- the flag ---------------------------------------------------------------------------------

def test_parse_mesh():
  assert pmesh.parse_mesh("") is None and pmesh.make_mesh("") is None
  assert pmesh.parse_mesh("data:4,model:2") == {"data": 4, "model": 2}
  assert pmesh.parse_mesh(" model : 2 ") == {"data": 1, "model": 2}
  assert pmesh.parse_mesh("model:2,data:3") == {"data": 3, "model": 2}


@pytest.mark.parametrize("text, words", [
    ("data:2,tensor:2", "unknown axis 'tensor'"),
    ("data=2", "cannot read 'data=2'"),
    ("data:2,", "cannot read ''"),
    ("data:two", "cannot read"),
    ("data:2,data:2", "axis 'data' is given twice"),
    ("model:0", "sizes must be >= 1"),
    ("data:-1", "sizes must be >= 1"),
])
def test_bad_mesh_text_names_the_flag(text, words):
  with pytest.raises(BadInputError) as e:
    pmesh.parse_mesh(text)
  assert str(e.value).startswith(f"--config.mesh={text!r}") and words in str(e.value)


def test_mesh_larger_than_the_devices_is_refused():
  with pytest.raises(BadInputError, match=r"--config.mesh=data:1,model:2 needs 2 devices but 1 "
                                          r"are available"):
    pmesh.make_mesh("model:2")  # this process has one CPU device
  mesh = pmesh.make_mesh("data:1")
  assert dict(mesh.shape) == {"data": 1, "model": 1}
  assert pmesh.describe(mesh).startswith("data:1,model:1 (1 devices")


# ---- the rule table ---------------------------------------------------------------------------

def _spec(shardings, *path):
  node = shardings
  for key in path:
    node = node[key]
  return getattr(node, "value", node).spec


def test_every_parameter_has_logical_axes_and_the_table_places_them():
  from toy_models import zeros_drafter_pair
  from flax import nnx
  from bp_jax.policy.mlp import BlockPolicy, PolicyArch

  target, drafter = zeros_drafter_pair()  # N=4, K=2 heads, F=48, V=64
  policy = BlockPolicy(PolicyArch("last_hidden", 32, 16, 2, 3), rngs=nnx.Rngs(0))
  plan = rules.plan_params(target, abstract_mesh(2, 2))
  assert plan.replicated == []
  assert _spec(plan.shardings, "embed") == P("model", None)
  assert _spec(plan.shardings, "lm_head") == P(None, "model")
  assert _spec(plan.shardings, "final_norm") == P(None)
  for name, spec in (("q_proj", P(None, None, "model")), ("k_proj", P(None, None, "model")),
                     ("v_proj", P(None, None, "model")), ("o_proj", P(None, "model", None)),
                     ("gate_proj", P(None, None, "model")), ("up_proj", P(None, None, "model")),
                     ("down_proj", P(None, "model", None)), ("input_norm", P(None, None)),
                     ("q_norm", P(None, None))):
    assert _spec(plan.shardings, "layers", name) == spec, name
  d_plan = rules.plan_params(drafter, abstract_mesh(2, 2))
  assert _spec(d_plan.shardings, "fc") == P(None, None)
  assert _spec(d_plan.shardings, "layers", "k_proj") == P(None, None, "model")
  p_plan = rules.plan_params(policy, abstract_mesh(2, 2))  # replicated by the table
  assert {str(s.spec) for s in jax.tree.leaves(p_plan.shardings)} <= {
      str(P(None)), str(P(None, None)), str(P(None, None, None))}


def test_dimensions_that_do_not_divide_are_replicated_and_reported(caplog):
  from toy_models import zeros_drafter_pair

  target, _ = zeros_drafter_pair()  # 4 query heads, 2 kv heads of head_dim 8, F=48, V=64
  with caplog.at_level("INFO", logger="bp_jax.parallel"):
    plan = rules.plan_params(target, abstract_mesh(1, 4))
  assert plan.replicated == [  # K*H = 16 divides 4, but 2 heads do not
      "layers.k_proj dim 2 (kv_heads): 2 heads do not divide model:4; replicated",
      "layers.v_proj dim 2 (kv_heads): 2 heads do not divide model:4; replicated"]
  assert _spec(plan.shardings, "layers", "q_proj") == P(None, None, "model")
  assert _spec(plan.shardings, "layers", "k_proj") == P(None, None, None)
  assert "2 heads do not divide model:4" in caplog.text
  plan = rules.plan_params(target, abstract_mesh(1, 3))  # nothing divides 3 but F=48
  assert _spec(plan.shardings, "embed") == P(None, None)
  assert _spec(plan.shardings, "layers", "gate_proj") == P(None, None, "model")
  assert "embed dim 0 (vocab): size 64 does not divide model:3; replicated" in plan.replicated


def test_a_parameter_without_logical_axes_is_refused():
  import numpy as np
  with pytest.raises(BadInputError, match="parameter 'extra.w' has no logical axes"):
    rules.plan_params({"extra": {"w": np.zeros((2, 2))}}, abstract_mesh(1, 2))


@pytest.mark.parametrize("batch, data, model, rows, lengths", [
    (1, 4, 2, "model", P()),                 # one sequence: data replicates, heads on model
    (4, 2, 2, ("data", "model"), P("data")),  # sequences on data, kv heads on model
    (3, 2, 2, "model", P()),                 # 3 rows do not divide data:2
    (4, 2, 4, "data", P("data")),            # 2 kv heads do not divide model:4
    (1, 1, 1, None, P()),
])
def test_cache_sharding(batch, data, model, rows, lengths):
  from bp_jax.models.kv_cache import KVCache
  cache = KVCache.create(3, batch, 16, 2, 8, "float32")  # K = 2 kv heads
  sh = rules.cache_sharding(cache, abstract_mesh(data, model))
  assert sh.k.spec == P(None, rows, None, None) and sh.v.spec == P(None, rows, None, None)
  assert sh.lengths.spec == lengths
  per_layer = rules.cache_sharding(cache.per_layer(), abstract_mesh(data, model))
  assert len(per_layer.k) == 3 and per_layer.k[0].spec == P(rows, None, None)


# ---- 8 simulated devices ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def checks(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sharding") / "checks.json")
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
  # XLA_FLAGS passes through (conftest.py's compile optimisation level); the script adds the
  # 8 simulated devices itself.
  proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "sharding_checks.py"), out],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out, encoding="utf-8") as f:
    return json.load(f)


def test_sharded_decoding_is_token_identical_with_the_same_compiles(checks):
  assert checks["devices"] == 8
  dec = checks["decoding"]
  single = dec["single"]
  assert any(a > 1 for lens in single["spec_lengths"] for a in lens)  # drafts were accepted
  assert single["spec"] == single["ar"]
  for spec in ("data:4,model:2", "data:8"):
    got = dec[spec]
    assert got["ar"] == single["ar"], spec
    assert got["logits_argmax_equal"] and got["logits_max_diff"] < 1e-4, spec
  mixed = dec["data:4,model:2"]
  assert mixed["spec"] == single["spec"] and mixed["spec_lengths"] == single["spec_lengths"]
  # The AR request's prefill runs without the drafter (`Engine.plain_prefill`): two prefills.
  assert mixed["compiled"] == single["compiled"] == {
      "prefill": 2, "ar_loop": 1, "spec_loop": 1}
  assert dec["data:8"]["compiled"] == {"prefill": 1, "ar_loop": 1}


def test_sharded_batched_decoding_equals_each_request_alone(checks):
  """Batches of 8 rows (on data:8 one row per device) give every request its single-device,
  one-request output, AR and speculative, with one compile per batched loop; a batch of 4 whose
  tail shrinks to 2 and 1 slots gives the same on the mixed mesh."""
  dec = checks["decoding"]
  alone = dec["single"]["batch_alone"]
  assert len({len(o) for o in alone}) > 3  # rows finish at different times
  for spec in ("single", "data:4,model:2", "data:8"):
    assert dec[spec]["batch_ar"] == alone, spec
    assert dec[spec]["batch_spec"] == alone, spec
    assert dec[spec]["batch_compiled"] == {"prefill": 2, "insert": 2, "batch_ar_loop": 1,
                                           "batch_spec_loop": 1, "slot_carry": 2,
                                           "staging_buffers": 1}, spec
  # A batch whose tail ran in 2 and 1 slots (rows a size of data:4 does not divide are
  # replicated): each request's own tokens on the mixed mesh, each size and resize compiled
  # once, as on one device (tests/test_batched_decode.py).
  mixed = dec["data:4,model:2"]
  assert mixed["tail_spec"] == alone[:6]
  compiled = mixed["tail_compiled"]
  assert compiled["batch_spec_loop"] == 3 and compiled["resize"] == 2, compiled
  assert dec["data:8"]["batch_seq"] == ["data", None]
  assert dec["data:8"]["batch_cache_k"][0] == "data"    # k [Z, S, H]: 8 sequences' rows
  assert dec["data:4,model:2"]["batch_cache_k"][0] == ["data", "model"]


def test_engine_places_weights_and_caches_by_the_table(checks):
  dec = checks["decoding"]
  mixed = dec["data:4,model:2"]
  assert mixed["t_q_proj"] == [None, None, "model"]
  assert mixed["d_k_proj"] == [None, None, "model"]
  # One sequence: its rows (= its 2 kv heads) go on model; data replicates. (The engine keeps
  # its caches per layer, as its loops carry them: k [Z, S, H] per layer.)
  assert mixed["cache_k"][0] == "model"
  assert mixed["draft_cache_k"][0] == "model"
  assert dec["data:8"]["t_q_proj"] == [None, None, None]  # no model axis: replicated
  assert not any(dec["data:8"]["cache_k"])                 # batch 1 on data:8: replicated


def test_checkpoints_restore_onto_their_shardings(checks):
  r = checks["restore"]
  assert r["target_shardings_as_table"] and r["target_values_equal"]
  assert r["q_proj_spec"] == [None, None, "model"]
  assert r["q_proj_shard_shape"] == [2, 32, 16]  # 2 layers; half of N*H = 32 per model shard
  assert r["embed_spec"] == ["model", None] and r["lm_head_spec"] == [None, "model"]
  assert r["down_proj_spec"] == [None, "model", None]
  assert r["drafter_k_proj_spec"] == [None, None, "model"]
  assert r["drafter_fc_spec"] == [None, None]


def test_data_parallel_train_steps_match_one_device(checks):
  d = checks["draft_train"]
  assert len(d["single"]) == 2
  assert d["data:4,model:2"] == pytest.approx(d["single"], rel=1e-5, abs=1e-5)
  assert d["trained_k_proj_spec"] == [None, None, "model"]
  p = checks["policy_train"]
  assert len(p["single"]) == 3
  for got, want in zip(p["data:8"], p["single"]):
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_a_mesh_beyond_the_devices_is_refused_there_too(checks):
  assert "needs 16 devices but 8 are available" in checks["bad_mesh"]["data:4,model:4"]
  assert checks["bad_mesh"]["data:16"].startswith("--config.mesh=data:16,model:1")


def test_scripts_refuse_a_bad_mesh_before_doing_anything(run_cli, tmp_path):
  err = run_cli("decode.py", "--config.mesh=tensor:2").error_line("decode.py")
  assert err == ("decode.py: error: --config.mesh='tensor:2': unknown axis 'tensor'; the axes "
                 "are data and model")
  err = run_cli("train.py", "--config.stage=policy", "--config.mesh=data:2",
                f"--config.workdir={tmp_path}").error_line("train.py")
  assert "--config.mesh=data:2,model:1 needs 2 devices but 1 are available" in err


def test_a_priced_policys_prices_are_placed_on_the_mesh(checks):
  """On data:4,model:2 a priced policy's picks follow the prices the engine places (its price
  leaf replicated, no prefill compiled for a change of prices), with AR's tokens."""
  got = checks["priced_policy"]
  n = len(got["picks"]) // 3
  assert got["picks"] == [4] * n + [1] * n + [4] * n, got["picks"]
  assert got["same_as_ar"] and got["prices_replicated"]
  # the AR requests' plain prefill, and the learned one with its policy
  assert got["prefills"] == 2, got
