"""Tests for bp_jax.weights.safetensors_io: round trips, compatibility, sharding and error messages."""

from __future__ import annotations

import json
import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from bp_jax.weights import safetensors_io as stio
from bp_jax.errors import BadInputError


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
      "model.embed_tokens.weight": rng.standard_normal((7, 4)).astype(np.float32),
      "model.norm.weight": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
      "half": rng.standard_normal((3, 2)).astype(np.float16),
      "ids": np.arange(5, dtype=np.int64),
      "ids32": np.arange(6, dtype=np.int32).reshape(2, 3),
      "mask": np.array([True, False, True]),
      "scalar": np.array(2.5, dtype=np.float32),
      "empty": np.zeros((0, 3), np.float32),
  }


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
  assert got.dtype == want.dtype
  assert got.shape == want.shape
  if got.dtype == ml_dtypes.bfloat16:
    got, want = got.astype(np.float64), want.astype(np.float64)
  np.testing.assert_array_equal(got, want)


def test_single_file_round_trip(tmp_path):
  tensors = _tensors()
  stio.write_safetensors(str(tmp_path / "model.safetensors"), tensors, {"format": "pt"})
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    assert ckpt.keys() == sorted(tensors)
    assert "mask" in ckpt and "nope" not in ckpt
    assert ckpt.nbytes_total == sum(a.nbytes for a in tensors.values())
    assert ckpt.metadata == {"format": "pt"}
    for k, v in tensors.items():
      assert ckpt.shape(k) == v.shape
      assert ckpt.dtype(k) == v.dtype
      _assert_same(ckpt.get(k), v)
    assert ckpt.dtype("model.norm.weight") == np.dtype(ml_dtypes.bfloat16)
    # `get` returns an independent, writable copy.
    a = ckpt.get("ids")
    a[0] = 99
    assert ckpt.get("ids")[0] == 0


def test_write_non_contiguous_and_big_endian(tmp_path):
  base = np.arange(12, dtype=np.float32).reshape(3, 4)
  tensors = {"t": base.T, "be": base.astype(">f4"), "step": base[:, ::2]}
  stio.write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    for k, v in tensors.items():
      np.testing.assert_array_equal(ckpt.get(k), v)
      assert ckpt.dtype(k) == np.float32


def test_open_single_file_path(tmp_path):
  path = str(tmp_path / "x.safetensors")
  stio.write_safetensors(path, {"a": np.ones(3, np.float32)})
  with stio.open_hf_checkpoint(path) as ckpt:
    np.testing.assert_array_equal(ckpt.get("a"), np.ones(3, np.float32))


def test_our_files_read_by_safetensors_package(tmp_path):
  tensors = {k: v for k, v in _tensors().items() if k != "empty"}
  path = str(tmp_path / "model.safetensors")
  stio.write_safetensors(path, tensors, {"format": "pt"})
  loaded = safetensors.numpy.load_file(path)
  assert sorted(loaded) == sorted(tensors)
  for k, v in tensors.items():
    _assert_same(loaded[k], v)
  with safetensors.safe_open(path, framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}
    _assert_same(f.get_tensor("ids32"), tensors["ids32"])


def test_safetensors_package_files_read_by_us(tmp_path):
  tensors = {k: v for k, v in _tensors().items() if k not in ("empty",)}
  path = str(tmp_path / "model.safetensors")
  safetensors.numpy.save_file(tensors, path, metadata={"format": "np"})
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    assert ckpt.metadata == {"format": "np"}
    for k, v in tensors.items():
      _assert_same(ckpt.get(k), v)


