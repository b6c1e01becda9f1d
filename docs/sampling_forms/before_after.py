"""One process: compile + decode the demo's AR loop and paper's loop (b=8) at T=0 with this
checkout's code; prints one JSON line (compile s, conditionals, tok/s fastest of R)."""
import json, sys, time
import numpy as np
from absl import flags
from benchmarks import common
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions

common.define_flags("target", "drafter", "max_len", "max_new_tokens", "block_size", "repeats",
                    num_prompts=20)
F = flags.FLAGS
F(sys.argv)
m = common.load_models(F)
prompts = common.demo_prompts(m.tokenizer, limit=F.num_prompts)
b = F.block_size
eng = Engine(m.target, stop_ids=m.stop_ids, drafter=m.drafter,
             shapes=ShapeOptions(max_len=F.max_len, block_sizes=(1, b)),
             loop=LoopOptions(controller="none", start_backoff=False))
for ids in {len(ids): ids for _, ids in prompts}.values():
  for size in (1, b):
    eng.generate(ids, max_new_tokens=2, block_size=size)
out = {}
for name, size in (("ar", 1), (f"b{b}", b)):
  toks = secs = 0.0
  outs = []
  for _, ids in prompts:
    best = None
    for r in range(F.repeats):
      g = eng.generate(ids, max_new_tokens=F.max_new_tokens, block_size=size)
      best = g if best is None or g.decode_s < best.decode_s else best
    toks += best.new_tokens; secs += best.decode_s; outs.append(best.output_ids)
  loop = "ar_loop" if size == 1 else "spec_loop"
  keys = [k for k in eng.compiled.seconds if k[0] == loop and k[1] == size]
  out[name] = {"tok_s": toks / secs, "compile_s": sum(eng.compiled.seconds[k] for k in keys),
               "conditionals": max(eng.compiled._fns[k].as_text().count(" conditional(") for k in keys),
               "keys": [list(map(str, k)) for k in keys],
               "md5": __import__("hashlib").md5(json.dumps(outs).encode()).hexdigest()}
print("RESULT " + json.dumps(out))
