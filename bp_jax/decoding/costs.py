"""The confidence controller's prices, measured where the engine runs (`controller` reads them).

The controller picks, per cycle, how many drafts to verify by expected committed tokens per unit
cost; the costs are the relative prices of one target forward over 1, 2, 4, ... tokens and of one
drafter pass, in AR steps (a forward over one token). They depend on the machine by an order of
magnitude (on an accelerator a forward over 8 tokens costs about what one over 1 token does; on
a CPU several times more), so they are measured on the engine's own shapes, not shipped:

  measure_forward_costs  jitted target forwards over each verify length the controller may
                         choose (`verify_lengths`) and one drafter pass, on the engine's batch
                         size, block size and cache length (a mid-cache position); each timed
                         as a jitted loop of `reps` forwards, the median of `repeats` rounds
                         in which the forwards take turns (a few seconds at demo size);
  forward_costs          the same, cached per machine (`machine_fingerprint`: CPU model,
                         generation, cache and feature flags, devices), model weights
                         (`models.fingerprint`), the timed code (`code_fingerprint`),
                         shapes and dtype in
                         `$XDG_CACHE_HOME/bp_jax/costs/` (written atomically; cache_dir="" = no
                         cache);
  measure_ar_step        the target alone over one and over two tokens per row: whether an AR
                         step runs faster as a two-token forward (`LoopOptions.ar_step_tokens`),
                         for an engine that prices nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from typing import Any, Sequence

import numpy as np

from bp_jax.decoding import controller as control

FORMAT = 3  # 2: one_row_s; 3: the target timed with its fused projections (`Qwen3.loop_layers`)
DEFAULT = "default"  # cost_cache value meaning default_dir()


# /proc/cpuinfo fields that tell two CPUs apart where "model name" does not (a cloud VM may
# report "AMD EPYC" for parts of different generations, whose small matmuls cost differently:
# a cache made on one priced the other's cycles 1.3x too dear).
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "cache size")


def _cpu_info() -> dict[str, str]:
  """The first processor's `_CPU_FIELDS` and a digest of its feature flags (e.g. AVX-512)."""
  info: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          break  # the first processor's block only
        name, _, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if name in _CPU_FIELDS:
          info[name] = value
        elif name == "flags":
          info["flags"] = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
  except OSError:
    pass
  return info


def machine_fingerprint() -> dict[str, Any]:
  """What makes two machines price a step alike: CPU model, generation, cache and features
  (`_cpu_info`), CPU count, JAX backend and devices."""
  import jax

  devices = jax.devices()
  cpu = _cpu_info()
  return {"cpu": cpu.get("model name") or platform.processor() or "unknown",
          "cpu_id": "/".join(cpu.get(k, "?") for k in ("vendor_id", "cpu family", "model",
                                                         "stepping")),
          "cpu_cache": cpu.get("cache size", "?"), "cpu_flags": cpu.get("flags", "?"),
          "cpu_count": os.cpu_count(), "machine": platform.machine(),
          "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": f"{len(devices)} x {devices[0].device_kind}"}


def code_fingerprint(files: Sequence[str] | None = None) -> str:
  """SHA-256 (16 hex digits) of the source files whose code the timed forwards run (None: this
  module, the controller's and the models' files, read once per process: the code it imported).
  A cached entry timed by other code is measured again: the target's fused projections made its
  AR step cheaper, and an entry timed before them, read from the cache after, priced one
  request's cycles at 2.66 AR steps where the loop's own calls fitted 4.89
  (docs/results/controller.md, 2026-11-29)."""
  if files is None:
    return _loaded_code_fingerprint()
  digest = hashlib.sha256()
  for path in files:
    with open(path, "rb") as f:
      digest.update(os.path.basename(path).encode() + b"\0" + f.read())
  return digest.hexdigest()[:16]


@functools.cache
def _loaded_code_fingerprint() -> str:
  from bp_jax.models import layers
  models = os.path.dirname(os.path.abspath(layers.__file__))
  return code_fingerprint([os.path.abspath(__file__), os.path.abspath(control.__file__)] + sorted(
      os.path.join(models, f) for f in os.listdir(models) if f.endswith(".py")))


