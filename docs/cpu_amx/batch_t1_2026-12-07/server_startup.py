"""A demo server's start-up (`build_service` at batch 8, the shipped demo config, the compile
cache in /tmp/s82/cc), its seconds. Run from a checkout of the commit to time, after one run has
filled the cache:

  PYTHONPATH=. python docs/cpu_amx/batch_t1_2026-12-07/server_startup.py
"""
import os
import sys
import time

sys.argv = sys.argv[:1]

from bp_jax.serving.server import build_service  # noqa: E402
from configs import demo  # noqa: E402

cfg = demo.get_config()
cfg.compile_cache = "/tmp/s82/cc"
t0 = time.perf_counter()
svc, info = build_service(cfg, batch_size=8)
print("startup", round(time.perf_counter() - t0, 2), info, flush=True)
os._exit(0)  # the engine thread holds no request: nothing to finish
