"""Tests for bp_jax.train.loop: loss goes down, exact resume (params, optimiser state, data order),
interrupted checkpoint saves, logs and optimiser schedule."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from bp_jax.models.config import Qwen3Config
from bp_jax.errors import BadInputError
from bp_jax.models.qwen3 import Qwen3
from bp_jax.train import checkpointing, loop
from bp_jax.train.lm import lm_loss_fn
from bp_jax.optim_config import opt_config
from bp_jax.train.optim import lr_schedule

TINY = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=64)
SEQ = 17               # tokens per row (16 trained positions)
BATCH = 4
BATCHES_PER_EPOCH = 3
OPT = opt_config(lr=1e-2, warmup_frac=0.2, weight_decay=0.01, clip=1.0)


def _model(seed: int = 0) -> Qwen3:
  return Qwen3(TINY, rngs=nnx.Rngs(seed))


def _row(index: int) -> np.ndarray:
  """A learnable sequence: counting upwards mod 32 from a start that depends on the row."""
  return (np.arange(SEQ) + 7 * index) % TINY.vocab_size


class Data:
  """batches_fn over 12 rows (3 batches an epoch) that records every batch it hands out."""

  def __init__(self, fail_at: int | None = None):
    self.seen: list[tuple[int, ...]] = []
    self.fail_at = fail_at

  def __call__(self, epoch: int):
    order = np.random.default_rng(epoch).permutation(BATCH * BATCHES_PER_EPOCH)
    for b in range(BATCHES_PER_EPOCH):
      rows = order[b * BATCH:(b + 1) * BATCH]
      if self.fail_at is not None and len(self.seen) == self.fail_at:
        raise KeyboardInterrupt("simulated kill")
      self.seen.append((epoch, *rows.tolist()))
      tokens = np.stack([_row(int(i)) for i in rows]).astype(np.int32)
      yield {"tokens": tokens, "loss_mask": np.ones_like(tokens)}


def _train(workdir, data, num_steps, checkpoint_every=2, **kw):
  return loop.train(workdir=str(workdir), model=_model(), loss_fn=lm_loss_fn, batches_fn=data,
                    num_steps=num_steps, opt_cfg=OPT, checkpoint_every=checkpoint_every, seed=0,
                    desc="test", log_every=1, progress=False, **kw)


def _saved_state(workdir, step):
  """(params, opt_state, rng) stored at `step` under workdir, as numpy leaves."""
  model = _model()
  params = nnx.state(model, nnx.Param)
  from bp_jax.train.optim import make_optimizer
  tx, _ = make_optimizer(OPT, 1)
  like = {"params": params, "opt_state": tx.init(params), "rng": jax.random.PRNGKey(0)}
  ckpt = checkpointing.TrainCheckpointer(os.path.join(workdir, loop.CHECKPOINT_DIR))
  try:
    state, meta = ckpt.restore(step, like)
  finally:
    ckpt.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)], meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 8-step run (checkpoints every 2 steps), its data order and final state."""
  workdir = tmp_path_factory.mktemp("reference")
  data = Data()
  result = _train(workdir, data, 8)
  leaves, meta = _saved_state(str(workdir), 8)
  return {"workdir": str(workdir), "result": result, "seen": list(data.seen), "leaves": leaves,
          "meta": meta}


def _assert_same_leaves(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)


def test_loss_decreases_and_logs_are_written(reference):
  result = reference["result"]
  losses = [r["loss"] for r in result.history if "loss" in r]
  assert len(losses) == 8
  assert losses[-1] < 0.8 * losses[0], losses
  assert result.step == 8 and result.start_step == 0
  workdir = reference["workdir"]
  with open(os.path.join(workdir, loop.METRICS_FILE)) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(range(1, 9))
  assert {"loss", "lr", "tokens_per_s", "grad_norm", "accuracy"} <= set(records[-1])
  assert os.path.getsize(os.path.join(workdir, loop.PLOT_FILE)) > 1000
  # orbax keeps the two newest steps, with no temporary folders left behind.
  assert sorted(os.listdir(os.path.join(workdir, loop.CHECKPOINT_DIR))) == ["6", "8"]
  assert reference["meta"] == {"step": 8, "epoch": 2, "batch": 2, "seed": 0, "num_steps": 8,
                               "elapsed_s": reference["meta"]["elapsed_s"]}


