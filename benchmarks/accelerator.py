"""The engine at Qwen3-0.6B/1.7B/4B/8B shapes on whatever JAX backend runs it (GPU, TPU, CPU).

  python -m benchmarks.accelerator --sizes 0.6b,1.7b,4b,8b --out docs/accelerator/<device>

In one process, per model size, interleaved per request in a shuffled order, `--repeats` times:
  * our AR decode at every `--batch_sizes` (batch 1: `Engine.generate`; batch B > 1:
    `Engine.generate_batch`, B requests in one static batch);
  * transformers' `generate` (PyTorch on the same device, same shapes, its own random weights)
    at every `--hf_batch_sizes`, as the peer a user would otherwise run;
  * speculative decoding at every `--block_sizes` (batch 1, the paper's loop: every draft
    verified, no fallback) with (a) perfect drafts: the engine's ceiling, and (b) SIMULATED
    drafts: accepted per cycle as drawn from a fixed acceptance profile whose mean is τ
    `--sim_tau` at b = 16 (the DFlash paper's Qwen3-4B figure, 6.5); the profile's shape is the
    demo drafter's measured per-cycle histogram at b = 16 (`benchmarks/data/
    demo_acceptance_b16.json`, `python -m benchmarks.acceptance_profile`) stretched along the
    draft positions until its mean is τ 6.5. Simulated rows are labelled `sim` everywhere.
Per size also: the time of a drafter pass, of a verify and of an AR step measured alone, and
the rest of a cycle (cycle − drafter pass − verify); the AR step's achieved bandwidth (weight
bytes + live KV bytes ÷ step time) against this device's measured copy bandwidth; compile
time; peak device memory; and, with `--profile`, kernels and device-to-host copies per cycle
counted in a `jax.profiler` trace of one speculative request.

Weights are random bf16, created on the device. The layers' output projections (`o_proj`,
`down_proj`) are scaled by `--residual_scale` so that every position's greedy token is the
current token by a wide margin: the continuation is then unambiguous in bf16 (no near-tie can
flip a draft between shapes), which is what makes "perfect" and "simulated" acceptance exact.
The arithmetic and the bytes moved are those of any weights of these shapes. With tied
embeddings the output projection is the embedding; an untied model gets its own lm_head array
(holding the embedding's values).

Figures, one meaning each: tok/s = new tokens ÷ decode seconds (prefill excluded; for
transformers, generate(N) − generate(1)); τ = committed tokens per speculative cycle; speedup
= tok/s ÷ our AR tok/s at batch 1; a cycle's cost in AR steps = cycle seconds ÷ AR step
seconds. Shapes: the public Hugging Face config.json of each Qwen3 model; drafters: z-lab's
DFlash drafters for Qwen3-4B and Qwen3-8B (block size 16, 5 layers of the target's layer
shape, target layers [1, 9, 17, 25, 33], mask id 151669); z-lab published none for 0.6B and
1.7B, so those drafters follow the same recipe (5 layers of the target's shape, evenly spaced
target layers) and are marked `recipe`.
"""

from __future__ import annotations

import os

# Let PyTorch share the device: JAX would otherwise take 75% of GPU memory at start-up.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bp_jax.decoding.engine import Engine  # noqa: E402
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions  # noqa: E402
from bp_jax.models.config import DFlashConfig, Qwen3Config, default_target_layer_ids  # noqa: E402
from bp_jax.models.dflash import DFlashDrafter  # noqa: E402
from bp_jax.models.qwen3 import Qwen3  # noqa: E402

PROFILE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                            "demo_acceptance_b16.json")

_QWEN3_COMMON = dict(vocab_size=151_936, head_dim=128, num_key_value_heads=8,
                     rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40_960)


@dataclasses.dataclass(frozen=True)
class Shape:
  """A target shape and its drafter's: where each came from."""
  target: dict
  draft_layers: int
  target_layer_ids: tuple[int, ...] | None  # None: DFlash's default spacing
  source: str


