"""Tests for bp_jax.data: TFDS ArrayRecord datasets without TensorFlow, batches, LM chunks."""

import importlib.util
import json
import os
import sys
import tempfile

import numpy as np
import pytest
import tensorflow_datasets as tfds

from bp_jax import data
from bp_jax.errors import BadInputError
from bp_jax.text.prompts import Prompt, split_ids


def _jsonl(tmp_path, texts):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n"
                          for i, t in enumerate(texts)), encoding="utf-8")
  return str(path)


def _records(lengths, prompt_lens=None):
  prompt_lens = prompt_lens or [0] * len(lengths)
  for i, (n, p) in enumerate(zip(lengths, prompt_lens)):
    yield {"id": f"s{i}", "tokens": np.arange(100 * i, 100 * i + n), "prompt_len": p}


def test_tensorflow_is_not_installed_and_not_needed(tmp_path):
  assert importlib.util.find_spec("tensorflow") is None
  ds = data.write_sequences(tmp_path, "tiny", _records([3]))
  assert ds[0]["tokens"].tolist() == [0, 1, 2]
  assert "tensorflow" not in sys.modules
  with pytest.raises(ImportError):
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import


def test_prompt_set_round_trip_keeps_ids_texts_and_order(tmp_path, capsys):
  texts = ["def f():\n  return 1\n", "  indented\ttab\n\n", "é ünïcode ✓", "last"]
  source = _jsonl(tmp_path, texts)
  ds = data.write_prompts(tmp_path / "d", "prompts_all", source)
  assert capsys.readouterr() == ("", "")  # building is quiet
  assert len(ds) == 4 and ds.kind == "prompt_set"
  assert [r["id"] for r in ds] == ["p0", "p1", "p2", "p3"]
  assert [r["text"] for r in ds] == texts
  assert data.read_prompts(tmp_path / "d", "prompts_all") == [
      Prompt(f"p{i}", t) for i, t in enumerate(texts)]
  # Plain TFDS reads it too (bytes, as TFDS gives them).
  raw = tfds.data_source("prompt_set/prompts_all", data_dir=str(tmp_path / "d"), split="train")
  assert raw[2]["text"].decode() == texts[2]


def test_building_a_dataset_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
  # TFDS's own builder makes an empty mkdtemp("tfds") folder per unprepared dataset and never
  # removes it (its GCS lookup); ours skips that lookup and removes its scratch folder.
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  ds = data.write_prompts(tmp_path / "d", "prompts_all", _jsonl(tmp_path, ["a", "b"]))
  assert len(ds) == 2
  data.write_sequences(tmp_path / "d", "tiny", _records([3, 2]))
  assert sorted(os.listdir(scratch)) == []


def test_one_builder_class_makes_several_named_sets(tmp_path):
  source = _jsonl(tmp_path, [f"text {i}" for i in range(10)])
  parts = split_ids([f"p{i}" for i in range(10)], {"train": 0.7, "eval": 0.3}, seed=3)
  train = data.write_prompts(tmp_path / "a", "prompts_jsonl_train", source, ids=parts["train"])
  evals = data.write_prompts(tmp_path / "b", "prompts_jsonl_eval", source, ids=parts["eval"])
  train_ids = [r["id"] for r in train]
  assert train_ids == sorted(parts["train"], key=lambda i: int(i[1:]))  # source order
  assert {r["id"] for r in evals} == set(parts["eval"])
  assert not set(train_ids) & {r["id"] for r in evals}
  assert "selected by id" in train.description
  assert not data.dataset_exists(tmp_path / "a", "prompts_jsonl_eval")


