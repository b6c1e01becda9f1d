"""The engine thread: the one thread that owns the device. It takes requests from an inbox,
runs the continuous-batching scheduler (`decoding.scheduler.Scheduler`: `submit`, `step`,
`cancel`) and after every loop call hands each request's new text to its handler.

Handlers live on the asyncio loop; a `Job` carries a thread-safe `emit` back to them. Events:
  Delta(text)                      new text of the request
  Done(finish_reason, usage)       the request ended ("stop": a stop token or string;
                                   "length": max_tokens)
  Failed(ApiError)                 the request alone failed (400: refused by the engine, 500: its
                                   logits turned NaN/inf); the others go on. A loop call that
                                   raises fails every request in flight (503: a program would
                                   pass the machine's memory-map limit; 500: a bug)
A cancelled request (client gone, `cancel`) leaves its slot at the next loop return.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from typing import Any, Callable

from bp_jax.decoding.compiled import MapLimitError
from bp_jax.decoding.sampling import SamplingForm
from bp_jax.errors import BadInputError
from bp_jax.serving.metrics import Metrics
from bp_jax.serving.protocol import ApiError, GenParams
from bp_jax.serving.textstream import TextStream

log = logging.getLogger("bp_jax.serving")


@dataclasses.dataclass
class Delta:
  text: str


@dataclasses.dataclass
class Done:
  finish_reason: str
  usage: dict


@dataclasses.dataclass
class Failed:
  error: ApiError


@dataclasses.dataclass
class Job:
  """One request in the engine thread's hands."""
  id: int
  params: GenParams
  emit: Callable[[Any], None]   # thread-safe: hands an event to the request's handler
  stream: TextStream | None = None
  tokens: int = 0               # generated tokens seen so far