def test_sharded_round_trip_and_index(tmp_path):
  rng = np.random.default_rng(1)
  tensors = {f"layers.{i}.w": rng.standard_normal((16, 16)).astype(np.float32)
             for i in range(5)}  # 1 KiB each.
  tensors["big"] = rng.standard_normal((40, 16)).astype(np.float32)  # 2.5 KiB > limit.
  tensors["tail"] = np.ones(3, ml_dtypes.bfloat16)
  written = stio.write_hf_checkpoint(str(tmp_path), iter(tensors.items()), max_shard_bytes=2100)
  assert written[-1] == stio.INDEX_FILE_NAME
  shards = written[:-1]
  assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    for i in range(1, len(shards) + 1)]
  assert len(shards) == 5  # [w0, w1] [w2, w3] [w4] [big] [tail]
  with open(tmp_path / stio.INDEX_FILE_NAME) as f:
    index = json.load(f)
  assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
  assert sorted(index["weight_map"]) == sorted(tensors)
  for shard in shards:  # Each shard is a valid file for the reference reader.
    assert safetensors.numpy.load_file(str(tmp_path / shard))
    with safetensors.safe_open(str(tmp_path / shard), framework="numpy") as f:
      assert f.metadata() == {"format": "pt"}
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # No temp files left.
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    assert ckpt.index_path == str(tmp_path / stio.INDEX_FILE_NAME)
    assert ckpt.keys() == sorted(tensors)
    for k, v in tensors.items():
      _assert_same(ckpt.get(k), v)


def test_single_shard_writes_plain_file_and_replaces_old_shards(tmp_path):
  tensors = _tensors()
  stio.write_hf_checkpoint(str(tmp_path), tensors.items(), max_shard_bytes=50)
  assert os.path.exists(tmp_path / stio.INDEX_FILE_NAME)
  (tmp_path / "config.json").write_text("{}")
  written = stio.write_hf_checkpoint(str(tmp_path), tensors)  # Mapping also accepted.
  assert written == [stio.SINGLE_FILE_NAME]
  assert sorted(os.listdir(tmp_path)) == ["config.json", stio.SINGLE_FILE_NAME]
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    _assert_same(ckpt.get("model.norm.weight"), tensors["model.norm.weight"])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])  # package / raw bf16 read
def test_reading_one_tensor_allocates_only_that_tensor(tmp_path, dtype):
  n = 1 << 20  # 4 MiB (2 MiB in bfloat16) per tensor; three tensors in the file.
  tensors = {"a": np.zeros(n, dtype), "b": np.arange(n).astype(dtype), "c": np.full(n, 7, dtype)}
  stio.write_safetensors(str(tmp_path / "model.safetensors"), tensors)
  one_tensor = tensors["b"].nbytes
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    tracemalloc.start()
    try:
      got = ckpt.get("b")
      _, peak = tracemalloc.get_traced_memory()
    finally:
      tracemalloc.stop()
  _assert_same(got, tensors["b"])
  assert one_tensor <= peak < 1.5 * one_tensor  # not the file, not two copies of the tensor
  got[0] = 5  # a writable array of its own


def test_transformers_from_pretrained_reads_sharded(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8)
  model = transformers.Qwen3ForCausalLM(cfg)
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  if cfg.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
  cfg.save_pretrained(str(tmp_path))
  stio.write_hf_checkpoint(str(tmp_path), iter(sd.items()), max_shard_bytes=20_000)
  assert os.path.exists(tmp_path / stio.INDEX_FILE_NAME)
  loaded = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  for k, v in loaded.state_dict().items():
    if k in sd:
      np.testing.assert_array_equal(v.numpy(), sd[k])


# ------------------------------------------------------------------------------- errors


