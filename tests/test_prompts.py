"""Tests for bp_jax.text.prompts: prompt sources and deterministic splits."""

import json

import pytest

from bp_jax.text import prompts
from bp_jax.errors import BadInputError


def _write_jsonl(path, lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def test_jsonl_ids_and_limit(tmp_path):
  path = _write_jsonl(tmp_path / "p.jsonl", [
      json.dumps({"prompt": "a"}),
      "",
      json.dumps({"prompt": "b", "id": "custom"}),
      json.dumps({"prompt": "c", "id": 7}),
  ])
  got = prompts.load_prompts(path)
  assert got == [prompts.Prompt("0", "a"), prompts.Prompt("custom", "b"),
                 prompts.Prompt("7", "c")]
  assert prompts.load_prompts(path, num_prompts=2) == got[:2]
  assert prompts.load_prompts(path, num_prompts=0) == got
  assert prompts.load_prompts(path, num_prompts=-1) == got


@pytest.mark.parametrize("bad_line,message", [
    ("{not json", "invalid JSON"),
    (json.dumps({"text": "x"}), "missing key \"prompt\""),
    (json.dumps(["x"]), "JSON object"),
    (json.dumps({"prompt": 3}), "must be a string"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
  path = _write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok"}), bad_line])
  with pytest.raises(BadInputError) as err:
    prompts.load_prompts(path)
  assert "bad.jsonl line 2" in str(err.value)
  assert message in str(err.value)


def test_jsonl_duplicate_ids(tmp_path):
  path = _write_jsonl(tmp_path / "dup.jsonl", [json.dumps({"prompt": "a", "id": "x"})] * 2)
  with pytest.raises(BadInputError, match="'x'"):
    prompts.load_prompts(path)


def test_jsonl_empty_file(tmp_path):
  path = _write_jsonl(tmp_path / "empty.jsonl", [])
  with pytest.raises(BadInputError, match="no prompts"):
    prompts.load_prompts(path)


def test_example_prompt_file():
  got = prompts.load_prompts("configs/prompts/example.jsonl")
  assert len(got) == 4
  assert all(p.text for p in got)


def test_humaneval():
  got = prompts.load_prompts("humaneval")
  assert len(got) == 164
  assert [p.id for p in got[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
  assert got[-1].id == "HumanEval/163"
  assert "def has_close_elements" in got[0].text
  assert [p.id for p in prompts.load_prompts("humaneval", num_prompts=5)] == [
      f"HumanEval/{i}" for i in range(5)]


def test_pysrc(tmp_path):
  (tmp_path / "pkg" / "sub").mkdir(parents=True)
  (tmp_path / "b.py").write_text("print('b')\n")
  (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
  (tmp_path / "pkg" / "__init__.py").write_text("")  # empty: skipped
  (tmp_path / "pkg" / "sub" / "c.py").write_text("# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n",
                                                 encoding="latin-1")
  (tmp_path / "notes.txt").write_text("not python")
  got = prompts.load_prompts(f"pysrc:{tmp_path}")
  assert [p.id for p in got] == ["b.py", "pkg/a.py", "pkg/sub/c.py"]
  assert got[0].text == "print('b')\n"
  assert "café" in got[2].text
  assert len(prompts.load_prompts(f"pysrc:{tmp_path}", num_prompts=1)) == 1


def test_pysrc_missing_dir(tmp_path):
  with pytest.raises(BadInputError, match="not an existing folder"):
    prompts.load_prompts(f"pysrc:{tmp_path / 'missing'}")


def test_unknown_source_lists_valid_forms(tmp_path):
  with pytest.raises(BadInputError) as err:
    prompts.load_prompts(str(tmp_path / "missing.jsonl"))
  message = str(err.value)
  assert "missing.jsonl" in message and "humaneval" in message and "pysrc:<dir>" in message


def test_split_deterministic_and_disjoint():
  ids = [f"p{i}" for i in range(101)]
  fractions = {"train": 0.8, "val": 0.1, "eval": 0.1}
  a = prompts.split_ids(ids, fractions, seed=0)
  b = prompts.split_ids(list(reversed(ids)), fractions, seed=0)
  assert a == b
  assert list(a) == ["train", "val", "eval"]
  assert sum(len(v) for v in a.values()) == 101
  assert sorted(x for v in a.values() for x in v) == sorted(ids)
  assert len(a["train"]) in (80, 81) and len(a["val"]) in (10, 11)
  for name, part in a.items():
    for other, other_part in a.items():
      if name != other:
        assert not set(part) & set(other_part)
  c = prompts.split_ids(ids, fractions, seed=1)
  assert c != a


def test_split_partial_fractions_leaves_rest():
  got = prompts.split_ids([str(i) for i in range(10)], {"eval": 0.3}, seed=3)
  assert len(got["eval"]) == 3


@pytest.mark.parametrize("ids,fractions,message", [
    (["a", "b"], {}, "at least one"),
    (["a", "b"], {"train": 1.5}, "'train'"),
    (["a", "b"], {"train": 0.7, "val": 0.7}, "above 1"),
    (["a", "a"], {"train": 1.0}, "distinct"),
])
def test_split_bad_input(ids, fractions, message):
  with pytest.raises(BadInputError, match=message):
    prompts.split_ids(ids, fractions, seed=0)


def test_check_disjoint():
  prompts.check_disjoint({"train": ["a", "b"], "eval": ["c"]})
  with pytest.raises(BadInputError, match="'train' and 'eval' overlap"):
    prompts.check_disjoint({"train": ["a", "b"], "eval": ["b"]})


def test_benchmarks_demo_prompts_are_the_labelling_splits_humaneval_prompts():
  """benchmarks.common.demo_prompts skips the labelling set's corpus windows (not HumanEval's):
  each half is what the labelling stage's split holds of HumanEval, corpus windows cut or not."""
  from benchmarks import common
  from bp_jax.text.tokenizer import encode_prompt, load_tokenizer
  from bp_jax.train.labels import prompt_sets
  from configs import demo
  tok = load_tokenizer("demo/target")
  cfg = demo.get_config()
  cfg.blockpilot.corpus_prompts = 8  # some corpus windows, as the labelling stage cuts them
  label, evals = prompt_sets(cfg, tok)
  assert any(p.source != cfg.blockpilot.eval_source for p in label)
  for half, part in (("eval", evals), ("label", label)):
    want = [(p.key, encode_prompt(tok, p.text, False)) for p in part
            if p.source == cfg.blockpilot.eval_source]
    assert common.demo_prompts(tok, half) == want and want, half
  assert common.demo_prompts(tok, "eval", skip=2, limit=3) == common.demo_prompts(tok)[2:5]
