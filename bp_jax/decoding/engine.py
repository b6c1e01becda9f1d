"""Host-side driver: pads prompts to buckets, runs the compiled prefill and decode loop of a
request, trims at stop tokens and reports timings and acceptance statistics.

The model states are split once (`nnx.split`); every jitted function merges them inside. The
target (and drafter) caches live on the engine and are donated through prefill and the loop, so a
request reuses the previous request's buffers: entries past the pointer are never read.

Block size per request: a fixed bucket, or `block_size=LEARNED`: the engine's block-size policy
(`set_policy`) runs inside the prefill jit on the prefill's own features and returns a class;
the host runs the compiled loop of that class's bucket. The prefill with a policy is compiled
once per (length bucket, policy architecture); no request compiles anything new.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bp_jax.decoding import loops as decode_loops
from bp_jax.decoding.buckets import default_length_buckets, pick_bucket
from bp_jax.decoding.compiled import CompiledCache
from bp_jax.errors import BadInputError
from bp_jax.models.qwen3 import Qwen3

LEARNED = "learned"  # `generate(block_size=LEARNED)`: the policy chooses the bucket


@dataclasses.dataclass
class Generation:
  """One request's result."""
  output_ids: list[int]            # new tokens only, trimmed after the first stop token
  prefill_s: float
  decode_s: float
  block_size: int
  acceptance_lengths: list[int]    # committed tokens per target forward in the loop
  prompt_len: int
  policy_probs: list[float] | None = None  # the policy's class probabilities (block_size=LEARNED)
  features: dict[str, np.ndarray] | None = None  # prefill features [F] (return_features=True)

  @property
  def new_tokens(self) -> int:
    return len(self.output_ids)

  @property
  def target_forwards(self) -> int:
    return len(self.acceptance_lengths)

  @property
  def tau(self) -> float:
    a = self.acceptance_lengths
    return float(np.mean(a)) if a else 0.0


def trim_at_stop(ids: Sequence[int], stop_ids: Sequence[int], max_new: int) -> list[int]:
  """First `max_new` ids, cut just after the first stop token."""
  out = []
  for t in list(ids)[:max_new]:
    out.append(int(t))
    if t in stop_ids:
      break
  return out


DEFAULT_BLOCK_SIZES = tuple(range(2, 33))


