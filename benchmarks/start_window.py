"""How often a batch's start rule would send the next batch plain, by how many recent requests
it counts (`StartBackoff.window`), where drafting clearly wins.

Static batches of `--batch_size` requests start together, each drawing its cycles' acceptance
from the simulated profile of `--sim_tau` (the accelerator benchmarks' forced drafts,
`benchmarks/accelerator.stretched_profile`), `--max_new_tokens` each (a request's last cycle
commits what is left). They finish in the order of their cycles, and the rule
(`StartBackoff.batch_plain_now`, the plain loop not timed yet: plain unless τ is at least
`start_backoff.DECISIVE` x the price) then weighs the last `window` to finish against each of
`--prices`. A window smaller than the batch holds its slowest requests: on an H200 at Qwen3-4B
shapes a batch of 16 started plain (deep, in the benchmark's speculative loop: 64 AR steps)
at τ 6.4 against a price of 2.79.

  python -m benchmarks.start_window --batch_size 16 --windows 8,16 --prices 2.5,2.79,2.92
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from benchmarks import accelerator
from bp_jax.decoding.start_backoff import DECISIVE, StartBackoff
from bp_jax.errors import BadInputError


def define_flags() -> None:
  """The command line's flags (defined when run as a program, so that tests can import
  `plain_shares` beside other benchmarks' flags)."""
  flags.DEFINE_integer("batch_size", 16, "requests per static batch")
  flags.DEFINE_float("sim_tau", 6.5, "mean committed tokens per cycle of the simulated profile at "
                     "--block_size")
  flags.DEFINE_integer("block_size", 16, "tokens per cycle at most (drafts + 1)")
  flags.DEFINE_integer("max_new_tokens", 128, "new tokens per request")
  flags.DEFINE_string("windows", "8,16", "comma-separated numbers of recent requests the rule "
                      "counts")
  flags.DEFINE_string("prices", "2.5,2.79,2.92", "comma-separated prices of a cycle (AR steps) to "
                      "weigh the recent τ against")
  flags.DEFINE_integer("trials", 2000, "batches simulated")
  flags.DEFINE_integer("seed", 1, "random seed of the acceptance draws")


FLAGS = flags.FLAGS


def _numbers(text: str, flag: str, kind=float) -> list:
  try:
    values = [kind(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise BadInputError(f"--{flag}={text!r}: expected comma-separated numbers") from None
  if not values or min(values) <= 0:
    raise BadInputError(f"--{flag}={text!r}: expected positive numbers")
  return values


def request(probs: np.ndarray, rng: np.random.Generator, max_new: int) -> list[int]:
  """One request's committed tokens per cycle."""
  out, left = [], max_new
  while left > 0:
    out.append(min(int(rng.choice(len(probs), p=probs)) + 1, left))
    left -= out[-1]
  return out


def plain_shares(batch: int, windows: list[int], prices: list[float], trials: int,
                 probs: np.ndarray, max_new: int, seed: int) -> dict:
  """Per window: the mean recent τ at a batch's end and, per price, the share of batches after
  which the rule would start the next request plain."""
  rng = np.random.default_rng(seed)
  taus = {w: [] for w in windows}
  plain = {w: {p: 0 for p in prices} for w in windows}
  for _ in range(trials):
    finished = sorted((request(probs, rng, max_new) for _ in range(batch)), key=len)
    for w in windows:
      starts = StartBackoff(window=w, batch_plain=True)
      for acceptance in finished:
        starts.observe(acceptance)
      taus[w].append(starts.tau())
      for p in prices:
        plain[w][p] += starts.batch_plain_now(p, plain_priced=False)
  return {w: {"tau": float(np.mean(taus[w])), "tau_p5": float(np.percentile(taus[w], 5)),
              "plain": {p: plain[w][p] / trials for p in prices}} for w in windows}


def main(argv):
  del argv
  windows = _numbers(FLAGS.windows, "windows", int)
  prices = _numbers(FLAGS.prices, "prices")
  if FLAGS.batch_size < 1 or FLAGS.trials < 1 or FLAGS.max_new_tokens < 1:
    raise BadInputError("--batch_size, --trials and --max_new_tokens must be >= 1")
  probs = accelerator.stretched_profile(accelerator.demo_survival(), FLAGS.sim_tau,
                                        FLAGS.block_size)
  result = plain_shares(FLAGS.batch_size, windows, prices, FLAGS.trials, probs,
                        FLAGS.max_new_tokens, FLAGS.seed)
  print(f"  static batches of {FLAGS.batch_size}, simulated τ {FLAGS.sim_tau} at b = "
        f"{FLAGS.block_size}, {FLAGS.max_new_tokens} new tokens, {FLAGS.trials} batches; the "
        f"next request plain where τ < {DECISIVE:g} x the price (plain loop not timed)")
  print(f"  {'window':>7}{'mean τ':>8}{'5th pct':>9}" +
        "".join(f"{'plain @' + format(p, 'g'):>12}" for p in prices))
  for w, r in result.items():
    print(f"  {w:>7}{r['tau']:>8.2f}{r['tau_p5']:>9.2f}" +
          "".join(f"{r['plain'][p]:>12.1%}" for p in prices))


if __name__ == "__main__":
  define_flags()
  app.run(main)