def test_resume_after_kill_matches_uninterrupted_run(reference, tmp_path):
  killed = Data(fail_at=5)  # dies fetching the 6th batch: the last checkpoint is step 4
  with pytest.raises(KeyboardInterrupt):
    _train(tmp_path, killed, 8)
  assert killed.seen == reference["seen"][:5]
  resumed = Data()
  result = _train(tmp_path, resumed, 8)
  assert result.start_step == 4
  # Steps 5..8 train on exactly the batches of the uninterrupted run: epoch 1 is re-read from
  # its start and its first batch (trained before the kill) is skipped.
  assert resumed.seen == reference["seen"][3:]
  leaves, meta = _saved_state(str(tmp_path), 8)
  _assert_same_leaves(leaves, reference["leaves"])
  assert meta["epoch"] == reference["meta"]["epoch"] and meta["batch"] == reference["meta"]["batch"]
  # The log has one record per step: the steps redone after the kill replaced the lost ones.
  assert [r["step"] for r in result.history] == list(range(1, 9))
  # Calling again at the end trains nothing and returns the same model.
  again = _train(tmp_path, Data(), 8)
  assert again.start_step == 8
  _assert_same_leaves([np.asarray(x) for x in jax.tree.leaves(nnx.state(again.model))],
                      [np.asarray(x) for x in jax.tree.leaves(nnx.state(result.model))])


