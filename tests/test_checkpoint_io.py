"""Tests for bp_jax.weights.checkpoint_io: atomic save, overwrite rules, load checks and dtype casting."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bp_jax.weights import checkpoint_io as cio
from bp_jax.errors import BadInputError

CONFIG = {"hidden_size": 4, "num_hidden_layers": 1, "vocab_size": 8}


def _params() -> dict:
  rng = np.random.default_rng(0)
  return {
      "embed": rng.standard_normal((8, 4)).astype(np.float32),
      "layers": {"q": {"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.bfloat16)},
                 "norm": np.ones(4, ml_dtypes.bfloat16)},
      "steps": np.arange(3, dtype=np.int32),
  }


def _save(out, params=None, kind="qwen3", **kw) -> str:
  return cio.save_checkpoint(str(out), _params() if params is None else params, CONFIG,
                             {"kind": kind, **kw.pop("meta", {})}, **kw)


def _leftovers(parent) -> list[str]:
  return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n)


def _assert_tree_equal(got, want) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64))


def test_round_trip(tmp_path):
  tok = tmp_path / "tokenizer.json"
  tok.write_text('{"model": "x"}')
  out = tmp_path / "ckpt"
  path = _save(out, extra_files={"tokenizer.json": str(tok)}, meta={"source": "hf/x"})
  assert path == str(out)
  assert sorted(os.listdir(out)) == sorted([cio.COMPLETE_FILE, cio.CONFIG_FILE, cio.META_FILE,
                                            cio.PARAMS_DIR, "tokenizer.json"])
  assert (out / "tokenizer.json").read_text() == '{"model": "x"}'
  params, config, meta = cio.load_checkpoint(str(out), expected_kind="qwen3")
  _assert_tree_equal(params, jax.tree.map(np.asarray, _params()))
  assert config == CONFIG
  assert meta["format"] == "bp_jax" and meta["kind"] == "qwen3" and meta["source"] == "hf/x"
  assert meta["dtype"] == "mixed"  # float32 embed + bfloat16 layers.
  assert meta["params_nbytes"] == cio.params_nbytes(_params()) == 8 * 4 * 4 + 16 * 2 + 4 * 2 + 12
  assert _leftovers(tmp_path) == []


def test_uncompressed_save_loads_the_same(tmp_path):
  """compress=False (what convert_weights.py writes, to hold fewer copies while saving)."""
  out = tmp_path / "plain"
  cio.save_checkpoint(str(out), _params(), CONFIG, {"kind": "qwen3"}, compress=False)
  params, config, _ = cio.load_checkpoint(str(out), expected_kind="qwen3")
  _assert_tree_equal(params, jax.tree.map(np.asarray, _params()))
  assert config == CONFIG and _leftovers(tmp_path) == []


def test_meta_dtype_single_and_explicit(tmp_path):
  p = {"a": np.ones((2, 2), ml_dtypes.bfloat16), "i": np.arange(2)}
  _save(tmp_path / "a", p)
  assert cio.load_checkpoint(str(tmp_path / "a"))[2]["dtype"] == "bfloat16"
  _save(tmp_path / "b", p, meta={"dtype": "float32", "format": "other"})
  meta = cio.load_checkpoint(str(tmp_path / "b"))[2]
  assert meta["dtype"] == "float32" and meta["format"] == "bp_jax"


def test_restore_with_abstract_casts_dtype(tmp_path):
  _save(tmp_path / "c")
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {
      "embed": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=sharding),
      "layers": {"q": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)},
                 "norm": np.zeros(4, np.float32)},  # Array leaves work as templates too.
      "steps": jax.ShapeDtypeStruct((3,), jnp.int32),
  }
  params, _, _ = cio.load_checkpoint(str(tmp_path / "c"), abstract=abstract)
  assert isinstance(params["embed"], jax.Array) and params["embed"].dtype == jnp.bfloat16
  assert params["layers"]["q"]["w"].dtype == np.float32
  assert params["layers"]["norm"].dtype == np.float32
  np.testing.assert_allclose(np.asarray(params["embed"], np.float32), _params()["embed"],
                             rtol=1e-2)
  np.testing.assert_array_equal(params["layers"]["q"]["w"],
                                np.asarray(_params()["layers"]["q"]["w"], np.float32))


def test_restore_with_abstract_shape_mismatch(tmp_path):
  _save(tmp_path / "c")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
  abstract["layers"]["q"]["w"] = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  with pytest.raises(BadInputError) as e:
    cio.load_checkpoint(str(tmp_path / "c"), abstract=abstract)
  msg = str(e.value)
  assert "layers/q/w" in msg and "(4, 4)" in msg and "(4, 8)" in msg
  del abstract["steps"]
  abstract["layers"]["q"]["w"] = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  abstract["extra"] = jax.ShapeDtypeStruct((1,), jnp.float32)
  with pytest.raises(BadInputError, match="missing from the checkpoint: extra.*not expected: "
                     "steps"):
    cio.load_checkpoint(str(tmp_path / "c"), abstract=abstract)


# ------------------------------------------------------------------- atomicity and overwrite


class _ExplodingArray:
  """A params leaf that fails when it is copied to host memory, i.e. mid-save."""
  shape = (2,)
  dtype = np.dtype(np.float32)

  def __array__(self, dtype=None, copy=None):
    raise RuntimeError("disk on fire")


def test_failure_mid_save_leaves_nothing(tmp_path):
  out = tmp_path / "ckpt"
  params = _params()
  params["layers"]["boom"] = _ExplodingArray()
  with pytest.raises(RuntimeError, match="disk on fire"):
    _save(out, params)
  assert not out.exists()
  assert _leftovers(tmp_path) == []


def test_failure_in_orbax_save_keeps_old_checkpoint(tmp_path, monkeypatch):
  out = tmp_path / "ckpt"
  _save(out, meta={"version": 1})

  def failing_save(params_dir, host_params, compress=True):
    os.makedirs(params_dir)  # Something was already written when it fails.
    raise KeyboardInterrupt()

  monkeypatch.setattr(cio, "_save_params", failing_save)
  with pytest.raises(KeyboardInterrupt):
    _save(out, meta={"version": 2}, overwrite=True)
  monkeypatch.undo()
  assert cio.load_checkpoint(str(out))[2]["version"] == 1
  assert _leftovers(tmp_path) == []


def test_overwrite_refused_then_allowed(tmp_path):
  out = tmp_path / "ckpt"
  _save(out, meta={"version": 1})
  with pytest.raises(BadInputError) as e:
    _save(out, meta={"version": 2})
  assert str(out) in str(e.value) and "--overwrite" in str(e.value)
  assert cio.load_checkpoint(str(out))[2]["version"] == 1
  _save(out, meta={"version": 2}, overwrite=True)
  assert cio.load_checkpoint(str(out))[2]["version"] == 2
  assert _leftovers(tmp_path) == []


def test_empty_existing_dir_is_fine(tmp_path):
  out = tmp_path / "ckpt"
  out.mkdir()
  _save(out)
  assert (out / cio.COMPLETE_FILE).exists()


def test_overwrite_refuses_foreign_folder(tmp_path):
  out = tmp_path / "mydata"
  out.mkdir()
  (out / "thesis.tex").write_text("precious")
  with pytest.raises(BadInputError, match="does not hold a bp_jax checkpoint"):
    _save(out, overwrite=True)
  assert (out / "thesis.tex").read_text() == "precious"


def test_save_rejects_bad_arguments(tmp_path):
  with pytest.raises(BadInputError, match="'kind'"):
    cio.save_checkpoint(str(tmp_path / "a"), _params(), CONFIG, {})
  with pytest.raises(BadInputError, match="does not exist"):
    _save(tmp_path / "a", extra_files={"tokenizer.json": str(tmp_path / "nope.json")})
  with pytest.raises(BadInputError, match="reserved"):
    _save(tmp_path / "a", extra_files={"config.json": __file__})
  with pytest.raises(BadInputError, match="collide"):
    _save(tmp_path / "a", {"a.b": np.ones(2), "a": {"b": np.ones(2)}})
  with pytest.raises(BadInputError, match="zero size"):
    _save(tmp_path / "a", {"a": np.ones((0, 2))})
  with pytest.raises(BadInputError, match="not JSON-serialisable"):
    _save(tmp_path / "a", meta={"x": object()})
  assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------ load errors


def test_load_missing_dir(tmp_path):
  with pytest.raises(BadInputError, match="does not exist"):
    cio.load_checkpoint(str(tmp_path / "nope"))


def test_load_incomplete(tmp_path):
  out = tmp_path / "ckpt"
  _save(out)
  os.remove(out / cio.COMPLETE_FILE)
  with pytest.raises(BadInputError, match="incomplete or interrupted checkpoint") as e:
    cio.load_checkpoint(str(out))
  assert str(out) in str(e.value)


def test_load_hf_folder_hint(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(BadInputError, match="Hugging Face checkpoint"):
    cio.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("name", [cio.CONFIG_FILE, cio.META_FILE])
def test_load_missing_json(tmp_path, name):
  out = tmp_path / "ckpt"
  _save(out)
  os.remove(out / name)
  with pytest.raises(BadInputError, match=f"has no {name}"):
    cio.load_checkpoint(str(out))


def test_load_malformed_meta(tmp_path):
  out = tmp_path / "ckpt"
  _save(out)
  (out / cio.META_FILE).write_text("{oops")
  with pytest.raises(BadInputError, match="bp_jax.json: malformed JSON"):
    cio.load_checkpoint(str(out))
  (out / cio.META_FILE).write_text(json.dumps({"format": "other", "kind": "qwen3"}))
  with pytest.raises(BadInputError, match="format is 'other'"):
    cio.load_checkpoint(str(out))


def test_load_wrong_kind(tmp_path):
  out = tmp_path / "drafter"
  _save(out, kind="dflash")
  with pytest.raises(BadInputError) as e:
    cio.load_checkpoint(str(out), expected_kind="qwen3")
  msg = str(e.value)
  assert str(out) in msg and "'dflash'" in msg and "'qwen3'" in msg


def test_load_damaged_params(tmp_path):
  out = tmp_path / "ckpt"
  _save(out)
  for name in os.listdir(out / cio.PARAMS_DIR):
    p = out / cio.PARAMS_DIR / name
    if p.is_file():
      os.remove(p)
  with pytest.raises(BadInputError, match="params of checkpoint"):
    cio.load_checkpoint(str(out))
