"""JAX-only toy models for tests of acceptance figures and replays, and the engine, requests
and checks the controller tests share on them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from compile_counting import BackendCompiles
from flax import nnx

from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.models.config import DFlashConfig, Qwen3Config
from bp_jax.models.dflash import DFlashDrafter
from bp_jax.models.qwen3 import Qwen3


def zeros_drafter_pair(vocab_size: int = 64):
  """(target, drafter): a random untied target whose greedy output often is token 0, and a
  drafter whose final norm is zero: its logits are all 0, so it always drafts token 0 and a
  cycle accepts exactly the run of 0s the target produces next — partial acceptances of every
  length, and poor cycles after which an AR fallback steps, are common (b = 4 on
  `toy_requests(6)`: cycles committing 1/2/3/4 tokens 4/8/2/26 times).

  Two target layers, the drafter reading the first (its features do not change its drafts):
  XLA:CPU's compile time grows with the unrolled layers (a priced toy engine's programs, backend
  compile 4.4 / 8.5 / 13.4 s at 1 / 3 / 6 layers), and the tests compile hundreds of programs
  on this pair (docs/results/suite.md)."""
  V = vocab_size
  cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
                    tie_word_embeddings=False, max_position_embeddings=256)
  target = Qwen3(cfg, rngs=nnx.Rngs(0))
  target.embed[...] = jax.random.normal(jax.random.key(1), target.embed.shape)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    getattr(target.layers, name)[...] = 7 * getattr(target.layers, name)[...]
  head = target.lm_head[...]
  target.lm_head[...] = head.at[:, 0].add(0.3 * jax.random.normal(jax.random.key(5), (32,)))
  layers = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": 1})
  drafter = DFlashDrafter(DFlashConfig(layers=layers, block_size=4, num_target_layers=2,
                                       mask_token_id=V - 1, target_layer_ids=(0,)),
                          rngs=nnx.Rngs(2))
  drafter.norm[...] = jnp.zeros_like(drafter.norm[...])
  return target, drafter


def toy_requests(num: int, seed: int = 0, vocab_size: int = 64
                 ) -> tuple[list[list[int]], list[int]]:
  """`num` random prompts of 2..49 tokens (ids 1..V-2) and their max_new_tokens (1..39)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, vocab_size - 1, int(rng.integers(2, 50))).tolist()
             for _ in range(num)]
  return prompts, [int(rng.integers(1, 40)) for _ in range(num)]


def toy_engine(models, controller: str, batch_size: int = 1, sync_cycles: int = 16,
               shrink: bool = False, move_plain_after: int = BatchOptions.move_plain_after,
               head_apart: bool | None = None, **loop) -> Engine:
  """An engine on `zeros_drafter_pair` (max_len 128, length buckets 16/32/64, block sizes 1
  and 4) whose spec loops use `controller` (also the tests' "fixed:k", which the command line
  refuses); `loop`: further `LoopOptions` fields. Its batches compute all slots unless `shrink`
  (`BatchOptions.shrink`: each further slot size compiles its own loops); `head_apart`: as
  `Engine`'s."""
  target, drafter = models
  return Engine(target, drafter=drafter,
                shapes=ShapeOptions(max_len=128, length_buckets=(16, 32, 64), block_sizes=(1, 4)),
                loop=LoopOptions(controller=controller, **loop),
                batching=BatchOptions(batch_size=batch_size, sync_cycles=sync_cycles,
                                      shrink=shrink, move_plain_after=move_plain_after),
                head_apart=head_apart)


def toy_ar_outputs(models, num: int) -> list[list[int]]:
  """Plain AR outputs of `toy_requests(num)` on `models`: the reference the loops must equal."""
  eng = toy_engine(models, "none")
  prompts, max_news = toy_requests(num)
  return [eng.generate(p, max_new_tokens=m).output_ids for p, m in zip(prompts, max_news)]


def assert_sampled_like_ar(models, eng: Engine, block_size: int = 4) -> None:
  """At T=1 (top_k 20) `eng`'s spec loop of `block_size` gives, for each seed, AR's tokens on
  `toy_requests(4, seed=1)` (a verify rule that keeps the target's draw: `exact`)."""
  ar = Engine(models[0], shapes=ShapeOptions(max_len=128, length_buckets=(16, 32, 64)))
  prompts, max_news = toy_requests(4, seed=1)
  kw = dict(temperature=1.0, top_k=20)
  for i, (p, m) in enumerate(zip(prompts, max_news)):
    want = ar.generate(p, max_new_tokens=m, seed=7 + i, **kw).output_ids
    got = eng.generate(p, max_new_tokens=m, block_size=block_size, seed=7 + i, **kw).output_ids
    assert got == want, f"request {i}"


def assert_one_spec_loop(eng: Engine, block_size: int = 4) -> None:
  """Requests of every length decode through one compiled spec loop of `block_size`: a second
  pass over them compiles nothing."""
  prompts, max_news = toy_requests(5, seed=3)
  for p, m in zip(prompts, max_news):
    eng.generate(p, max_new_tokens=m, block_size=block_size)
  with BackendCompiles() as compiles:
    for p, m in zip(prompts, max_news):
      eng.generate(p, max_new_tokens=m, block_size=block_size)
  assert compiles.n == 0
  assert eng.compiled.counts["spec_loop"] == 1
