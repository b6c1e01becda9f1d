"""Sharding checks on 8 simulated CPU devices, run by tests/test_sharding.py in a subprocess
(XLA_FLAGS must be set before JAX starts, and the pytest process already has one device).

  python tests/sharding_checks.py OUT.json

Writes {check name: result} for the test to assert on. Tiny random models throughout.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bp_jax.decoding.engine import Engine  # noqa: E402
from bp_jax.decoding.options import BatchOptions, ShapeOptions  # noqa: E402
from bp_jax.errors import BadInputError  # noqa: E402
from bp_jax.models.config import DFlashConfig, Qwen3Config  # noqa: E402
from bp_jax.models.dflash import DFlashDrafter  # noqa: E402
from bp_jax.models.qwen3 import Qwen3  # noqa: E402
from bp_jax.parallel import mesh as pmesh  # noqa: E402
from bp_jax.parallel import rules  # noqa: E402

V = 128
CFG = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                  tie_word_embeddings=False, max_position_embeddings=256)
PROMPTS = ([5, 17, 3, 99, 42, 8, 61], list(range(10, 30)), [7] * 3)
MAX_NEW = 24
MESHES = ("data:4,model:2", "data:8")  # model-parallel with data, and data-parallel alone


def tiny_pair():
  """A random target with peaked logits (no near-ties to flip under another summation order)
  and a drafter over its layer 0 whose logits are all 0, so it drafts token 0."""
  target = Qwen3(CFG, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    getattr(target.layers, name)[...] = 4 * getattr(target.layers, name)[...]
  target.lm_head[...] = jax.random.normal(jax.random.key(2), target.lm_head.shape)
  layers = Qwen3Config(**{**CFG.__dict__, "num_hidden_layers": 1})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=4, num_target_layers=2,
                                       mask_token_id=V - 1, target_layer_ids=(0,)),
                          rngs=nnx.Rngs(3))
  drafter.norm[...] = jnp.zeros_like(drafter.norm[...])  # always drafts token 0 (accepted at
  return target, drafter                                 # times: partial acceptances occur)


def spec_of(x) -> list:
  return [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]


def decode_all(target, drafter, mesh, spec_decode: bool) -> dict:
  eng = Engine(target, drafter=drafter, mesh=mesh,
               shapes=ShapeOptions(max_len=64, length_buckets=(32,), block_sizes=(1, 4)))
  out = {"ar": [eng.generate(p, max_new_tokens=MAX_NEW).output_ids for p in PROMPTS]}
  if spec_decode:
    gens = [eng.generate(p, max_new_tokens=MAX_NEW, block_size=4) for p in PROMPTS]
    out["spec"] = [g.output_ids for g in gens]
    out["spec_lengths"] = [g.forward_lengths for g in gens]
  out["compiled"] = eng.compiled.summary()["by_function"]
  # Batched decoding: 8 slots, so the rows divide data:8 and data:4.
  many = Engine(target, drafter=drafter, mesh=mesh,
                shapes=ShapeOptions(max_len=64, length_buckets=(32,), block_sizes=(1, 4)),
                batching=BatchOptions(batch_size=8, sync_cycles=3, shrink=False))
  prompts = list(PROMPTS) + [[(3 * i + j) % (V - 2) + 1 for j in range(5 + i)] for i in range(7)]
  max_news = [MAX_NEW - 2 * i for i in range(len(prompts))]
  for b, name in ((1, "batch_ar"), (4, "batch_spec")):
    out[name] = [g.output_ids for g in many.generate_batch(prompts, max_new_tokens=max_news,
                                                           block_size=b)]
  if mesh is None:  # the reference every mesh's batches are compared with, decoded once
    out["batch_alone"] = [eng.generate(p, max_new_tokens=m).output_ids
                          for p, m in zip(prompts, max_news)]
  out["batch_compiled"] = many.compiled.summary()["by_function"]
  if mesh is not None:
    carry = many.slot_carry(4)
    out["batch_seq"] = spec_of(carry.seq_BS)
    out["batch_cache_k"] = spec_of(carry.cache.k[0] if carry.cache.is_per_layer
                                   else carry.cache.k)
    out["t_q_proj"] = spec_of(eng.t_state["layers"]["q_proj"][...])
    out["d_k_proj"] = spec_of(eng.d_state["layers"]["k_proj"][...])
    out["cache_k"] = spec_of(eng.cache.k[0] if eng.cache.is_per_layer else eng.cache.k)
    out["draft_cache_k"] = spec_of(eng.draft_cache.k[0] if eng.draft_cache.is_per_layer
                                   else eng.draft_cache.k)
  if spec_decode and mesh is not None:  # data:4,model:2 (one device: test_batched_decode's)
    # A batch's tail in fewer slots (`BatchOptions.shrink`): 4 slots, then 2 and 1, which data:4
    # does not divide: those states' rows are replicated, their caches' kv heads still on model.
    tail = Engine(target, drafter=drafter, mesh=mesh,
                  shapes=ShapeOptions(max_len=64, length_buckets=(32,), block_sizes=(1, 4)),
                  batching=BatchOptions(batch_size=4, sync_cycles=2))
    out["tail_spec"] = [g.output_ids for g in tail.generate_batch(
        prompts[:6], max_new_tokens=max_news[:6], block_size=4)]
    out["tail_compiled"] = tail.compiled.summary()["by_function"]
  return out


def check_priced_policy(target, drafter) -> dict:
  """A priced policy choosing between sizes 1 and 4 on a data:4,model:2 mesh: the prices the
  engine places move its picks from request to request (its price leaf placed anew, nothing
  compiled), and every request's tokens are AR's."""
  from bp_jax.decoding.engine import LEARNED
  from bp_jax.policy.mlp import BlockPolicy, PolicyArch
  mesh = pmesh.make_mesh("data:4,model:2")
  policy = BlockPolicy(PolicyArch("last_hidden", CFG.hidden_size, 16, 2, 2, head="priced"),
                       rngs=nnx.Rngs(5))
  counts = np.r_[1.0, 0.3, 0.0, 0.0]  # per new token: size 1's steps, size 4's cycles (τ 3.3)
  policy.w_out[...] = jnp.zeros_like(policy.w_out[...])
  policy.b_out[...] = jnp.asarray(counts, jnp.float32)
  policy.set_priced_decision(counts, 1.0)
  eng = Engine(target, drafter=drafter, mesh=mesh, policy=policy, policy_sizes=(1, 4),
               shapes=ShapeOptions(max_len=64, length_buckets=(32,), block_sizes=(1, 4)))
  out = {"picks": [], "same_as_ar": True}
  for cycle in (1.5, 6.0, 1.5):  # a cycle of 4 tokens in AR steps: cheap, dear, cheap
    eng.policy_prices = lambda c=cycle: (np.r_[1.0, c], np.ones(2))
    for p in PROMPTS:
      g = eng.generate(p, max_new_tokens=MAX_NEW, block_size=LEARNED)
      out["picks"].append(g.block_size)
      out["same_as_ar"] &= g.output_ids == eng.generate(p, max_new_tokens=MAX_NEW).output_ids
  placed = eng.p_state["size_prices"].get_value()
  out["prices_replicated"] = (placed.sharding.is_fully_replicated
                              and len(placed.sharding.device_set) == 8)
  out["prefills"] = eng.compiled.summary()["by_function"]["prefill"]
  return out


def forward_logits(target, mesh):
  """Logits of one prefill-sized forward (stacked cache, lax.scan), under jit."""
  graph, state = nnx.split(target)
  cache = target.init_cache(1, 32)
  if mesh is not None:
    state, cache = rules.shard_state(state, mesh), rules.shard_cache(cache, mesh)

  @jax.jit
  def f(state, tokens, cache):
    return nnx.merge(graph, state)(tokens, cache, hidden_layers=(0,)).logits

  return np.asarray(f(state, jnp.asarray([PROMPTS[1]], jnp.int32), cache))


def check_decoding(target, drafter) -> dict:
  out = {"single": decode_all(target, drafter, None, True)}
  ref = forward_logits(target, None)
  for spec in MESHES:
    mesh = pmesh.make_mesh(spec)
    out[spec] = decode_all(target, drafter, mesh, spec == "data:4,model:2")
    logits = forward_logits(target, mesh)
    out[spec]["logits_max_diff"] = float(np.abs(logits - ref).max())
    out[spec]["logits_argmax_equal"] = bool((logits.argmax(-1) == ref.argmax(-1)).all())
  return out


def check_restore(target, drafter) -> dict:
  from bp_jax.models.nnx_utils import module_params
  from bp_jax.weights.checkpoint_io import save_checkpoint
  from bp_jax.weights.loading import load_drafter, load_target

  mesh = pmesh.make_mesh("data:4,model:2")
  host = lambda m: jax.tree.map(np.asarray, module_params(m))
  with tempfile.TemporaryDirectory() as tmp:
    save_checkpoint(f"{tmp}/t", host(target), CFG.to_hf_dict(), {"kind": "qwen3"})
    save_checkpoint(f"{tmp}/d", host(drafter), drafter.cfg.to_hf_dict(), {"kind": "dflash"})
    t = load_target(f"{tmp}/t", mesh=mesh)
    d = load_drafter(f"{tmp}/d", t.cfg, mesh=mesh)
  want = rules.param_shardings(target, mesh)
  got_t = nnx.state(t)
  same = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), got_t, want)
  equal = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                       got_t, nnx.state(target))
  q = t.layers.q_proj[...]
  return {"target_shardings_as_table": all(jax.tree.leaves(same)),
          "target_values_equal": all(jax.tree.leaves(equal)),
          "q_proj_spec": spec_of(q), "q_proj_shard_shape": list(q.addressable_shards[0].data.shape),
          "embed_spec": spec_of(t.embed[...]), "lm_head_spec": spec_of(t.lm_head[...]),
          "down_proj_spec": spec_of(t.layers.down_proj[...]),
          "drafter_k_proj_spec": spec_of(d.layers.k_proj[...]),
          "drafter_fc_spec": spec_of(d.fc[...])}


def _draft_batch(B: int = 8, T: int = 20) -> dict:
  rs = np.random.default_rng(0)
  starts = rs.integers(2, V, size=B)
  tokens = np.stack([(s - 2 + 3 * np.arange(T)) % (V - 2) + 2 for s in starts]).astype(np.int32)
  return {"tokens": tokens, "lengths": np.full((B,), T, np.int32),
          "prompt_lens": np.full((B,), 4, np.int32),
          "loss_mask": (np.arange(T)[None] >= 4).astype(np.int32).repeat(B, 0)}


def check_draft_train(target, spec: str) -> dict:
  from bp_jax.optim_config import opt_config
  from bp_jax.train import draft_objective as obj
  from bp_jax.train.loop import train

  t_graph, t_state = nnx.split(target)
  batch = _draft_batch()
  losses = {}
  for name in ("single", spec):
    mesh = pmesh.make_mesh(spec) if name == spec else None
    drafter = DFlashDrafter(tiny_pair()[1].cfg, rngs=nnx.Rngs(5))
    with tempfile.TemporaryDirectory() as tmp:
      res = train(workdir=tmp, model=drafter,
                  loss_fn=obj.make_draft_loss_fn(t_graph, block_size=4, num_anchors=4,
                                                 gamma=4.0),
                  batches_fn=lambda epoch: iter([batch] * 4), num_steps=2,
                  opt_cfg=opt_config(lr=1e-2), frozen=rules.shard_state(t_state, mesh),
                  checkpoint_every=100, seed=0, desc="draft", log_every=1, progress=False,
                  mesh=mesh)
    losses[name] = [r["loss"] for r in res.history if "loss" in r]
    if mesh is not None:
      losses["trained_k_proj_spec"] = spec_of(res.model.layers.k_proj[...])
  return losses


def check_policy_train(spec: str) -> dict:
  from bp_jax.optim_config import opt_config
  from bp_jax.policy.mlp import PolicyArch
  from bp_jax.train.policy_stage import fit_policy

  rs = np.random.default_rng(1)
  x, y = rs.normal(size=(24, 16)).astype(np.float32), rs.integers(0, 3, size=24)
  arch = PolicyArch("last_hidden", 16, 32, 2, 3)
  out = {}
  for name in ("single", spec):
    mesh = pmesh.make_mesh(spec) if name == spec else None
    fit = fit_policy(x[:16], y[:16], x[16:], y[16:], arch, opt_cfg=opt_config(lr=1e-2),
                     steps=3, batch=8, label_smoothing=0.1, eval_every=1, patience=5, seed=0,
                     mesh=mesh)
    out[name] = [[h["loss"], h["val_loss"]] for h in fit.history]
  return out


def check_bad_mesh() -> dict:
  out = {}
  for text in ("data:4,model:4", "data:16"):
    try:
      pmesh.make_mesh(text)
      out[text] = "no error"
    except BadInputError as e:
      out[text] = str(e)
  return out


def main(path: str) -> None:
  target, drafter = tiny_pair()
  results = {"devices": jax.device_count(),
             "decoding": check_decoding(target, drafter),
             "restore": check_restore(target, drafter),
             "draft_train": check_draft_train(target, "data:4,model:2"),
             "policy_train": check_policy_train("data:8"),
             "priced_policy": check_priced_policy(target, drafter),
             "bad_mesh": check_bad_mesh()}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