class Engine:
  """Decodes requests one at a time: block_size 1 is plain AR decoding with the target; block
  sizes > 1 are speculative cycles with the DFlash drafter (one compiled loop per block size)."""

  def __init__(self, target: Qwen3, *, max_len: int, stop_ids: Sequence[int] = (),
               length_buckets: Sequence[int] | None = None, drafter=None,
               block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES, policy=None,
               policy_sizes: Sequence[int] = (), scan_layers: bool = False,
               ar_fallback: int = 0, ar_fallback_accept: int = 1):
    if max_len > target.cfg.max_position_embeddings:
      raise BadInputError(f"--config.max_len={max_len} exceeds the model's "
                          f"max_position_embeddings={target.cfg.max_position_embeddings}")
    self.cfg = target.cfg
    self.max_len = max_len
    self.scan_layers = bool(scan_layers)  # decode loops: lax.scan over layers, or unrolled
    if ar_fallback < 0 or ar_fallback_accept < 0:
      raise BadInputError(f"--config.ar_fallback={ar_fallback} and --config.ar_fallback_accept="
                          f"{ar_fallback_accept} must be >= 0")
    # Speculative loops: AR steps after poor cycles (`decode_loops.make_spec_loop`); 0 = off.
    self.ar_fallback, self.ar_fallback_accept = int(ar_fallback), int(ar_fallback_accept)
    self.length_buckets = tuple(sorted(length_buckets or default_length_buckets(max_len)))
    if self.length_buckets[-1] > max_len:
      raise BadInputError(f"length bucket {self.length_buckets[-1]} exceeds "
                          f"--config.max_len={max_len}")
    self.stop_ids = list(stop_ids)
    self._stop_arr = jnp.asarray(self.stop_ids or [-1], jnp.int32)
    self.t_graph, self.t_state = nnx.split(target)
    self.cache = target.init_cache(1, max_len)
    self.block_sizes = tuple(sorted(set(block_sizes)))
    self.drafter = drafter
    if drafter is not None:
      drafter.validate_against_target(target.cfg, "drafter")
      self.d_graph, self.d_state = nnx.split(drafter)
      self.draft_cache = drafter.init_cache(1, max_len)
    else:
      self.d_graph = self.d_state = self.draft_cache = None
    self.forced_seq = jnp.zeros((1, max_len), jnp.int32)
    self.seq = jnp.zeros((1, max_len), jnp.int32)
    self.compiled = CompiledCache()
    self.warmup_seconds: dict[int, float] = {}  # block size -> its loop's untimed first run
    self.p_graph = self.p_state = self.policy_key = None
    self.policy_sizes: tuple[int, ...] = ()
    if policy is not None:
      self.set_policy(policy, policy_sizes)

  def set_policy(self, policy, block_sizes: Sequence[int]) -> None:
    """Makes `policy` (a `bp_jax.policy.mlp.BlockPolicy`) choose the bucket of LEARNED requests;
    class i decodes with `block_sizes[i]`, which must all be buckets of this engine."""
    from bp_jax.policy.features import DRAFT_CONFIDENCE, POOLED_LAYERS

    sizes = tuple(int(b) for b in block_sizes)
    arch = policy.arch
    if len(sizes) != arch.num_classes:
      raise BadInputError(f"the policy has {arch.num_classes} classes but {len(sizes)} block "
                          f"sizes were given ({list(sizes)})")
    for b in sizes:
      self.check_block_size(b)
    if arch.feature_type in (POOLED_LAYERS, DRAFT_CONFIDENCE) and self.drafter is None:
      raise BadInputError(f"a policy over '{arch.feature_type}' needs the drafter; "
                          "give a drafter (--config.drafter)")
    want = self._feature_dims().get(arch.feature_type)
    if want != arch.input_dim:
      raise BadInputError(f"the policy reads {arch.input_dim} '{arch.feature_type}' features but "
                          f"this target/drafter gives {want}: it was trained for another model")
    self.p_graph, self.p_state = nnx.split(policy)
    self.policy_key, self.policy_sizes = arch.signature, sizes

  def _feature_dims(self) -> dict[str, int]:
    from bp_jax.policy.features import feature_dims

    d = self.drafter
    return feature_dims(self.cfg.vocab_size, self.cfg.hidden_size,
                        0 if d is None else len(d.cfg.target_layer_ids),
                        0 if d is None else d.cfg.block_size)

  # -- checks -------------------------------------------------------------------------------
  def check_block_size(self, block_size: int):
    if block_size == 1:
      return
    if self.drafter is None:
      raise BadInputError(f"block_size={block_size} needs a drafter (--config.drafter); "
                          "without one only block_size=1 (mode=ar) is possible")
    if block_size not in self.block_sizes:
      raise BadInputError(f"block_size={block_size} is not one of the configured buckets "
                          f"{list(self.block_sizes)} (--config.block_size / --config.block_sizes)")

  def check_request(self, prompt_len: int, max_new_tokens: int, block_size: int = 1):
    self.check_block_size(block_size)
    if max_new_tokens < 1:
      raise BadInputError(f"--config.max_new_tokens={max_new_tokens} must be >= 1")
    if prompt_len < 1:
      raise BadInputError("empty prompt: at least one token is needed")
    need = prompt_len + max_new_tokens + block_size - 1
    if need > self.max_len:
      raise BadInputError(
          f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} + block_size-1="
          f"{block_size - 1} needs {need} cache slots, more than --config.max_len={self.max_len}")

  # -- compiled pieces ----------------------------------------------------------------------
  # Each returns (compiled function, its arguments); compiling happens here, outside timings.
  def _prefill(self, tokens_1P, n, seed_key, temperature, with_policy: bool = False):
    key = ("prefill", tokens_1P.shape[1]) + ((self.policy_key,) if with_policy else ())
    args = (self.t_state, self.d_state, tokens_1P, n, self.cache, self.draft_cache, seed_key,
            temperature) + ((self.p_state,) if with_policy else ())
    p_graph = self.p_graph if with_policy else None
    fn = self.compiled.get(
        key, lambda: decode_loops.make_prefill(self.t_graph, self.d_graph, p_graph), args,
        donate_argnums=(4, 5))
    return fn, args

  def _loop(self, pre, n, max_new, temperature, seed_key, block_size, use_forced):
    if block_size == 1:
      args = (self.t_state, self.seq, self.cache, pre.first_tok, n, max_new, temperature,
              seed_key, self._stop_arr)
      fn = self.compiled.get(
          ("ar_loop", 1), lambda: decode_loops.make_ar_loop(self.t_graph, self.scan_layers), args,
          donate_argnums=(1, 2))
      return fn, args
    args = (self.t_state, self.d_state, self.seq, self.cache, self.draft_cache, pre.first_tok, n,
            max_new, temperature, seed_key, self._stop_arr, self.forced_seq, use_forced)
    fn = self.compiled.get(
        ("spec_loop", block_size),
        lambda: decode_loops.make_spec_loop(self.t_graph, self.d_graph, block_size,
                                            self.scan_layers, self.ar_fallback,
                                            self.ar_fallback_accept), args,
        donate_argnums=(2, 3, 4))
    return fn, args

  def _warm_loop(self, pre, n, max_new, temperature, seed_key, block_size, use_forced) -> None:
    """Runs a block size's compiled loop once, untimed, on copies of this request's buffers and
    at most 16 new tokens, the first time the size is used (arguments as `_loop`'s). An
    XLA:CPU executable's first run costs ~75 ms more than later ones (measured on the demo);
    that belongs with compile time (`warmup_seconds`), not in a request's decode time."""
    if block_size in self.warmup_seconds:
      return
    t0 = time.perf_counter()
    fn, args = self._loop(pre, n, jnp.minimum(max_new, 16), temperature, seed_key, block_size,
                          use_forced)
    # The loop donates its buffers: run it on copies so that the request's own survive.
    jax.block_until_ready(fn(*jax.tree.map(jnp.copy, args)))
    self.warmup_seconds[block_size] = time.perf_counter() - t0

  def precompile(self, block_sizes: Sequence[int], length_buckets: Sequence[int] | None = None,
                 policy: bool = False, plain_prefill: bool = True) -> dict:
    """Compiles prefill for each length bucket and the loop of each block size ahead of time
    (`policy`: also the prefill that runs the policy; `plain_prefill`: the one without)."""
    key, z, f = jax.random.key(0), jnp.int32(1), jnp.float32(0)
    if policy and self.p_graph is None:
      raise BadInputError("precompile(policy=True) on an engine without a policy")
    for P in length_buckets or self.length_buckets:
      if plain_prefill:
        self._prefill(jnp.zeros((1, P), jnp.int32), z, key, f)
      if policy:
        self._prefill(jnp.zeros((1, P), jnp.int32), z, key, f, with_policy=True)
    pre = decode_loops.PrefillOut(z, self.cache, self.draft_cache, None, None)
    for b in block_sizes:
      self.check_block_size(b)
      self._loop(pre, z, z, f, key, b, jnp.bool_(False))
    return self.compiled.summary()

  # -- public -------------------------------------------------------------------------------
  def encode_padded(self, prompt_ids: Sequence[int]) -> tuple[jax.Array, int]:
    n = len(prompt_ids)
    P = pick_bucket(n, self.length_buckets, flag="--config.max_len / --config.length_buckets")
    toks = np.zeros((1, P), np.int32)
    toks[0, :n] = prompt_ids
    return jnp.asarray(toks), P

  def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, block_size: int | str = 1,
               forced_continuation: Sequence[int] | None = None,
               return_features: bool = False) -> Generation:
    """Decodes one request with a fixed bucket `block_size`, or with the bucket the engine's
    policy picks from the prefill (`block_size=LEARNED`).

    `forced_continuation` (tests, benchmarks): tokens the perfect drafter proposes after the
    prompt, e.g. the target's own greedy output. `return_features`: copy the prefill's policy
    features to the host (`Generation.features`). The reported prefill time includes the
    policy and reading its choice back to the host.
    """
    n = len(prompt_ids)
    learned = isinstance(block_size, str)
    if learned:
      if block_size != LEARNED:
        raise BadInputError(f"block_size={block_size!r}: give an integer bucket or {LEARNED!r}")
      if self.p_graph is None:
        raise BadInputError("block_size='learned' needs a block-size policy "
                            "(--config.policy with --config.block_policy=learned)")
      self.check_request(n, max_new_tokens, max(self.policy_sizes))
    else:
      self.check_request(n, max_new_tokens, block_size)
    if max(prompt_ids) >= self.cfg.vocab_size or min(prompt_ids) < 0:
      raise BadInputError(f"prompt token id out of range for vocab_size={self.cfg.vocab_size}")
    toks, _ = self.encode_padded(prompt_ids)
    n_arr, temp = jnp.int32(n), jnp.float32(temperature)
    seed_key = jax.random.key(seed)
    fn, args = self._prefill(toks, n_arr, seed_key, temp, with_policy=learned)
    t0 = time.perf_counter()
    pre = fn(*args)
    probs = None
    if learned:
      block_size = self.policy_sizes[int(pre.policy_class)]
    pre.first_tok.block_until_ready()
    t1 = time.perf_counter()
    if learned:
      probs = [round(float(p), 6) for p in np.asarray(pre.policy_probs)]
    features = ({k: np.asarray(v[0]) for k, v in pre.features.items()} if return_features
                else None)
    self.cache, self.draft_cache = pre.cache, pre.draft_cache
    use_forced = forced_continuation is not None
    if use_forced:
      forced = np.zeros((1, self.max_len), np.int32)
      cont = list(forced_continuation)[:self.max_len - n]
      forced[0, n:n + len(cont)] = cont
      self.forced_seq = jnp.asarray(forced)
    loop_args = (pre, n_arr, jnp.int32(max_new_tokens), temp, seed_key, block_size,
                 jnp.bool_(use_forced))
    self._warm_loop(*loop_args)
    fn, args = self._loop(*loop_args)
    t2 = time.perf_counter()
    out = fn(*args)
    n_gen = int(out.n_gen)
    t3 = time.perf_counter()
    self.seq, self.cache = out.seq, out.cache
    if out.draft_cache is not None:
      self.draft_cache = out.draft_cache
    seq = np.asarray(out.seq[0])
    ids = trim_at_stop(seq[n:n + n_gen], self.stop_ids, max_new_tokens)
    accept = np.asarray(out.accept_lens[:int(out.cycles)]).tolist()
    return Generation(ids, t1 - t0, t3 - t2, block_size, accept, n, probs, features)
