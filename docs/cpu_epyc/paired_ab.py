"""The alternated A/B timing the probes here share: two engines decode the same prompts, the
engines taking turns per round (alternating which goes first), round 0 untimed; the ratio of
the first's time per request to the second's, paired by request, with a 95% bootstrap
interval; and the demo's priced default the batch-1 probes compare (`demo_default`), with the
line that says what each engine did in the timed rounds (`timed_summary`)."""

import time
from typing import Callable, Sequence

import numpy as np

from benchmarks.common import demo_prompts
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import LoopOptions, ShapeOptions
from bp_jax.text.tokenizer import load_tokenizer, stop_token_ids
from bp_jax.weights.loading import load_drafter, load_target

# `benchmarks/controllers.py`'s priced_default at its flags' defaults.
PRICED_DEFAULT = dict(controller="priced", ar_fallback=16, priced_cap=64, online_costs=True,
                      start_backoff=True, start_plain=True, ar_fallback_accept=1)


def paired_ratio(decode: dict[str, Callable[[list], object]], prompts: Sequence[list],
                 rounds: int, new_tokens: int) -> str:
  """`decode`: two names, each a function decoding one prompt. Times `rounds` rounds after a
  warm-up one; returns a line with each side's median ms per token and first / second."""
  first, second = decode
  times = {first: [], second: []}
  for r in range(rounds + 1):
    for name in ((first, second) if r % 2 else (second, first)):
      for p in prompts:
        t0 = time.perf_counter()
        decode[name](p)
        if r:
          times[name].append(time.perf_counter() - t0)
  a, b = np.asarray(times[first]), np.asarray(times[second])
  draws = np.random.default_rng(1).integers(0, len(a), (2000, len(a)))
  boot = [np.median(a[i] / b[i]) for i in draws]
  return (f"{second} {1e3 * np.median(b) / new_tokens:.3f} ms/token, {first} "
          f"{1e3 * np.median(a) / new_tokens:.3f} ms/token; {first} / {second} "
          f"{np.median(a / b):.3f} [{np.percentile(boot, 2.5):.3f}, "
          f"{np.percentile(boot, 97.5):.3f}]")


def demo_default(sampled: bool = False, limit: int = 0
                 ) -> tuple[Callable[[], Engine], list[list[int]]]:
  """(build, prompts): a builder of the priced default's engine on the demo pair (float32,
  block sizes 1 and 8, max_len 1024; `sampled`: the sampling drafter and rejection verify),
  each engine it builds measuring its own costs, and HumanEval's evaluation-half prompts (the
  first `limit`; 0: all)."""
  target = decode_form(load_target("demo/target", "float32"))
  drafter = load_drafter("demo/drafter_sampling" if sampled else "demo/drafter", target.cfg,
                         "float32")
  tok = load_tokenizer("demo/target")
  prompts = [ids for _, ids in demo_prompts(tok, "eval", limit=limit)]
  loop = LoopOptions(**PRICED_DEFAULT, verify="rejection" if sampled else "exact")
  build = lambda: Engine(target, drafter=drafter, stop_ids=stop_token_ids(tok),
                         shapes=ShapeOptions(max_len=1024, block_sizes=(1, 8)), loop=loop)
  return build, prompts


def timed_summary(gens: Sequence, num_prompts: int, ar: Sequence[list[int]] | None) -> str:
  """Whether an engine's generations `gens` (warm-up round first, prompt by prompt) all give
  `ar`'s tokens ("-" where None: sampled), and its drafted requests, AR steps and cycles in the
  timed rounds (after the first `num_prompts`)."""
  timed = gens[num_prompts:]
  same = "-" if ar is None else all(list(g.output_ids) == ar[i % num_prompts]
                                    for i, g in enumerate(gens))
  return (f"AR's tokens {same}; timed rounds: {sum(not g.plain_start for g in timed)} of "
          f"{len(timed)} requests drafted, {sum(g.ar_steps for g in timed)} AR steps, "
          f"{sum(g.cycles for g in timed)} cycles")
