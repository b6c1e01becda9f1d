"""One process: the demo's AR loop and the paper's loop (b=8, `rejection`) at T > 0 with top-k /
top-p, with this checkout's code; prints one JSON line (tok/s fastest of R per request, the md5
of the outputs, per setting and loop). Run from the root of the checkout under test:

  PYTHONPATH=. python docs/truncation/before_after.py --num_prompts 16 --repeats 2
"""
import hashlib, json, sys
from absl import flags
from benchmarks import common
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import LoopOptions, ShapeOptions

common.define_flags("target", "drafter", "max_len", "max_new_tokens", "block_size", "repeats",
                    num_prompts=16)
F = flags.FLAGS
F(sys.argv)
m = common.load_models(F)
prompts = common.demo_prompts(m.tokenizer, limit=F.num_prompts)
b = F.block_size
eng = Engine(m.target, stop_ids=m.stop_ids, drafter=m.drafter,
             shapes=ShapeOptions(max_len=F.max_len, block_sizes=(1, b)),
             loop=LoopOptions(controller="none", start_backoff=False, verify="rejection"))
SETTINGS = {"T=0.6,top_k=20,top_p=0.95": dict(temperature=0.6, top_k=20, top_p=0.95),
            "T=1,top_p=0.9": dict(temperature=1.0, top_p=0.9)}
for ids in {len(ids): ids for _, ids in prompts}.values():  # every window compiled first
  for size in (1, b):
    eng.generate(ids, max_new_tokens=2, block_size=size, **SETTINGS["T=1,top_p=0.9"])
out = {}
for label, kw in SETTINGS.items():
  for name, size in (("ar", 1), (f"b{b}", b)):
    toks = secs = 0.0
    outs = []
    for i, (_, ids) in enumerate(prompts):
      best = None
      for _ in range(F.repeats):
        g = eng.generate(ids, max_new_tokens=F.max_new_tokens, block_size=size, seed=i, **kw)
        best = g if best is None or g.decode_s < best.decode_s else best
      toks += best.new_tokens
      secs += best.decode_s
      outs.append(best.output_ids)
    out[f"{label} {name}"] = {"tok_s": round(toks / secs, 1),
                              "md5": hashlib.md5(json.dumps(outs).encode()).hexdigest()}
print("RESULT " + json.dumps(out))