def test_folder_without_safetensors(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(BadInputError, match="no safetensors checkpoint in .*"):
    stio.open_hf_checkpoint(str(tmp_path))
  with pytest.raises(BadInputError, match="does not exist"):
    stio.open_hf_checkpoint(str(tmp_path / "nowhere"))


def test_index_names_missing_shard(tmp_path):
  written = stio.write_hf_checkpoint(str(tmp_path), _tensors().items(), max_shard_bytes=50)
  assert len(written) > 2
  os.remove(tmp_path / written[1])
  with pytest.raises(BadInputError) as e:
    stio.open_hf_checkpoint(str(tmp_path))
  assert written[1] in str(e.value)
  assert stio.INDEX_FILE_NAME in str(e.value)


def test_index_maps_key_to_wrong_shard(tmp_path):
  written = stio.write_hf_checkpoint(str(tmp_path), _tensors().items(), max_shard_bytes=50)
  index_path = tmp_path / stio.INDEX_FILE_NAME
  index = json.loads(index_path.read_text())
  assert index["weight_map"]["ids"] != written[0]
  index["weight_map"]["ids"] = written[0]
  index_path.write_text(json.dumps(index))
  with pytest.raises(BadInputError, match="'ids'.*does not contain it"):
    stio.open_hf_checkpoint(str(tmp_path))


def test_malformed_index(tmp_path):
  (tmp_path / stio.INDEX_FILE_NAME).write_text("{not json")
  with pytest.raises(BadInputError, match="malformed JSON"):
    stio.open_hf_checkpoint(str(tmp_path))
  (tmp_path / stio.INDEX_FILE_NAME).write_text('{"metadata": {}}')
  with pytest.raises(BadInputError, match="weight_map"):
    stio.open_hf_checkpoint(str(tmp_path))


@pytest.mark.parametrize("chop", [1, 100, "to_header"])
def test_truncated_file_fails_on_open(tmp_path, chop):
  path = tmp_path / "model.safetensors"
  stio.write_safetensors(str(path), _tensors())
  data = path.read_bytes()
  header_len = int.from_bytes(data[:8], "little")
  cut = len(data) - chop if isinstance(chop, int) else 8 + header_len // 2
  path.write_bytes(data[:cut])
  with pytest.raises(BadInputError, match="truncated") as e:
    stio.open_hf_checkpoint(str(tmp_path))
  assert str(path) in str(e.value)


def test_tiny_file(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
  with pytest.raises(BadInputError, match="truncated"):
    stio.open_hf_checkpoint(str(tmp_path))


def _raw_file(path, header: bytes, data: bytes = b"") -> None:
  path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_malformed_header_json(tmp_path):
  _raw_file(tmp_path / "model.safetensors", b'{"a": {"dtype": "F32", ')
  with pytest.raises(BadInputError, match="malformed safetensors header JSON") as e:
    stio.open_hf_checkpoint(str(tmp_path))
  assert "model.safetensors" in str(e.value)
  _raw_file(tmp_path / "model.safetensors", b'{"a": {"dtype": "F32"}}')
  with pytest.raises(BadInputError, match="'a'"):
    stio.open_hf_checkpoint(str(tmp_path))


def test_unknown_dtype(tmp_path):
  header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})
  _raw_file(tmp_path / "model.safetensors", header.encode(), b"\0\0")
  with pytest.raises(BadInputError, match="'w' has unsupported dtype 'F8_E4M3'"):
    stio.open_hf_checkpoint(str(tmp_path))


def test_offsets_inconsistent_with_shape(tmp_path):
  header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})
  _raw_file(tmp_path / "model.safetensors", header.encode(), b"\0" * 8)
  with pytest.raises(BadInputError, match="'w' spans 4 bytes"):
    stio.open_hf_checkpoint(str(tmp_path))


def test_overlapping_tensors_refused_by_the_package_name_the_file(tmp_path):
  header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
  _raw_file(tmp_path / "model.safetensors", header.encode(), b"\0" * 8)
  with pytest.raises(BadInputError, match="not a valid safetensors file") as e:
    stio.open_hf_checkpoint(str(tmp_path))
  assert str(tmp_path / "model.safetensors") in str(e.value)


def test_get_missing_key(tmp_path):
  stio.write_safetensors(str(tmp_path / "model.safetensors"), {"a": np.ones(2, np.float32)})
  with stio.open_hf_checkpoint(str(tmp_path)) as ckpt:
    with pytest.raises(BadInputError) as e:
      ckpt.get("model.layers.0.mlp.up_proj.weight")
    assert "model.layers.0.mlp.up_proj.weight" in str(e.value)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(BadInputError):
      ckpt.shape("missing")


def test_write_rejects_bad_input(tmp_path):
  with pytest.raises(BadInputError, match="'c'.*complex64"):
    stio.write_safetensors(str(tmp_path / "x.safetensors"), {"c": np.ones(2, np.complex64)})
  with pytest.raises(BadInputError, match="'a' was given twice"):
    stio.write_hf_checkpoint(str(tmp_path / "d"), [("a", np.ones(1)), ("a", np.ones(1))])
  assert not [n for n in os.listdir(tmp_path / "d")]  # Partial shards are cleaned up.