def _copy_reference(reference, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(reference["workdir"], workdir)
  return workdir


def test_more_steps_continue_from_the_last_checkpoint(reference, tmp_path):
  workdir = _copy_reference(reference, tmp_path)
  data = Data()
  more = _train(workdir, data, 10)
  assert more.start_step == 8 and more.step == 10
  # The reference ended after batch 2 of epoch 2: those two are skipped, then epoch 2's last
  # batch and epoch 3's first are trained.
  assert [seen[0] for seen in data.seen] == [2, 2, 2, 3]
  assert data.seen[:3] == reference["seen"][-2:] + [data.seen[2]]
  assert [r["step"] for r in more.history] == list(range(1, 11))


def _fail_json_write(monkeypatch):
  calls = {"n": 0}
  original = ocp.JsonCheckpointHandler.async_save

  async def failing(self, *args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 2:  # the second checkpoint's metadata item
      raise OSError("simulated crash while writing a checkpoint")
    return await original(self, *args, **kwargs)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", failing)


def _fail_commit(monkeypatch):
  from orbax.checkpoint._src.path import atomicity
  calls = {"n": 0}
  original = atomicity.on_commit_callback

  async def failing(*args, **kwargs):
    calls["n"] += 1
    if calls["n"] == 2:  # everything of the second checkpoint is written, not yet renamed
      raise OSError("simulated crash before the checkpoint is committed")
    return await original(*args, **kwargs)

  monkeypatch.setattr(atomicity, "on_commit_callback", failing)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("break_save", [_fail_json_write, _fail_commit],
                         ids=["while-writing", "before-commit"])
def test_interrupted_save_keeps_previous_checkpoint(reference, tmp_path, monkeypatch, break_save):
  started = []
  original_remove = checkpointing.remove_unfinished

  def spy(directory, *args, **kwargs):  # records the partial folder the failed save left
    if os.path.isdir(directory):
      started.extend(n for n in os.listdir(directory) if checkpointing.TMP_MARKER in n)
    return original_remove(directory, *args, **kwargs)

  with monkeypatch.context() as patch:
    break_save(patch)
    patch.setattr(checkpointing, "remove_unfinished", spy)
    with pytest.raises(OSError, match="simulated crash"):
      _train(tmp_path, Data(), 8, checkpoint_every=4)
  assert "8" + checkpointing.TMP_MARKER in started  # the save of step 8 was cut mid-way
  ckpt_dir = tmp_path / loop.CHECKPOINT_DIR
  ckpt = checkpointing.TrainCheckpointer(str(ckpt_dir))
  try:
    assert ckpt.latest_step() == 4 and ckpt.all_steps() == [4]
  finally:
    ckpt.close()
  assert [n for n in os.listdir(ckpt_dir) if checkpointing.TMP_MARKER not in n] == ["4"]
  result = _train(tmp_path, Data(), 8, checkpoint_every=4)
  assert result.start_step == 4
  leaves, _ = _saved_state(str(tmp_path), 8)
  _assert_same_leaves(leaves, reference["leaves"])


def test_resume_rejects_another_seed_model_or_shorter_run(reference, tmp_path):
  workdir = str(_copy_reference(reference, tmp_path))
  kw = dict(workdir=workdir, loss_fn=lm_loss_fn, batches_fn=Data(), opt_cfg=OPT,
            checkpoint_every=2, desc="t", progress=False)
  with pytest.raises(BadInputError, match="seed"):
    loop.train(model=_model(), num_steps=8, seed=1, **kw)
  wider = Qwen3(dataclasses.replace(TINY, intermediate_size=48), rngs=nnx.Rngs(0))
  with pytest.raises(BadInputError, match="another model config"):
    loop.train(model=wider, num_steps=8, seed=0, **kw)
  with pytest.raises(BadInputError, match="past num_steps"):
    loop.train(model=_model(), num_steps=6, seed=0, **kw)


def test_empty_data_and_bad_arguments_are_clear_errors(tmp_path):
  with pytest.raises(BadInputError, match="no batches"):
    _train(tmp_path / "a", lambda epoch: iter(()), 2)
  with pytest.raises(BadInputError, match="checkpoint_every"):
    _train(tmp_path / "b", Data(), 2, checkpoint_every=0)


def test_frozen_is_an_argument_and_eval_is_logged(tmp_path):
  """`frozen` reaches loss_fn and eval_fn as traced data; eval metrics get an eval_ prefix."""
  seen = {}

  def loss_fn(model, frozen, batch, rng):
    seen["frozen_type"] = type(frozen["scale"])
    loss, metrics = lm_loss_fn(model, None, batch, rng)
    return loss * frozen["scale"], metrics

  def eval_fn(model, frozen):
    return {"loss": float(frozen["scale"]), "eval_extra": 1.0}

  result = loop.train(workdir=str(tmp_path), model=_model(), loss_fn=loss_fn,
                      batches_fn=Data(), num_steps=4, opt_cfg=OPT, frozen={"scale": jnp.ones(())},
                      eval_fn=eval_fn, eval_every=2, checkpoint_every=4, seed=0, desc="t",
                      progress=False)
  assert issubclass(seen["frozen_type"], jax.core.Tracer)
  assert result.eval_metrics == {"eval_loss": 1.0, "eval_extra": 1.0}
  assert [r["step"] for r in result.history if "eval_loss" in r] == [2, 4]


def test_schedule_warms_up_then_decays():
  schedule = lr_schedule(opt_config(lr=1.0, warmup_frac=0.1, min_lr_frac=0.1), 100)
  values = [float(schedule(s)) for s in range(101)]
  assert values[0] == 0.0 and values[10] == pytest.approx(1.0)
  assert values[5] == pytest.approx(0.5)
  assert values[100] == pytest.approx(0.1, abs=1e-6)
  assert all(a >= b for a, b in zip(values[10:], values[11:]))
  with pytest.raises(BadInputError, match="warmup_frac"):
    lr_schedule(opt_config(warmup_frac=1.5), 10)