def test_prompt_sets_from_humaneval_and_pysrc(tmp_path):
  pkg = tmp_path / "src"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "a.py").write_text("x = 1\n")
  (pkg / "sub" / "b.py").write_text("def g():\n    pass\n")
  pysrc = data.write_prompts(tmp_path / "d", "prompts_pysrc_train", f"pysrc:{pkg}")
  assert [(r["id"], r["text"]) for r in pysrc] == [
      ("a.py", "x = 1\n"), ("sub/b.py", "def g():\n    pass\n")]
  he = data.write_prompts(tmp_path / "d", "prompts_humaneval_eval", "humaneval",
                          ids=["HumanEval/7", "HumanEval/2"])
  assert [r["id"] for r in he] == ["HumanEval/2", "HumanEval/7"]
  assert he[0]["text"].startswith("\n\ndef truncate_number")


def test_prompt_selection_errors(tmp_path):
  source = _jsonl(tmp_path, ["a", "b"])
  with pytest.raises(BadInputError, match="no prompt with id 'zz'"):
    data.write_prompts(tmp_path / "d", "p", source, ids=["p0", "zz"])
  with pytest.raises(BadInputError, match="dataset name"):
    data.write_prompts(tmp_path / "d", "bad/name", source)
  assert not data.dataset_exists(tmp_path / "d", "p")


def test_sequences_round_trip_variable_lengths(tmp_path):
  lengths, prompt_lens = [5, 1, 17, 3], [2, 0, 17, 1]
  ds = data.write_sequences(tmp_path, "regen_train", _records(lengths, prompt_lens),
                            description="test set")
  assert len(ds) == 4 and ds.kind == "token_sequences" and ds.description == "test set"
  for i, record in enumerate(ds):
    assert record["id"] == f"s{i}"
    assert record["tokens"].dtype == np.int32
    assert record["tokens"].tolist() == list(range(100 * i, 100 * i + lengths[i]))
    assert record["prompt_len"] == prompt_lens[i]
  assert [r["id"] for r in ds[1:3]] == ["s1", "s2"]
  assert ds[-1]["id"] == "s3"
  reopened = data.open_dataset(tmp_path, "regen_train")
  assert reopened[2]["tokens"].tolist() == ds[2]["tokens"].tolist()


def test_sequences_existing_overwrite_and_bad_records(tmp_path):
  data.write_sequences(tmp_path, "seqs", _records([2, 3]))
  with pytest.raises(BadInputError, match="already exists"):
    data.write_sequences(tmp_path, "seqs", _records([4]))
  ds = data.write_sequences(tmp_path, "seqs", _records([4]), overwrite=True)
  assert len(ds) == 1 and ds[0]["tokens"].tolist() == [0, 1, 2, 3]

  with pytest.raises(BadInputError, match="no records"):
    data.write_sequences(tmp_path, "empty", iter([]))
  bad = [{"id": "a", "tokens": [1, 2]}, {"id": "b", "tokens": [1], "prompt_len": 2}]
  with pytest.raises(BadInputError, match=r"dataset 'broken' record 1 \(id 'b'\).*prompt_len"):
    data.write_sequences(tmp_path, "broken", bad)
  with pytest.raises(BadInputError, match="more than once"):
    data.write_sequences(tmp_path, "broken", [{"id": "a", "tokens": [1]}] * 2)
  with pytest.raises(BadInputError, match="integers"):
    data.write_sequences(tmp_path, "broken", [{"id": "a", "tokens": [0.5]}])
  assert not data.dataset_exists(tmp_path, "broken")
  with pytest.raises(BadInputError, match="not found"):
    data.open_dataset(tmp_path, "broken")


def test_missing_dataset_errors_name_dataset_and_dir(tmp_path):
  with pytest.raises(BadInputError) as err:
    data.open_dataset(tmp_path, "prompts_nope")
  assert "'prompts_nope'" in str(err.value) and str(tmp_path) in str(err.value)
  with pytest.raises(BadInputError, match="data_dir does not exist"):
    data.open_dataset(tmp_path / "missing", "x")
  (tmp_path / "token_sequences" / "half" / "incomplete.ABC_1.0.0").mkdir(parents=True)
  with pytest.raises(BadInputError, match="never completely prepared"):
    data.open_dataset(tmp_path, "half")


