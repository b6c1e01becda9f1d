"""--config.matmul_precision: bad values are refused naming the flag; decode.py's job and
train.py's stages run (and compile) with the value given, and restore JAX's setting after."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from bp_jax.decode_job import run as run_decode
from bp_jax.decoding.engine import Engine
from bp_jax.errors import BadInputError
from bp_jax.models.precision import (MATMUL_PRECISIONS, check_matmul_precision, matmul_precision,
                                     precision_of)
from bp_jax.train import stages
from configs import demo, qwen3


def test_configs_default_to_highest():
  assert qwen3.get_config().matmul_precision == "highest"
  assert demo.get_config().matmul_precision == "highest"


@pytest.mark.parametrize("bad", ["fastest", "HIGHEST", "", None, "bfloat16"])
def test_bad_value_is_refused_naming_the_flag(bad):
  with pytest.raises(BadInputError, match=r"--config\.matmul_precision=.*not one of"):
    check_matmul_precision(bad)
  cfg = demo.get_config()
  cfg.matmul_precision = bad
  with pytest.raises(BadInputError, match=r"--config\.matmul_precision"):
    run_decode.validate(cfg)


@pytest.mark.parametrize("value", MATMUL_PRECISIONS)
def test_context_sets_jax_config_and_the_compiled_dot(value):
  before = jax.config.jax_default_matmul_precision
  a = jnp.ones((4, 4), jnp.float32)
  with matmul_precision(value):
    assert jax.config.jax_default_matmul_precision == value
    hlo = jax.jit(lambda x, y: x @ y).lower(a, a).as_text()
  assert f"precision = [{value.upper()}, {value.upper()}]" in hlo
  assert jax.config.jax_default_matmul_precision == before


def test_decode_runs_with_the_flag_value_and_records_it(tmp_path, monkeypatch):
  (tmp_path / "p.jsonl").write_text(json.dumps({"id": "p0", "prompt": "def f(x):\n"}) + "\n")
  cfg = demo.get_config()
  cfg.update(dict(prompts=str(tmp_path / "p.jsonl"), num_prompts=0, max_new_tokens=4,
                  max_len=64, output=str(tmp_path / "d.jsonl"), show=0, compile_cache="",
                  compare="", mode="ar", matmul_precision="high"))
  seen = []
  real = Engine.generate
  monkeypatch.setattr(Engine, "generate", lambda self, ids, **kw: (
      seen.append(jax.config.jax_default_matmul_precision), real(self, ids, **kw))[1])
  before = jax.config.jax_default_matmul_precision
  _, summary = run_decode.run(cfg)
  assert seen == ["high"]
  assert summary["matmul_precision"] == "high"
  with open(cfg.output + ".summary.json") as f:
    assert json.load(f)["matmul_precision"] == "high"
  assert jax.config.jax_default_matmul_precision == before


def test_train_stages_run_with_the_flag_value(tmp_path, monkeypatch):
  seen = []
  monkeypatch.setattr(stages, "load_stage", lambda name: lambda cfg: seen.append(
      jax.config.jax_default_matmul_precision))
  cfg = demo.get_config()
  cfg.update(dict(workdir=str(tmp_path / "w"), stage="tokenizer", matmul_precision="default"))
  stages.run_stages(cfg)
  assert seen == ["default"]
  cfg.matmul_precision = "fast"
  with pytest.raises(BadInputError, match=r"--config\.matmul_precision='fast'"):
    stages.run_stages(cfg)
  assert seen == ["default"]  # nothing ran
  assert precision_of({"stage": "x"}) == "highest"  # configs without the field