def verify_lengths(block_size: int) -> tuple[int, ...]:
  """The target forward lengths (k + 1 tokens) a cycle of `block_size` may verify
  (`controller.verify_buckets`): the powers of two up to block_size, and block_size."""
  return tuple(k + 1 for k in control.verify_buckets(block_size))


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
  """Measured seconds: `verify_s[i]` one target forward over `verify_lengths(block_size)[i]`
  tokens, `draft_s` one drafter pass over a block, both over `batch_size` rows."""
  verify_s: tuple[float, ...]
  draft_s: float
  batch_size: int
  block_size: int
  one_row_s: float | None = None  # a one-token forward over one row (None: not measured)
  # (block, seconds) of drafter passes over other (smaller) blocks: what sizes below
  # `block_size` pay for their drafts (`draft_steps_at`); () where none was timed.
  draft_by_block: tuple[tuple[int, float], ...] = ()

  @property
  def lengths(self) -> tuple[int, ...]:
    return verify_lengths(self.block_size)

  def relative(self) -> tuple[tuple[float, ...], float]:
    """(the cost table of forwards over 1, 2, 4, ... tokens, one drafter pass) in AR steps: what
    `LoopOptions.controller_costs` / `controller_draft_cost` take. From two tokens on, a longer
    forward is never priced below a shorter one (timing noise). The one-token forward, the AR
    step and the unit, is kept as measured even where it is dearer than longer ones: on an
    H200 at Qwen3-4B shapes it was (5.39 ms against 3.32-3.64 ms over 2-16 tokens; the one-row
    products run other kernels), and raising those to one AR step priced a 16-token cycle at
    1.14 AR steps, not 0.81: its cycles that accepted no draft counted as misses and backed
    off into AR steps that cost more than the cycles would have (docs/results/accelerator.md).
    A block size that is not a power of two adds the next power of two, extrapolated so that
    the table reads the measured cost at block_size."""
    ar = self.verify_s[0]
    rel = np.asarray(self.verify_s, np.float64) / ar
    rel[1:] = np.maximum.accumulate(rel[1:])
    table = [float(c) for n, c in zip(self.lengths, rel) if n & (n - 1) == 0]
    last = self.lengths[-1]
    if last & (last - 1):  # not a power of two: extend to 2P through (P, c_P) and (last, c)
      p = 1 << (last.bit_length() - 1)
      table.append(table[-1] + (float(rel[-1]) - table[-1]) * p / (last - p))
    return tuple(round(c, 4) for c in table), round(self.draft_s / ar, 4)

  def draft_steps_at(self, block: int) -> float:
    """A drafter pass over a block of `block` positions in AR steps: linear between the blocks
    timed (`block_size`'s and `draft_by_block`'s), held at the nearest beyond them, never below
    a smaller block's. With one block timed, its cost for every block."""
    timed = {int(b): float(t) for b, t in self.draft_by_block}
    points = sorted({**timed, self.block_size: self.draft_s}.items())
    blocks = np.asarray([b for b, _ in points], np.float64)
    secs = np.maximum.accumulate(np.asarray([t for _, t in points], np.float64))
    return float(np.interp(float(block), blocks, secs)) / self.verify_s[0]

  def describe(self) -> str:
    """One line: each forward and the drafter pass in ms and in AR steps."""
    ar = self.verify_s[0]
    lens = "/".join(str(n) for n in self.lengths)
    ms = "/".join(f"{1e3 * s:.3f}" for s in self.verify_s)
    rel = "/".join(f"{s / ar:.2f}" for s in self.verify_s)
    other = "".join(f", over a block of {b} {1e3 * t:.3f} ms ({t / ar:.2f})"
                    for b, t in self.draft_by_block)
    return (f"target forward over {lens} tokens {ms} ms ({rel} AR steps), drafter pass "
            f"{1e3 * self.draft_s:.3f} ms ({self.draft_s / ar:.2f} AR steps){other}; batch "
            f"{self.batch_size}, block {self.block_size}")

  def to_json(self) -> dict[str, Any]:
    return {"verify_s": list(self.verify_s), "draft_s": self.draft_s,
            "batch_size": self.batch_size, "block_size": self.block_size,
            "one_row_s": self.one_row_s,
            "draft_by_block": [[int(b), float(t)] for b, t in self.draft_by_block]}

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> "ForwardCosts":
    one_row = d.get("one_row_s")
    return cls(tuple(float(s) for s in d["verify_s"]), float(d["draft_s"]),
               int(d["batch_size"]), int(d["block_size"]),
               None if one_row is None else float(one_row),
               tuple((int(b), float(t)) for b, t in d.get("draft_by_block", ())))

  def rows_cost(self) -> float | None:
    """A one-token forward over all `batch_size` rows in one-row forwards (None: not measured):
    what a step of a full batch costs against a step of one row. Compute-bound (this CPU) it
    grows with the rows; bandwidth-bound (an accelerator) it stays near 1 (an H200 at
    Qwen3-4B shapes: 16 rows 3.85 ms, one row 5.39 ms, 0.71)."""
    return None if self.one_row_s is None else self.verify_s[0] / self.one_row_s