SHAPES = {
    "0.6b": Shape(dict(_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
                  5, None, "Qwen/Qwen3-0.6B config.json; drafter: recipe (none published)"),
    "1.7b": Shape(dict(_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
                  5, None, "Qwen/Qwen3-1.7B config.json; drafter: recipe (none published)"),
    "4b": Shape(dict(_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True),
                5, (1, 9, 17, 25, 33), "Qwen/Qwen3-4B config.json; z-lab/Qwen3-4B-DFlash-b16"),
    "8b": Shape(dict(_QWEN3_COMMON, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=False),
                5, (1, 9, 17, 25, 33), "Qwen/Qwen3-8B config.json; z-lab/Qwen3-8B-DFlash-b16"),
    # CPU-sized, for the test suite: the same code path at a shape that runs in seconds.
    "tiny": Shape(dict(vocab_size=512, head_dim=16, num_key_value_heads=2, rms_norm_eps=1e-6,
                       rope_theta=10_000.0, max_position_embeddings=4096, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       tie_word_embeddings=False),
                  2, None, "test shape"),
}
MASK_TOKEN_ID = 151_669  # z-lab DFlash drafters' mask id (tiny: the last id)


@dataclasses.dataclass(frozen=True)
class Options:
  """One benchmark run's settings (the command line's flags, parsed once)."""
  sizes: tuple[str, ...] = ("4b",)
  batch_sizes: tuple[int, ...] = (1, 8, 32)
  hf_batch_sizes: tuple[int, ...] = (1, 8)
  block_sizes: tuple[int, ...] = (8, 16)
  prompt_len: int = 512
  new_tokens: int = 256
  prompts: int = 3           # batch-1 requests per method and repeat
  repeats: int = 2
  sim_tau: float = 6.5       # the simulated profile's mean τ at b = 16
  residual_scale: float = 1e-3
  profile: bool = True       # count kernels / host copies per cycle in a profiler trace
  seed: int = 0


# -- the simulated acceptance profile --------------------------------------------------------

def demo_survival(path: str = PROFILE_FILE) -> np.ndarray:
  """S[j] = P(accepted drafts >= j), j = 0..15, from the demo's measured histogram at b = 16."""
  with open(path) as f:
    counts = np.asarray(json.load(f)["counts"], np.float64)
  if counts.shape != (16,) or counts.sum() <= 0:
    raise ValueError(f"{path}: 'counts' must hold 16 non-negative counts (accepted drafts 0..15)")
  return np.cumsum(counts[::-1])[::-1] / counts.sum()


def stretched_profile(survival: np.ndarray, tau: float, block: int = 16) -> np.ndarray:
  """P(a drafts accepted), a = 0..block-1: the survival curve stretched along the draft
  positions by the factor whose mean committed tokens per cycle is `tau` (bisection)."""
  xs = np.arange(len(survival), dtype=np.float64)

  def probs(stretch: float) -> np.ndarray:
    s = np.interp(np.arange(block, dtype=np.float64) / stretch, xs, survival)
    s[0] = 1.0
    return s - np.append(s[1:], 0.0)

  def mean_tau(stretch: float) -> float:
    return float(np.dot(np.arange(block) + 1, probs(stretch)))

  lo, hi = 1e-3, 1e3
  if not mean_tau(lo) <= tau <= mean_tau(hi):
    raise ValueError(f"--sim_tau={tau} is out of reach at block size {block}")
  for _ in range(100):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if mean_tau(mid) < tau else (lo, mid)
  return probs(hi)


def simulated_continuation(cont: Sequence[int], block: int, probs: np.ndarray, vocab: int,
                           rng: np.random.Generator, tail_from: int | None = None,
                           tail_rng: np.random.Generator | None = None
                           ) -> tuple[list[int], list[int]]:
  """(forced drafts, the accepted drafts per cycle they produce): `cont` (the target's own
  continuation, index 0 = the prefill's token) with one wrong token placed where each cycle's
  drawn acceptance ends; a draw is capped at block - 1 (a b16 drafter's acceptance seen
  through a smaller block). `tail_from` / `tail_rng`: cycles starting at index `tail_from` or
  later draw from `tail_rng` (a continuation run past the requests' last token draws its tail
  apart, so that the draws before it are those of the continuation cut there)."""
  forced, drawn, p = list(cont), [], 0
  while p + 1 < len(cont):
    source = rng if tail_from is None or p < tail_from else tail_rng
    a = min(int(source.choice(len(probs), p=probs)), block - 1)
    drawn.append(a)
    if a < block - 1 and p + 1 + a < len(cont):
      forced[p + 1 + a] = (cont[p + 1 + a] + 1) % vocab
    p += a + 1
  return forced, drawn


# -- models ----------------------------------------------------------------------------------

def build_models(shape: Shape, residual_scale: float, seed: int) -> tuple[Qwen3, DFlashDrafter]:
  """Random bf16 target and drafter, created on the default device (see the module doc)."""
  cfg = Qwen3Config(**shape.target)
  target = Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
  for name in ("o_proj", "down_proj"):
    p = getattr(target.layers, name)
    p[...] = (p[...] * residual_scale).astype(jnp.bfloat16)
  if not cfg.tie_word_embeddings:
    target.lm_head[...] = target.embed[...].T
  ids = shape.target_layer_ids or default_target_layer_ids(cfg.num_hidden_layers,
                                                           shape.draft_layers)
  dcfg = DFlashConfig(layers=dataclasses.replace(cfg, num_hidden_layers=shape.draft_layers),
                      block_size=16, num_target_layers=cfg.num_hidden_layers,
                      mask_token_id=min(MASK_TOKEN_ID, cfg.vocab_size - 1),
                      target_layer_ids=tuple(ids))
  drafter = DFlashDrafter(dcfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed + 1))
  return target, drafter


def param_bytes(module) -> int:
  return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(module, nnx.Param))))


