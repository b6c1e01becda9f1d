"""Start-up: the engine a config describes (as decode.py builds it), compiled for the server's
bucket before the first request, the engine thread, the app, and uvicorn on host:port.

The server decodes every request with one block size: --config.block_size with mode=spec (the
drafter's bucket), 1 with mode=ar; a learned block-size policy is not used here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

API_KEY_ENV = "BP_JAX_API_KEY"


def build_service(cfg, *, batch_size: int, api_key: str | None = None,
                  max_body_bytes: int | None = None, model_name: str | None = None):
  """(Service, start-up figures) for a decode.py config: the engine with `batch_size` slots,
  compiled and warmed, its thread started."""
  from bp_jax import compile_cache
  from bp_jax.gc_freeze import freeze_after_startup
  from bp_jax.decode_job import run as run_decode
  from bp_jax.models.precision import matmul_precision, precision_of
  from bp_jax.serving.app import DEFAULT_MAX_BODY_BYTES, Service
  from bp_jax.serving.metrics import Metrics
  from bp_jax.serving.protocol import Limits
  from bp_jax.serving.worker import EngineWorker, warm_up

  cfg = cfg.copy_and_resolve_references()
  cfg.batch_size = int(batch_size)
  if cfg.mode == "ar":
    cfg.compare = ""
  run_decode.validate(cfg)
  cache_dir = compile_cache.enable(cfg.get("compile_cache", ""))
  # For the whole process: the engine thread's programs are traced with it too.
  matmul_precision(precision_of(cfg)).__enter__()
  t0 = time.perf_counter()
  engine, tok, _ = run_decode.build_engine(cfg)
  block_size = int(cfg.block_size) if cfg.mode == "spec" else 1
  engine.check_block_size(block_size)
  load_s = time.perf_counter() - t0
  warm_s, left = warm_up(engine, block_size)
  frozen = freeze_after_startup()  # later collections skip what start-up made
  name = model_name or os.path.basename(os.path.normpath(str(cfg.target)))
  limits = Limits(model=name, max_len=engine.max_len, block_size=block_size,
                  vocab_size=engine.cfg.vocab_size,
                  default_max_tokens=int(cfg.max_new_tokens))
  metrics = Metrics()
  worker = EngineWorker(engine, tok, metrics, block_size)
  worker.start()
  svc = Service(worker, tok, limits, metrics, api_key or None,
                max_body_bytes or DEFAULT_MAX_BODY_BYTES)
  info = {"model": name, "block_size": block_size, "batch_size": engine.batch_size,
          "max_len": engine.max_len, "load_s": round(load_s, 2),
          "compile_s": round(warm_s, 2), "compilations": engine.compiled.total,
          "left_to_compile": left,
          "compile_cache": cache_dir, "gc_frozen_objects": frozen}
  return svc, info


def serve(cfg, *, host: str, port: int, batch_size: int, api_key: str | None = None,
          max_body_bytes: int | None = None, model_name: str | None = None) -> None:
  """Builds the service and serves it until SIGTERM / Ctrl-C (then: no new connections, the
  requests in flight finish, the engine thread ends)."""
  import uvicorn

  from bp_jax.serving.app import create_app

  api_key = api_key or os.environ.get(API_KEY_ENV) or None
  if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
    logging.warning("serving on %s without an API key: anyone who can reach it may use it "
                    "(--api_key or $%s)", host, API_KEY_ENV)
  svc, info = build_service(cfg, batch_size=batch_size, api_key=api_key,
                            max_body_bytes=max_body_bytes, model_name=model_name)
  left = (f"; {info['left_to_compile']} left to compile on first use"
          if info["left_to_compile"] else "")
  print(f"serve.py: model {info['model']!r}, block_size {info['block_size']}, "
        f"{info['batch_size']} slots, max_len {info['max_len']}; loaded in {info['load_s']} s, "
        f"compiled in {info['compile_s']} s ({info['compilations']} programs{left}); "
        f"{info['gc_frozen_objects']:,} start-up objects kept out of garbage collections",
        flush=True)
  print(f"serve.py: listening on http://{host}:{port}"
        f"{' (API key required)' if svc.api_key else ''}", flush=True)
  config = uvicorn.Config(create_app(svc), host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=None)
  _Server(config).run()
  print("serve.py: stopped", flush=True)


def _server_class():
  import uvicorn

  class Server(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT end it gracefully and then exit 0 (uvicorn
    raises the signal again once it has stopped, which ends the process with -15)."""

    @contextlib.contextmanager
    def capture_signals(self):
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, self.handle_exit)
      yield

  return Server


def _Server(config):
  return _server_class()(config)