class EngineWorker:
  """Owns `engine` in its own thread (`start`, `submit`, `cancel`, `stop`)."""

  def __init__(self, engine, tokenizer, metrics: Metrics, block_size: int):
    self.engine, self.tok, self.metrics = engine, tokenizer, metrics
    self.block_size = block_size
    self.sched = engine.scheduler(track_progress=True)
    self.inbox: queue.Queue = queue.Queue()
    self.jobs: dict[int, Job] = {}
    self._ids = iter(range(1, 2**62))
    self._stopping = False
    self.thread = threading.Thread(target=self._run, name="bp_jax-engine", daemon=True)
    metrics.slots = engine.batch_size
    self._gauges()

  # -- called from any thread -----------------------------------------------------------------
  def start(self) -> None:
    self.thread.start()

  def new_id(self) -> int:
    return next(self._ids)

  def submit(self, job: Job) -> None:
    if self._stopping:
      raise ApiError(503, "the server is shutting down", type="server_error",
                     code="shutting_down")
    self.inbox.put(("submit", job))

  def cancel(self, job_id: int) -> None:
    self.inbox.put(("cancel", job_id))

  def stop(self, timeout: float | None = None) -> None:
    """Stops taking requests, finishes those in flight, ends the thread."""
    self._stopping = True
    self.inbox.put(("stop", None))
    self.thread.join(timeout)

  # -- the engine thread ----------------------------------------------------------------------
  def _run(self) -> None:
    stop = False
    while True:
      busy = self.sched.busy()
      try:
        msg = self.inbox.get(block=not busy and not stop, timeout=None)
        while True:
          stop |= self._handle(*msg)
          msg = self.inbox.get_nowait()
      except queue.Empty:
        pass
      if not self.sched.busy():
        self._gauges()
        if stop:
          return
        continue
      try:
        report = self.sched.step()
      except Exception as e:  # fail what is in flight, start over with a fresh scheduler
        self._fail_in_flight(e)
        self.sched = self.engine.scheduler(track_progress=True)
        continue
      self._dispatch(report)
      self._gauges()

  def _handle(self, kind: str, arg) -> bool:
    if kind == "stop":
      return True
    if kind == "cancel":
      job = self.jobs.pop(arg, None)
      if job is not None and self.sched.cancel(arg):
        with self.metrics.lock:
          self.metrics.cancelled += 1
      return False
    job: Job = arg
    p = job.params
    seed = p.seed if p.seed is not None else random.getrandbits(31)
    try:
      req = self.engine.batch_request(job.id, p.prompt_ids, p.max_tokens, seed,
                                      self.block_size, p.sampling, p.stop_token_ids)
    except BadInputError as e:
      job.emit(Failed(ApiError(400, str(e), code="invalid_request")))
      return False
    job.stream = TextStream(self.tok, p.stop,
                            list(self.engine.stop_ids) + list(p.stop_token_ids))
    self.jobs[job.id] = job
    self.sched.submit(req)
    with self.metrics.lock:
      self.metrics.prompt_tokens += len(p.prompt_ids)
    return False

  def _dispatch(self, report) -> None:
    new_tokens = 0
    for idx, ids in report.progress.items():
      job = self.jobs.get(idx)
      if job is None:
        continue
      new_tokens += max(0, len(ids) - job.tokens)
      job.tokens = max(job.tokens, len(ids))
      delta = job.stream.update(ids)
      if delta:
        job.emit(Delta(delta))
      if job.stream.stopped and idx not in report.finished:  # a stop string: free the slot
        self.sched.cancel(idx)
        self._finish(job, "stop")
    for idx, gen in report.finished.items():
      job = self.jobs.get(idx)
      if job is None:
        continue
      new_tokens += max(0, len(gen.output_ids) - job.tokens)
      job.tokens = len(gen.output_ids)
      delta = job.stream.update(gen.output_ids, final=True)
      if delta:
        job.emit(Delta(delta))
      self.metrics.finished(gen)
      stop_hit = bool(gen.output_ids) and gen.output_ids[-1] in job.stream.stop_ids
      self._finish(job, "stop" if stop_hit or job.stream.stopped else "length")
    for idx, err in report.failed.items():
      job = self.jobs.get(idx)
      if job is not None:
        self._fail(job, ApiError(500, f"the engine stopped this request: {err}",
                                 type="server_error", code="nonfinite_logits"))
    self.metrics.loop_call(report.seconds, new_tokens)

  def _finish(self, job: Job, reason: str) -> None:
    self.jobs.pop(job.id, None)
    n = len(job.params.prompt_ids)
    job.emit(Done(reason, {"prompt_tokens": n, "completion_tokens": job.tokens,
                           "total_tokens": n + job.tokens}))

  def _fail_in_flight(self, e: Exception) -> None:
    """Fails every request in flight after a loop call raised `e`: 503 where a program would
    pass the machine's memory-map limit (`compiled.MapLimitError`: the machine's, no bug;
    its message says what to change), 500 otherwise (a bug, logged with its traceback)."""
    if isinstance(e, MapLimitError):
      log.error("engine step refused: %s", e)
      error = lambda: ApiError(503, str(e), type="server_error", code="map_limit")
    else:
      log.exception("engine step failed")
      error = lambda: ApiError(500, f"the engine failed: {type(e).__name__}: {e}",
                               type="server_error", code="engine_error")
    for job in list(self.jobs.values()):
      self._fail(job, error())

  def _fail(self, job: Job, error: ApiError) -> None:
    self.jobs.pop(job.id, None)
    with self.metrics.lock:
      self.metrics.failed += 1
    job.emit(Failed(error))

  def _gauges(self) -> None:
    m = self.metrics
    with m.lock:
      m.occupancy = self.sched.occupancy()
      m.queue_length = self.sched.waiting()
      m.compilations = self.engine.compiled.total
      m.programs_let_go = self.engine.compiled.evicted
      m.start_choice = self.engine.start_choice(self.block_size)
      m.plain_probes = self.engine.plain_probes


def warm_up(engine, block_size: int) -> tuple[float, int]:
  """Compiles (or loads) everything a request can run before the server takes requests: the
  prefills of every length bucket, the batched loop of `block_size` for every attention window
  (`Engine.precompile(all_windows=True)`) in each sampling form (`sampling.SamplingForm`: a
  request may ask for any settings) with the slot insertions, as many as fit under the
  process's memory-map limit (`fit`: the rest compile when first used, the least recently used
  programs then making room); then one short request runs through the scheduler (its host-side
  first uses). Returns (the seconds it took, programs left to compile on first use)."""
  t0 = time.perf_counter()
  left = engine.precompile([block_size], all_windows=True, forms=tuple(SamplingForm),
                           fit=True)["precompile_left"]
  if left:
    log.warning("start-up compiled what fits under the memory-map limit; %d programs are left "
                "to compile when first used (the least recently used then make room). To "
                "compile all at start-up, raise the limit (`sudo sysctl -w "
                "vm.max_map_count=262144`) or run fewer slot sizes "
                "(--config.shrink_batches=False)", left)
  sched = engine.scheduler(track_progress=False)
  sched.submit(engine.batch_request(0, [1, 2, 3], 2, 0, block_size))
  while sched.busy():
    sched.step()
  return time.perf_counter() - t0, left