def ar_step_bytes(target: Qwen3, live_tokens: float) -> dict:
  """Bytes an AR step must move at batch 1: every weight it reads (all of them, except the
  embedding table of an untied model, of which one row is read) and the live KV entries."""
  cfg = target.cfg
  weights = param_bytes(target)
  if not cfg.tie_word_embeddings:
    weights -= int(target.embed[...].nbytes)
  kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
  return {"weight_bytes": weights, "kv_bytes": int(kv_per_token * live_tokens)}


# -- device ceilings ---------------------------------------------------------------------------

def _median_seconds(fn: Callable, *args, reps: int = 20) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def copy_bandwidth(n_bytes: int) -> float:
  """Bytes per second of a device-to-device copy (bytes read + bytes written), measured."""
  x = jax.random.normal(jax.random.key(1), (n_bytes // 4,), jnp.float32)
  secs = _median_seconds(jax.jit(lambda v: v * 1.0001), x, reps=10)
  return 2 * x.nbytes / secs


# -- one forward alone -----------------------------------------------------------------------

def forward_costs(target: Qwen3, drafter: DFlashDrafter, max_len: int, at: int,
                  blocks: Sequence[int]) -> dict:
  """Median seconds of an AR step, of a verify of b tokens and of a drafter pass of block b,
  each alone (one jitted call, batch 1, context at position `at`, unrolled layers and
  per-layer caches as the decode loops run them)."""
  tg, ts = nnx.split(target)
  dg, ds = nnx.split(drafter)
  ids = drafter.cfg.target_layer_ids
  lengths = jnp.asarray([at], jnp.int32)
  cache = target.init_cache(1, max_len).per_layer().with_lengths(lengths)
  dcache = drafter.init_cache(1, max_len).per_layer().with_lengths(lengths)

  @jax.jit
  def verify(ts, toks, cache):
    model = nnx.merge(tg, ts)
    out = model(toks, cache, ids, layers=model.loop_layers())
    return jnp.argmax(out.logits, -1), out.layer_hiddens

  @jax.jit
  def draft(ts, ds, block, dcache):
    model, d = nnx.merge(tg, ts), nnx.merge(dg, ds)
    h = d.draft(model.embed_tokens(block), dcache, d.loop_layers())
    return jnp.argmax(model.project_to_vocab(h[:, 1:]), -1)

  out = {"ar_step_s": _median_seconds(verify, ts, jnp.ones((1, 1), jnp.int32), cache)}
  for b in blocks:
    toks = jnp.ones((1, b), jnp.int32)
    out[f"verify_{b}_s"] = _median_seconds(verify, ts, toks, cache)
    out[f"draft_{b}_s"] = _median_seconds(draft, ts, ds, toks, dcache)
  return out


# -- transformers' generate ----------------------------------------------------------------

class HFPeer:
  """transformers' Qwen3ForCausalLM of the same shape on the same device, random bf16."""

  def __init__(self, shape: Shape, seed: int):
    import torch
    import transformers
    self.torch = torch
    self.device = "cuda" if (jax.default_backend() == "gpu" and torch.cuda.is_available()) \
        else "cpu"
    t = shape.target
    cfg = transformers.Qwen3Config(**{k: t[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "tie_word_embeddings", "max_position_embeddings")})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
      with torch.device(self.device):
        self.model = transformers.Qwen3ForCausalLM(cfg).eval()
    finally:
      torch.set_default_dtype(previous)
    if self.device == "cuda":
      torch.cuda.reset_peak_memory_stats()

  def _generate(self, prompts: np.ndarray, new: int) -> float:
    torch = self.torch
    ids = torch.as_tensor(prompts, device=self.device)
    if self.device == "cuda":
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
      self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    if self.device == "cuda":
      torch.cuda.synchronize()
    return time.perf_counter() - t0

  def decode(self, prompts: np.ndarray, new: int) -> tuple[int, float]:
    """(new tokens, decode seconds = generate(new) − generate(1), i.e. without the prefill)."""
    return prompts.shape[0] * (new - 1), max(
        self._generate(prompts, new) - self._generate(prompts, 1), 1e-9)

  def peak_bytes(self) -> int | None:
    return int(self.torch.cuda.max_memory_allocated()) if self.device == "cuda" else None


# -- the profile of one request --------------------------------------------------------------

def profile_counts(run: Callable[[], int]) -> dict:
  """Device kernels and device-to-host copies in a `jax.profiler` trace of `run()` (which
  returns the cycles it ran), per cycle. Counted from the trace's GPU stream lines; on a
  backend without such lines (CPU) the counts are None."""
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      cycles = run()
    files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(files[0])
  kernels = d2h = 0
  lines = {}
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      events = [e.name for e in line.events]
      lines[f"{plane.name}/{line.name}"] = len(events)
      if not line.name.startswith("Stream"):
        continue
      for name in events:
        low = name.lower()
        if "memcpy" in low or "memset" in low:
          d2h += ("dtoh" in low or "d2h" in low)
        else:
          kernels += 1
  if not any(k.split("/")[-1].startswith("Stream") for k in lines):
    return {"cycles": cycles, "kernels_per_cycle": None, "d2h_copies_per_cycle": None,
            "device_lines": lines}
  return {"cycles": cycles, "kernels_per_cycle": round(kernels / cycles, 1),
          "d2h_copies_per_cycle": round(d2h / cycles, 2), "device_lines": lines}


# -- one size ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Tally:
  """A method's runs: tokens and seconds per run, τ terms, outputs."""
  tokens: list[int] = dataclasses.field(default_factory=list)
  seconds: list[float] = dataclasses.field(default_factory=list)
  cycle_lengths: list[int] = dataclasses.field(default_factory=list)
  drawn: list[int] = dataclasses.field(default_factory=list)

  def add(self, tokens: int, secs: float, cycle_lengths: Sequence[int] = ()) -> None:
    self.tokens.append(int(tokens))
    self.seconds.append(float(secs))
    self.cycle_lengths.extend(int(a) for a in cycle_lengths)

  def summary(self) -> dict:
    rates = [t / s for t, s in zip(self.tokens, self.seconds)]
    out = {"tokens_per_s": sum(self.tokens) / sum(self.seconds), "runs": len(rates),
           "run_tokens_per_s_min": min(rates), "run_tokens_per_s_max": max(rates)}
    if self.cycle_lengths:
      out["tau"] = float(np.mean(self.cycle_lengths))
      out["cycles"] = len(self.cycle_lengths)
      out["s_per_cycle"] = sum(self.seconds) / len(self.cycle_lengths)
    if self.drawn:
      out["tau_drawn"] = float(np.mean(self.drawn)) + 1.0
    return out


def device_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run_size(name: str, opts: Options, profile_probs: np.ndarray, log: Callable) -> dict:
  shape = SHAPES[name]
  P, N = opts.prompt_len, opts.new_tokens
  max_len = P + N + max(opts.block_sizes)
  t0 = time.perf_counter()
  target, drafter = build_models(shape, opts.residual_scale, opts.seed)
  jax.block_until_ready(nnx.state(target))
  build_s = time.perf_counter() - t0
  V = target.cfg.vocab_size
  rng = np.random.default_rng(opts.seed)
  n_batch = max(max(opts.batch_sizes), max(opts.hf_batch_sizes or (1,)), opts.prompts)
  prompts = rng.integers(0, V, (n_batch, P)).astype(np.int32)
  sizes = (1,) + tuple(opts.block_sizes)
  one = Engine(target, drafter=drafter,
               shapes=ShapeOptions(max_len=max_len, block_sizes=sizes, length_buckets=(P,)),
               loop=LoopOptions(controller="none", verify="exact"))
  batched = {B: Engine(target, shapes=ShapeOptions(max_len=max_len, block_sizes=(1,),
                                                   length_buckets=(P,)),
                       batching=BatchOptions(batch_size=B, sync_cycles=0))
             for B in opts.batch_sizes if B > 1}
  hf = HFPeer(shape, opts.seed) if opts.hf_batch_sizes else None
  log(f"[{name}] built in {build_s:.1f} s: target {param_bytes(target) / 2**30:.2f} GiB, "
      f"drafter {param_bytes(drafter) / 2**30:.2f} GiB (bf16)")

  # Warm-up (compiles every program) and the target's own continuations.
  conts = []
  for i in range(opts.prompts):
    g = one.generate(list(prompts[i]), max_new_tokens=N, block_size=1)
    conts.append(g.output_ids)
  if any(len(c) != N for c in conts):
    raise RuntimeError("AR decode stopped early although no stop ids are set")
  forced = {}  # (method, prompt) -> forced continuation, drawn acceptance
  for b in opts.block_sizes:
    for i in range(opts.prompts):
      forced[(f"spec{b}_perfect", i)] = (conts[i], [])
      forced[(f"spec{b}_sim", i)] = simulated_continuation(conts[i], b, profile_probs, V, rng)
  tallies = {m: Tally() for m in ["ar1"] + [f"ar{B}" for B in batched] +
             [f"hf{B}" for B in (opts.hf_batch_sizes if hf else ())] +
             [f"spec{b}_{k}" for b in opts.block_sizes for k in ("perfect", "sim")]}
  lossless = {"checked_requests": 0, "mismatches": 0, "sim_schedule_mismatches": 0}

  def run_one(method: str, i: int) -> None:
    ids = list(prompts[i])
    if method == "ar1":
      g = one.generate(ids, max_new_tokens=N, block_size=1)
      tallies[method].add(g.new_tokens, g.decode_s)
      return
    if method == "hf1":
      tallies[method].add(*hf.decode(prompts[i:i + 1], N))
      return
    b = int(method[4:].split("_")[0])
    cont, drawn = forced[(method, i)]
    g = one.generate(ids, max_new_tokens=N, block_size=b, forced_continuation=cont)
    tallies[method].add(g.new_tokens, g.decode_s, g.acceptance_lengths)
    tallies[method].drawn.extend(drawn)
    lossless["checked_requests"] += 1
    lossless["mismatches"] += int(g.output_ids != conts[i])
    if drawn:  # every cycle but the last (clipped at N) commits exactly its draw + 1
      got = g.acceptance_lengths[:-1]
      lossless["sim_schedule_mismatches"] += int(got != [a + 1 for a in drawn[:len(got)]])

  def run_batch(method: str) -> None:
    B = int(method[2:])
    rows = prompts[:B]
    if method.startswith("hf"):
      tallies[method].add(*hf.decode(rows, N))
      return
    gens = batched[B].generate_batch([list(r) for r in rows], max_new_tokens=N, block_size=1)
    tallies[method].add(sum(g.new_tokens for g in gens), sum(g.decode_s for g in gens))

  per_request = [m for m in tallies if m in ("ar1", "hf1") or m.startswith("spec")]
  jobs = [(m, i) for m in per_request for i in range(opts.prompts)]
  jobs += [(m, None) for m in tallies if m not in per_request]
  for m, i in jobs:  # warm-up pass: compiles, first-run costs, torch's kernels
    run_one(m, i) if i is not None else run_batch(m)
  for t in tallies.values():
    t.__init__()
  lossless.update(checked_requests=0, mismatches=0, sim_schedule_mismatches=0)
  order = random.Random(opts.seed)
  for rep in range(opts.repeats):
    order.shuffle(jobs)
    for m, i in jobs:
      run_one(m, i) if i is not None else run_batch(m)
    log(f"[{name}] repeat {rep + 1}/{opts.repeats} done")

  methods = {m: t.summary() for m, t in tallies.items()}
  ar1 = methods["ar1"]["tokens_per_s"]
  for m, s in methods.items():
    s["speedup_vs_ar1"] = s["tokens_per_s"] / ar1
    if m.startswith("spec"):
      s["simulated"] = m.endswith("_sim")
  ar_step_s = 1.0 / ar1
  costs = forward_costs(target, drafter, max_len, P + N // 2, opts.block_sizes)
  per_forward = {}
  for b in opts.block_sizes:
    cyc = methods[f"spec{b}_perfect"]["s_per_cycle"]
    per_forward[str(b)] = {
        "cycle_s": cyc, "cycle_in_ar_steps": cyc / ar_step_s,
        "draft_s": costs[f"draft_{b}_s"], "verify_s": costs[f"verify_{b}_s"],
        "rest_s": cyc - costs[f"draft_{b}_s"] - costs[f"verify_{b}_s"],
        "verify_in_ar_steps": costs[f"verify_{b}_s"] / costs["ar_step_s"]}
  moved = ar_step_bytes(target, P + N / 2)
  compiled = {"batch1": one.compiled.summary(),
              **{f"batch{B}": e.compiled.summary() for B, e in batched.items()}}
  result = {
      "source": shape.source, "config": shape.target,
      "drafter": {"layers": shape.draft_layers,
                  "target_layer_ids": list(drafter.cfg.target_layer_ids)},
      "target_bytes": param_bytes(target), "drafter_bytes": param_bytes(drafter),
      "build_s": build_s, "methods": methods, "lossless": lossless,
      "ar_step_s_in_loop": ar_step_s, "forward_alone": costs, "per_forward": per_forward,
      "ar_step_bytes": moved,
      "ar_step_bytes_per_s": (moved["weight_bytes"] + moved["kv_bytes"]) / ar_step_s,
      "compile": {name: c["compile_s"] for name, c in compiled.items()},
      "compilations": {name: c["compilations"] for name, c in compiled.items()},
      # programs an engine took from one built before it (not compiled, not in its seconds)
      "shared_programs": {name: c["shared_programs"] for name, c in compiled.items()},
      "peak_device_bytes_jax": device_peak_bytes(),
      "peak_device_bytes_torch": hf.peak_bytes() if hf else None,
  }
  if opts.profile:
    b = max(opts.block_sizes)

    def one_request() -> int:
      g = one.generate(list(prompts[0]), max_new_tokens=N, block_size=b,
                       forced_continuation=conts[0])
      return g.cycles

    def ar_request() -> int:
      return one.generate(list(prompts[0]), max_new_tokens=N, block_size=1).target_forwards

    result["profile"] = {f"spec{b}_perfect": profile_counts(one_request),
                         "ar1 (per step)": profile_counts(ar_request)}
  del one, batched, hf, target, drafter
  return result


# -- reports ---------------------------------------------------------------------------------

# Datasheet HBM bandwidth of the devices this has run on (bytes/s), beside the measured copy.
DATASHEET_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def device_description() -> dict:
  dev = jax.devices()[0]
  sheet = [v for k, v in DATASHEET_BYTES_PER_S.items() if k in dev.device_kind]
  return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
          "datasheet_bytes_per_s": sheet[0] if sheet else None,
          "devices": jax.device_count(), "jax": jax.__version__,
          "host": platform.processor() or platform.machine()}


def markdown(report: dict) -> str:
  d, o = report["device"], report["options"]
  bw = report["copy_bytes_per_s"]
  lines = [f"# The engine at Qwen3 shapes on {d['device_kind']} ({d['backend']})", "",
           f"Measured {report['date']} with `{report['command']}`; jax {d['jax']}. Random bf16 "
           f"weights; {o['prompt_len']}-token prompts, {o['new_tokens']} new tokens, T = 0; "
           f"{o['prompts']} requests x {o['repeats']} repeats per batch-1 method, interleaved. "
           "`sim` rows are SIMULATED drafters (a fixed acceptance profile of mean τ "
           f"{o['sim_tau']} at b = 16, see benchmarks/accelerator.py), not a trained drafter.",
           "", f"Device copy bandwidth (read + write), measured: {bw / 1e12:.2f} TB/s"
           + (f"; datasheet {d['datasheet_bytes_per_s'] / 1e12:.2f} TB/s."
              if d.get("datasheet_bytes_per_s") else "."), ""]
  for name, r in report["sizes"].items():
    m = r["methods"]
    lines += [f"## {name} — {r['source']}", "",
              f"target {r['target_bytes'] / 2**30:.2f} GiB, drafter "
              f"{r['drafter_bytes'] / 2**30:.2f} GiB; AR step at batch 1: "
              f"{r['ar_step_s_in_loop'] * 1e3:.2f} ms, "
              f"{r['ar_step_bytes_per_s'] / 1e12:.2f} TB/s = "
              f"{100 * r['ar_step_bytes_per_s'] / bw:.0f}% of the copy bandwidth"
              + (f", {100 * r['ar_step_bytes_per_s'] / d['datasheet_bytes_per_s']:.0f}% of the "
                 "datasheet's" if d.get("datasheet_bytes_per_s") else "") + "; lossless: "
              f"{r['lossless']['mismatches']} of {r['lossless']['checked_requests']} "
              "speculative outputs differ from AR", "",
              "| method | tok/s | runs min-max | τ | speedup vs our AR b=1 |",
              "|---|---:|---:|---:|---:|"]
    for k, s in m.items():
      tau = f"{s['tau']:.2f}" if "tau" in s else ""
      lines.append(f"| {k}{' (SIMULATED)' if s.get('simulated') else ''} | "
                   f"{s['tokens_per_s']:.1f} | {s['run_tokens_per_s_min']:.1f}-"
                   f"{s['run_tokens_per_s_max']:.1f} | {tau} | {s['speedup_vs_ar1']:.2f}x |")
    lines += ["", "| b | cycle ms | cycle in AR steps | drafter pass ms | verify ms | "
              "verify in AR steps | rest of cycle ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for b, f in r["per_forward"].items():
      lines.append(f"| {b} | {f['cycle_s'] * 1e3:.2f} | {f['cycle_in_ar_steps']:.2f} | "
                   f"{f['draft_s'] * 1e3:.2f} | {f['verify_s'] * 1e3:.2f} | "
                   f"{f['verify_in_ar_steps']:.2f} | {f['rest_s'] * 1e3:.2f} |")
    pk = r["peak_device_bytes_jax"]
    lines += ["", f"compile s: {r['compile']}; compilations: {r['compilations']}; peak device "
              f"memory (JAX, cumulative over sizes run so far): "
              f"{'n/a' if pk is None else f'{pk / 2**30:.1f} GiB'}"]
    for k, p in r.get("profile", {}).items():
      lines.append(f"; profile {k}: {p['kernels_per_cycle']} kernels and "
                   f"{p['d2h_copies_per_cycle']} device-to-host copies per cycle")
    lines.append("")
  return "\n".join(lines) + "\n"


def plots(report: dict, out_dir: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, r in report["sizes"].items():
    for who, prefix in (("ours AR", "ar"), ("transformers", "hf")):
      pts = sorted((int(k[len(prefix):]), s["tokens_per_s"]) for k, s in r["methods"].items()
                   if k.startswith(prefix) and k[len(prefix):].isdigit())
      if pts:
        ax.plot(*zip(*pts), marker="o", ls="-" if prefix == "ar" else "--",
                label=f"{name} {who}")
  ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s",
         title="Decode throughput against batch size")
  ax.legend(fontsize=7)
  paths.append(os.path.join(out_dir, "tok_s_vs_batch.png"))
  fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, r in report["sizes"].items():
    for kind in ("perfect", "sim"):
      pts = sorted((int(k[4:].split("_")[0]), s["speedup_vs_ar1"])
                   for k, s in r["methods"].items() if k.endswith("_" + kind))
      if pts:
        ax.plot(*zip(*pts), marker="o", ls="-" if kind == "perfect" else "--",
                label=f"{name} {'perfect drafts' if kind == 'perfect' else 'SIMULATED τ profile'}")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set(xlabel="block size", ylabel="speedup vs our AR (batch 1)",
         title="Speculative decoding against block size")
  ax.legend(fontsize=7)
  paths.append(os.path.join(out_dir, "speedup_vs_block.png"))
  fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
  plt.close("all")
  return paths


def run(opts: Options, out_dir: str, command: str, log: Callable = print) -> dict:
  """Runs every size of `opts`, writes results.json, results.md and the PNGs to `out_dir`."""
  for name in opts.sizes:
    if name not in SHAPES:
      raise ValueError(f"--sizes: unknown size {name!r} (known: {', '.join(SHAPES)})")
  os.makedirs(out_dir, exist_ok=True)
  probs = stretched_profile(demo_survival(), opts.sim_tau)
  report = {"date": time.strftime("%Y-%m-%d"), "command": command,
            "device": device_description(), "options": dataclasses.asdict(opts),
            "sim_profile": {"accepted_drafts_probs_b16": [round(float(p), 5) for p in probs],
                            "mean_tau_b16": float(np.dot(np.arange(16) + 1, probs)),
                            "shape_from": os.path.relpath(PROFILE_FILE)},
            "copy_bytes_per_s": copy_bandwidth(1 << 30 if jax.default_backend() != "cpu"
                                               else 1 << 24),
            "sizes": {}}
  order = sorted(opts.sizes, key=lambda s: list(SHAPES).index(s))  # ascending sizes (peaks)
  for name in order:
    report["sizes"][name] = run_size(name, opts, probs, log)
    with open(os.path.join(out_dir, "results.json"), "w") as f:  # after each size: partial
      json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
      f.write(markdown(report))
  report["plots"] = plots(report, out_dir)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(report, f, indent=1)
  return report


def main(argv):
  del argv
  from absl import flags
  F = flags.FLAGS
  ints = lambda v: tuple(int(x) for x in v)
  opts = Options(sizes=tuple(F.sizes), batch_sizes=ints(F.batch_sizes),
                 hf_batch_sizes=ints(F.hf_batch_sizes), block_sizes=ints(F.block_sizes),
                 prompt_len=F.prompt_len, new_tokens=F.new_tokens, prompts=F.prompts,
                 repeats=F.repeats, sim_tau=F.sim_tau, residual_scale=F.residual_scale,
                 profile=F.profile, seed=F.seed)
  import sys
  report = run(opts, F.out, "python -m benchmarks.accelerator " + " ".join(sys.argv[1:]),
               log=lambda s: print(s, flush=True))
  print(markdown(report))


if __name__ == "__main__":
  from absl import flags
  from bp_jax import cli
  flags.DEFINE_list("sizes", ["0.6b", "1.7b", "4b", "8b"],
                    f"Model shapes to run ({', '.join(SHAPES)}).")
  flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes of our AR decode.")
  flags.DEFINE_list("hf_batch_sizes", ["1", "8"],
                    "Batch sizes of transformers' generate (empty: skip the peer).")
  flags.DEFINE_list("block_sizes", ["8", "16"], "Speculative block sizes (batch 1).")
  flags.DEFINE_integer("prompt_len", 512, "Prompt length in tokens (random ids).")
  flags.DEFINE_integer("new_tokens", 256, "New tokens per request.")
  flags.DEFINE_integer("prompts", 3, "Batch-1 requests per method and repeat.")
  flags.DEFINE_integer("repeats", 2, "Timed passes over all methods (after one warm-up pass).")
  flags.DEFINE_float("sim_tau", 6.5, "Mean τ at b = 16 of the SIMULATED acceptance profile.")
  flags.DEFINE_float("residual_scale", 1e-3,
                     "Scale of the random o_proj/down_proj weights (an unambiguous greedy "
                     "continuation; see the module doc).")
  flags.DEFINE_bool("profile", True, "Count kernels and host copies per cycle in a trace.")
  flags.DEFINE_integer("seed", 0, "Seed of weights, prompts and the simulated draws.")
  flags.DEFINE_string("out", "out/accelerator", "Folder for results.json, results.md, PNGs.")
  cli.run(main, __doc__)
