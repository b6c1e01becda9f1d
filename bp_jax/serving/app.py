"""The HTTP app (FastAPI): OpenAI's completions and chat completions, streamed (server-sent
events, one chunk per loop return that brought new text) or not, /v1/models, /health and
/metrics, in front of the engine thread (`worker.EngineWorker`).

Every error is answered in OpenAI's shape (`protocol.ApiError`): 400 for a bad field (named),
401 without the API key (when one is set; compared in constant time), 404 for an unknown path,
413 for a body over the size limit, 500 when the engine fails a request, 503 while shutting
down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bp_jax.serving import protocol
from bp_jax.serving.metrics import Metrics
from bp_jax.serving.protocol import ApiError, Limits
from bp_jax.serving.worker import Delta, Done, EngineWorker, Failed, Job

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclasses.dataclass
class Service:
  """What the app serves with."""
  worker: EngineWorker
  tokenizer: object
  limits: Limits
  metrics: Metrics
  api_key: str | None = None
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def _error(e: ApiError) -> JSONResponse:
  headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> bytes:
  return f"data: {json.dumps(obj)}\n\n".encode()


def create_app(svc: Service) -> FastAPI:
  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    # SIGTERM: uvicorn has stopped accepting and finished the requests in flight.
    await asyncio.get_running_loop().run_in_executor(None, svc.worker.stop)

  app = FastAPI(title="bp_jax", lifespan=lifespan)
  m = svc.metrics

  @app.exception_handler(ApiError)
  async def api_error(request: Request, e: ApiError):
    m.count_request(request.url.path, e.status)
    return _error(e)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException):
    m.count_request("other", e.status_code)
    return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                           type="invalid_request_error",
                           code="not_found" if e.status_code == 404 else None))

  def check_key(request: Request) -> None:
    if not svc.api_key:
      return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if not (scheme.lower() == "bearer" and
            hmac.compare_digest(token.strip().encode(), svc.api_key.encode())):
      raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                     type="authentication_error", code="invalid_api_key")

  async def read_body(request: Request) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > svc.max_body_bytes:
      raise ApiError(413, f"the request body is {length} bytes, over the server's limit of "
                     f"{svc.max_body_bytes}", code="body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
      raw += chunk
      if len(raw) > svc.max_body_bytes:
        raise ApiError(413, f"the request body is over the server's limit of "
                       f"{svc.max_body_bytes} bytes", code="body_too_large")
    return protocol.read_json(bytes(raw))

  @app.get("/health")
  async def health():
    alive = svc.worker.thread.is_alive()
    return JSONResponse({"status": "ok" if alive else "engine stopped"},
                        status_code=200 if alive else 503)

  @app.get("/metrics")
  async def metrics(request: Request):
    check_key(request)
    return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def models(request: Request):
    check_key(request)
    m.count_request("/v1/models", 200)
    return {"object": "list", "data": [{"id": svc.limits.model, "object": "model",
                                        "created": 0, "owned_by": "bp_jax",
                                        "max_model_len": svc.limits.max_len}]}

  async def generate(request: Request, chat: bool):
    check_key(request)
    endpoint = request.url.path
    body = await read_body(request)
    parse = protocol.parse_chat if chat else protocol.parse_completion
    params = parse(body, svc.limits, svc.tokenizer)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = Job(svc.worker.new_id(), params,
              lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    svc.worker.submit(job)
    with m.lock:
      m.in_flight += 1
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    finished = False

    def settle():
      nonlocal finished
      if not finished:  # the client is gone (or we failed): free the slot
        svc.worker.cancel(job.id)
        finished = True
      with m.lock:
        m.in_flight -= 1

    try:
      first = await events.get()
    except BaseException:
      settle()
      raise
    if isinstance(first, Failed):
      finished = True
      settle()
      raise first.error

    def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
      if chat:
        delta = {} if text is None else {"content": text}
        if role:
          delta = {"role": "assistant", "content": text or ""}
        choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion.chunk"
      else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
      return {"id": rid, "object": obj, "created": created, "model": svc.limits.model,
              "choices": [choice]}

    if params.stream:
      async def stream():
        nonlocal finished
        try:
          if chat:
            yield _sse(chunk(None, None, role=True))
          ev = first
          while True:
            if isinstance(ev, Delta):
              yield _sse(chunk(ev.text, None))
            elif isinstance(ev, Done):
              finished = True
              yield _sse(chunk(None, ev.finish_reason))
              if params.include_usage:
                yield _sse({"id": rid, "object": chunk(None, None)["object"],
                            "created": created, "model": svc.limits.model, "choices": [],
                            "usage": ev.usage})
              break
            elif isinstance(ev, Failed):
              finished = True
              yield _sse(ev.error.body())
              break
            ev = await events.get()
          yield b"data: [DONE]\n\n"
        finally:
          settle()

      m.count_request(endpoint, 200)
      return StreamingResponse(stream(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})

    parts, ev = [], first
    try:
      while not isinstance(ev, (Done, Failed)):
        parts.append(ev.text)
        ev = await events.get()
      finished = True
    finally:
      settle()
    if isinstance(ev, Failed):
      raise ev.error
    text = "".join(parts)
    if chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": ev.finish_reason, "logprobs": None}
    else:
      choice = {"index": 0, "text": text, "finish_reason": ev.finish_reason, "logprobs": None}
    m.count_request(endpoint, 200)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": svc.limits.model, "choices": [choice],
            "usage": ev.usage}

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await generate(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await generate(request, chat=True)

  return app