def _sequence_source(n):
  return [{"id": f"s{i}", "tokens": np.arange(i % 7 + 3), "prompt_len": i % 3} for i in range(n)]


def test_batches_are_deterministic_per_seed_and_epoch(tmp_path):
  ds = data.write_sequences(tmp_path, "seqs", iter(_sequence_source(64)))
  def run(seed, epoch, source=ds):
    return list(data.batches(source, 8, 6, seed=seed, epoch=epoch, pad_id=0))
  first = run(1, 0)
  assert len(first) == 8
  for a, b in zip(first, run(1, 0)):
    assert all(np.array_equal(a[k], b[k]) for k in a)
  for a, b in zip(first, run(1, 0, source=_sequence_source(64))):  # a list source agrees
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, run(1, 1)))
  assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, run(2, 0)))
  # Each epoch visits every example once.
  assert sorted(data.epoch_order(64, 1, 0).tolist()) == list(range(64))


def test_batch_padding_truncation_and_loss_mask():
  source = [{"tokens": [5, 6, 7], "prompt_len": 1},
            {"tokens": [1, 2, 3, 4, 5, 6, 7], "prompt_len": 2},
            {"tokens": [9, 9], "prompt_len": 2},
            {"tokens": [8], "prompt_len": 0}]
  batch = data.pad_batch(source, seq_len=5, pad_id=-1)
  np.testing.assert_array_equal(batch["tokens"], [[5, 6, 7, -1, -1], [1, 2, 3, 4, 5],
                                                  [9, 9, -1, -1, -1], [8, -1, -1, -1, -1]])
  np.testing.assert_array_equal(batch["loss_mask"], [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1],
                                                     [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch["lengths"], [3, 5, 2, 1])
  assert all(batch[k].dtype == np.int32 for k in batch)
  # The remainder: dropped by default, a short batch otherwise.
  shapes = [b["tokens"].shape for b in data.batches(source, 3, 5, seed=0, epoch=0, pad_id=0)]
  assert shapes == [(3, 5)]
  shapes = [b["tokens"].shape for b in data.batches(source, 3, 5, seed=0, epoch=0, pad_id=0,
                                                    drop_remainder=False)]
  assert shapes == [(3, 5), (1, 5)]
  with pytest.raises(BadInputError, match="batch_size"):
    next(data.batches(source, 0, 5, seed=0, epoch=0, pad_id=0))


def test_packed_lm_chunks():
  docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12]]
  chunks = list(data.packed_lm_chunks(docs, 4, eot_id=0))
  # Stream: 1 2 3 0 4 5 0 6 7 8 9 10 11 12 0 -> 3 full chunks, 3 tokens dropped.
  assert [c.tolist() for c in chunks] == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 10]]
  assert all(c.dtype == np.int32 for c in chunks)
  flat = list(data.packed_lm_chunks(iter(range(10)), 3))  # a stream of single ids
  assert [c.tolist() for c in flat] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
  records = list(data.chunk_records(chunks, id_prefix="lm-"))
  assert records[1]["id"] == "lm-00000001" and records[1]["prompt_len"] == 0
  assert list(data.packed_lm_chunks([[1, 2]], 5)) == []


def test_lm_chunks_stream_into_a_dataset(tmp_path):
  stream = (np.arange(n) for n in range(1, 40))
  ds = data.write_sequences(tmp_path, "lm_train",
                            data.chunk_records(data.packed_lm_chunks(stream, 16, eot_id=0)))
  assert len(ds) == (sum(range(1, 40)) + 39) // 16
  batch = next(data.batches(ds, 4, 16, seed=0, epoch=0, pad_id=0))
  assert batch["loss_mask"].all() and (batch["lengths"] == 16).all()
  assert os.path.isdir(ds.path)