def _median_seconds(calls: list[tuple], reps: int, repeats: int) -> list[float]:
  """Median seconds per forward of each (jitted loop of `reps` forwards, its arguments) over
  `repeats` rounds, after one untimed run each (compilation); the calls take turns within each
  round, so a burst of load on a shared machine falls on all of them alike."""
  import jax

  for fn, args in calls:
    jax.block_until_ready(fn(*args))
  runs: list[list[float]] = [[] for _ in calls]
  for _ in range(repeats):
    for i, (fn, args) in enumerate(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      runs[i].append(time.perf_counter() - t0)
  return [float(np.median(r)) / reps for r in runs]


def other_draft_blocks(draft_blocks: Sequence[int], block_size: int) -> list[int]:
  """The blocks of `draft_blocks` a measurement at `block_size` times besides its own: each
  once, ascending, between 2 and block_size - 1."""
  return sorted({int(w) for w in draft_blocks if 1 < int(w) < int(block_size)})


def measure_forward_costs(target, drafter, batch_size: int, block_size: int, max_len: int, *,
                          scan_layers: bool = False, reps: int = 16, repeats: int = 7,
                          pos: int | None = None, draft_blocks: Sequence[int] = ()
                          ) -> ForwardCosts:
  """Times the target over each of `verify_lengths(block_size)` tokens and one drafter pass as
  the speculative loop runs them: `batch_size` rows, a cache of `max_len` slots read up to
  `pos` (default: half of it), the drafter's chosen-layer features returned, the layer form of
  `scan_layers`. Each forward runs `reps` times in one jitted `fori_loop` (tokens change per
  iteration so nothing is hoisted; the cache is carried, written in place as in the loops);
  the forwards take turns over `repeats` rounds and each one's median is kept.
  `draft_blocks`: smaller blocks whose drafter pass is timed too (`draft_by_block`; on the
  2-core Xeon a pass over 12 positions of the demo's drafter cost 1.25x one over 8)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  B, b = int(batch_size), int(block_size)
  pos = max(0, min(max_len // 2 if pos is None else int(pos), max_len - b - 1))
  t_graph, t_state = nnx.split(target)
  d_graph, d_state = nnx.split(drafter)
  layer_ids = drafter.cfg.target_layer_ids
  form = (lambda c: c) if scan_layers else (lambda c: c.per_layer())
  cache, draft_cache = form(target.init_cache(B, max_len)), form(drafter.init_cache(B, max_len))
  pos_B = jnp.full((B,), pos, jnp.int32)
  vocab = target.cfg.vocab_size

  verify = _forward_loop(target, t_graph, layer_ids, pos, reps, scan_layers)

  def draft_over(width: int):
    @jax.jit
    def draft(state, d_state, draft_cache):
      model, dr = nnx.merge(t_graph, state), nnx.merge(d_graph, d_state)
      layers = None if scan_layers else dr.loop_layers()  # the form an engine drafts with

      def step(i, acc):
        block = jnp.full((B, width), dr.cfg.mask_token_id, jnp.int32).at[:, 0].set(i % vocab)
        h = dr.draft(model.embed_tokens(block), draft_cache.with_lengths(pos_B), layers)
        logits = model.project_to_vocab(h[:, 1:])
        p = control.drafted_probs(logits, jnp.argmax(logits, -1))
        return acc + jnp.sum(p)
      return jax.lax.fori_loop(0, reps, step, jnp.float32(0))
    return draft

  others = other_draft_blocks(draft_blocks, b)
  calls = [(verify, (t_state, cache, jnp.ones((B, n), jnp.int32))) for n in verify_lengths(b)]
  calls += [(draft_over(w), (t_state, d_state, draft_cache)) for w in [b] + others]
  if B > 1:  # one row's one-token forward: what a batch's tail would save in fewer slots
    calls.append((verify, (t_state, form(target.init_cache(1, max_len)),
                           jnp.ones((1, 1), jnp.int32))))
  seconds = _median_seconds(calls, reps, repeats)
  n, k = len(verify_lengths(b)), len(others)
  return ForwardCosts(tuple(seconds[:n]), seconds[n], B, b,
                      seconds[n + 1 + k] if B > 1 else seconds[0],
                      tuple(zip(others, seconds[n + 1:n + 1 + k])))


def _forward_loop(target, t_graph, layer_ids, pos: int, reps: int, scan_layers: bool):
  """verify(state, cache, tokens_BT) -> a scalar: `reps` target forwards over tokens_BT at
  cache position `pos` in one jitted `fori_loop` (tokens change per iteration so nothing is
  hoisted; the cache is carried, written in place as in the loops), `layer_ids`' features
  returned as the speculative loop asks for them."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  vocab = target.cfg.vocab_size

  @jax.jit
  def verify(state, cache, tokens_BT):
    model = nnx.merge(t_graph, state)
    # the target's per-layer weights in the form an engine decodes with (`Engine._loop_weights`)
    layers = None if scan_layers else model.loop_layers()

    def step(i, carry):
      acc, cache = carry
      at_B = jnp.full((tokens_BT.shape[0],), pos, jnp.int32)
      out = model((tokens_BT + i) % vocab, cache.with_lengths(at_B), layer_ids, layers=layers)
      acc = acc + out.logits[0, -1, 0].astype(jnp.float32)
      if layer_ids:
        acc = acc + out.layer_hiddens[0][0, 0, 0].astype(jnp.float32)
      return acc, out.cache
    return jax.lax.fori_loop(0, reps, step, (jnp.float32(0), cache))[0]

  return verify


def measure_ar_step(target, batch_size: int, max_len: int, *, scan_layers: bool = False,
                    reps: int = 16, repeats: int = 7) -> tuple[float, float]:
  """(seconds of a target forward over one token per row, over two), `batch_size` rows at
  a mid-cache position, timed as `measure_forward_costs` times its forwards: what an engine that
  prices nothing else needs to know whether its AR steps run faster as two-token forwards
  (an H100 at Qwen3-4B shapes, one row: 6.19 ms against 4.16 ms)."""
  import jax.numpy as jnp
  from flax import nnx

  B = int(batch_size)
  pos = max(0, min(max_len // 2, max_len - 3))
  t_graph, t_state = nnx.split(target)
  form = (lambda c: c) if scan_layers else (lambda c: c.per_layer())
  verify = _forward_loop(target, t_graph, (), pos, reps, scan_layers)
  cache = form(target.init_cache(B, max_len))
  one, two = _median_seconds([(verify, (t_state, cache, jnp.ones((B, n), jnp.int32)))
                              for n in (1, 2)], reps, repeats)
  return one, two


def default_dir() -> str:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "bp_jax", "costs")


def cost_key(target, drafter, batch_size: int, block_size: int, max_len: int,
             scan_layers: bool = False, fingerprints: Sequence[str] | None = None,
             draft_blocks: Sequence[int] = ()) -> dict:
  """The conditions costs were measured under: a cached entry is used only for an equal key."""
  from bp_jax.models.fingerprint import model_fingerprint

  t_fp, d_fp = fingerprints or (model_fingerprint(target), model_fingerprint(drafter))
  return {"format": FORMAT, "machine": machine_fingerprint(), "code": code_fingerprint(),
          "target": str(t_fp), "drafter": str(d_fp), "batch_size": int(batch_size),
          "block_size": int(block_size), "max_len": int(max_len),
          "dtype": str(np.dtype(target.dtype)), "drafter_dtype": str(np.dtype(drafter.dtype)),
          "scan_layers": bool(scan_layers),
          "draft_blocks": other_draft_blocks(draft_blocks, block_size)}


def _path(folder: str, key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
  return os.path.join(folder, f"{digest}.json")


def _read(path: str, key: dict) -> ForwardCosts | None:
  try:
    with open(path, encoding="utf-8") as f:
      entry = json.load(f)
    if entry.get("key") == key:
      return ForwardCosts.from_json(entry["costs"])
  except (OSError, ValueError, KeyError, TypeError):
    pass  # absent, unreadable or of another format: measure again
  return None


def _write(path: str, key: dict, costs: ForwardCosts) -> None:
  """Writes atomically: a temporary file of this process renamed over the entry."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"key": key, "costs": costs.to_json()}, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def forward_costs(target, drafter, batch_size: int, block_size: int, max_len: int, *,
                  scan_layers: bool = False, cache_dir: str | None = None,
                  remeasure: bool = False, fingerprints: Sequence[str] | None = None,
                  draft_blocks: Sequence[int] = (), **measure) -> tuple[ForwardCosts, bool]:
  """(the costs, whether they came from the cache): `measure_forward_costs`, cached per
  `cost_key` in `cache_dir` (None or DEFAULT: `default_dir()`; "": no cache); `remeasure`
  measures and overwrites the entry. `fingerprints`: the (target, drafter) weight
  fingerprints when the caller has them (else hashed here)."""
  folder = default_dir() if cache_dir in (None, DEFAULT) else cache_dir
  path = key = None
  if folder:
    key = cost_key(target, drafter, batch_size, block_size, max_len, scan_layers, fingerprints,
                   draft_blocks)
    path = _path(os.path.abspath(os.path.expanduser(folder)), key)
    if not remeasure:
      hit = _read(path, key)
      if hit is not None:
        return hit, True
  costs = measure_forward_costs(target, drafter, batch_size, block_size, max_len,
                                scan_layers=scan_layers, draft_blocks=draft_blocks, **measure)
  if path is not None:
    _write(path, key, costs)
  return costs, False
