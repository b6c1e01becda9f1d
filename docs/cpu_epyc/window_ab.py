"""A one-request AR loop with its attention window (the smallest of `programs.request_windows`
holding the request) against the same loop over all max_len cache slots, alternated in one
process on the demo's target: 4 random prompts of PROMPT_LEN tokens, 128 new tokens, 5 timed
rounds after a warm-up round.

    PYTHONPATH=. python docs/cpu_epyc/window_ab.py 2048 300   # max_len, prompt length

Prints the window, each form's median ms per token and full / windowed.
"""
import time, sys, numpy as np
import bp_jax.decoding.engine as E
from bp_jax.decoding.engine import Engine, decode_form
from bp_jax.decoding.options import ShapeOptions
from bp_jax.weights.loading import load_target
orig = E.request_window
target = decode_form(load_target("demo/target", "float32"))
ML = int(sys.argv[1]); PL = int(sys.argv[2])
eng = Engine(target, stop_ids=[], shapes=ShapeOptions(max_len=ML, length_buckets=(PL,)))
rng = np.random.default_rng(0)
ps = [list(rng.integers(10, 4000, size=PL)) for _ in range(4)]
print("window", orig(PL + 128 + 1, ML))
forms = {"window": orig, "full": lambda extent, max_len: None}
t = {k: [] for k in forms}
for r in range(6):
  for k in (list(forms) if r % 2 else list(forms)[::-1]):
    E.request_window = forms[k]
    for p in ps:
      t0 = time.perf_counter(); eng.generate(p, max_new_tokens=128); dt = time.perf_counter() - t0
      if r: t[k].append(dt)
w, f = np.array(t["window"]), np.array(t["full"])
print(f"max_len {ML} prompt {PL}: window {1e3*np.median(w)/128:.3f} ms/tok, full {1e3*np.median(f)/128:.3f} ms/tok, full/window {np.median(f)/np.median(w):.3f}; paired ratio median {np.median(f/w):.3f}")
