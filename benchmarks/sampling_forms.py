"""What a program's sampling form costs (`bp_jax.decoding.sampling.SamplingForm`): greedy
requests decoded by each form's programs on the same engine, weights and prompts, interleaved
per request: GREEDY (what the engine compiles for them), SAMPLED and ANY (what they would run
in a program that serves every setting without branching on it: vmapped, a per-row branch is
a select that computes both sides, so a greedy row pays the draws, and in ANY the top-k /
top-p bisection too).

For the AR loop and the paper's loop (every cycle verifies b-1 drafts: the same cycles in every
form, so only the program differs) it reports, per form: the loop's compile seconds, the
run-time branches (`conditional` instructions) its compiled program holds (on a GPU each
evaluated one is a wait of the host for the device), the decode tokens/s (fastest of the
repeats per request) and GREEDY's speedup over the form, with a 95% paired bootstrap interval
over the prompts. Outputs must be identical in every form. Example (this CPU, the demo):

  python -m benchmarks.sampling_forms --num_prompts 20 --repeats 3 --out docs/sampling_forms
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
from absl import flags
from tqdm import tqdm

from benchmarks import common
from bp_jax import cli
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions, form_key
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.errors import BadInputError
from bp_jax.eval.bootstrap import bootstrap_speedup

flags.DEFINE_integer("bootstrap_reps", 2000, "Bootstrap resamples of the prompts.")
flags.DEFINE_string("out", "", "Folder for sampling_forms.json (empty: print only).")
FLAGS = flags.FLAGS
FORMS = tuple(SamplingForm)


def conditionals(engine: Engine, key: tuple) -> int:
  """Run-time branches (`conditional` instructions) in the compiled program of `key`."""
  return engine.compiled.program_text(key).count(" conditional(")


def measure(engine: Engine, prompts, block_size: int, max_new: int, repeats: int) -> dict:
  """{loop: {form: {tokens [N], seconds [N] (fastest repeat), outputs}}} for the AR loop and
  the paper's loop of `block_size`, the forms alternating per request and repeat."""
  runs = {"ar": 1, f"b{block_size}": block_size}
  out = {name: {f.name: {"tokens": [], "seconds": [], "outputs": []} for f in FORMS}
         for name in runs}
  for key, ids in tqdm(prompts, desc="prompts", unit="prompt"):
    for name, b in runs.items():
      best = {f.name: (np.inf, None) for f in FORMS}
      for r in range(repeats):
        for form in (FORMS if r % 2 == 0 else FORMS[::-1]):
          g = engine.generate(ids, max_new_tokens=max_new, block_size=b, sampling_form=form)
          if g.decode_s < best[form.name][0]:
            best[form.name] = (g.decode_s, g)
      for form, (secs, g) in best.items():
        row = out[name][form]
        row["tokens"].append(g.new_tokens)
        row["seconds"].append(secs)
        row["outputs"].append(g.output_ids)
  return out


def main(_):
  if FLAGS.repeats < 1 or FLAGS.block_size < 2:
    raise BadInputError("--repeats must be >= 1 and --block_size >= 2")
  models = common.load_models(FLAGS)
  prompts = common.demo_prompts(models.tokenizer, limit=FLAGS.num_prompts)
  b = FLAGS.block_size
  engine = Engine(models.target, stop_ids=models.stop_ids, drafter=models.drafter,
                  shapes=ShapeOptions(max_len=FLAGS.max_len, block_sizes=(1, b)),
                  loop=LoopOptions(controller="none", start_backoff=False))
  for ids in {len(ids): ids for _, ids in prompts}.values():  # every length bucket's programs
    for form in FORMS:
      for size in (1, b):
        engine.generate(ids, max_new_tokens=2, block_size=size, sampling_form=form)
  t0 = time.perf_counter()
  runs = measure(engine, prompts, b, FLAGS.max_new_tokens, FLAGS.repeats)
  report = {"command": common.command_line(), "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "prompts": len(prompts), "block_size": b,
            "max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats,
            "decode_wall_s": round(time.perf_counter() - t0, 1), "loops": {}}
  print(f"  {len(prompts)} HumanEval eval-half prompts, {FLAGS.max_new_tokens} new tokens, T=0, "
        f"fastest of {FLAGS.repeats}, {jax.default_backend()}")
  print(f"  {'loop':<6}{'form':<8}{'compile s':>10}{'branches':>10}{'tok/s':>9}"
        f"{'GREEDY / this form':>30}")
  for name, by_form in runs.items():
    size = 1 if name == "ar" else b
    loop = "ar_loop" if size == 1 else "spec_loop"
    named = {form_key(f) for f in FORMS} - {()}  # the forms a key names (GREEDY: none)
    form_of_key = lambda k: k[-1:] if k[-1:] in named else ()
    keys = {f.name: [k for k in engine.compiled.seconds  # one per attention window taken
                     if k[0] == loop and k[1] == size and form_of_key(k) == form_key(f)]
            for f in FORMS}
    g = by_form["GREEDY"]
    identical = min(sum(x == y for x, y in zip(g["outputs"], by_form[f.name]["outputs"]))
                    for f in FORMS)
    entry = {"identical_outputs": identical, "forms": {}}
    for f in FORMS:
      row = by_form[f.name]
      speed = bootstrap_speedup(g["tokens"], g["seconds"], row["tokens"], row["seconds"],
                                reps=FLAGS.bootstrap_reps)
      entry["forms"][f.name] = {
          "keys": [list(k) for k in keys[f.name]],
          "compile_s": round(sum(engine.compiled.seconds[k] for k in keys[f.name]), 3),
          "conditionals": max(conditionals(engine, k) for k in keys[f.name]),
          "tokens_per_s": round(sum(row["tokens"]) / sum(row["seconds"]), 1),
          "greedy_speedup": speed._asdict()}
      e = entry["forms"][f.name]
      ratio = (f"{speed.ratio:.3f}x [{speed.lo:.3f}, {speed.hi:.3f}]"
               if f != SamplingForm.GREEDY else "")
      print(f"  {name:<6}{f.name:<8}{e['compile_s']:>10.2f}{e['conditionals']:>10d}"
            f"{e['tokens_per_s']:>9.1f}{ratio:>30}")
    if identical != len(prompts):
      raise RuntimeError(f"{loop}: {len(prompts) - identical} outputs differ between the forms")
    report["loops"][name] = entry
  print(f"  outputs identical in every form: {len(prompts)}/{len(prompts)} per loop")
  if FLAGS.out:
    path = os.path.join(FLAGS.out, "sampling_forms.json")
    common.write_json(path, report)
    print(f"  wrote {path}")


if __name__ == "__main__":
  common.define_flags("target", "drafter", "max_len", "max_new_tokens", "block_size", "repeats",
                      num_prompts=20)
  cli.run(main, __doc__)
