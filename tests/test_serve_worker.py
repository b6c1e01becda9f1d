"""The server's engine thread in-process: where a loop call would compile past the machine's
memory-map limit (`compiled.MapLimitError`), the requests in flight are answered 503 with what
to change, and the thread goes on serving once there is room."""

from __future__ import annotations

import queue
import weakref

import pytest

from bp_jax.decoding import compiled
from bp_jax.decoding.engine import Engine
from bp_jax.decoding.options import BatchOptions, ShapeOptions
from bp_jax.serving.metrics import Metrics
from bp_jax.serving.protocol import GenParams
from bp_jax.serving.worker import Done, EngineWorker, Failed, Job, warm_up
from live_maps import live_maps
from toy_models import zeros_drafter_pair

V = 48


class DigitTokenizer:
  def decode(self, ids, skip_special_tokens=False):
    return " ".join(map(str, ids))


def _ask(worker: EngineWorker, prompt_ids: list[int]):
  """The request's last event (Done or Failed), waiting at most 120 s."""
  events: queue.Queue = queue.Queue()
  worker.submit(Job(worker.new_id(), GenParams(prompt_ids, max_tokens=4), events.put))
  while True:
    event = events.get(timeout=120)
    if isinstance(event, (Done, Failed)):
      return event


def test_a_loop_past_the_map_limit_is_answered_503_and_the_server_goes_on(monkeypatch):
  target, _ = zeros_drafter_pair(V)
  monkeypatch.setattr(compiled, "_caches", weakref.WeakSet())  # this engine's programs alone
  engine = Engine(target, stop_ids=[V - 1], shapes=ShapeOptions(max_len=64, length_buckets=(16,)),
                  batching=BatchOptions(batch_size=2, sync_cycles=2))
  worker = EngineWorker(engine, DigitTokenizer(), Metrics(), block_size=1)
  monkeypatch.setattr(compiled, "_added", {"prefill": 900})
  monkeypatch.setattr(compiled, "maps_in_use", lambda: (61_500, 65_530))
  worker.start()
  try:
    failed = _ask(worker, [3, 4, 5])
    assert isinstance(failed, Failed) and failed.error.status == 503
    assert failed.error.code == "map_limit" and "vm.max_map_count=65,530" in failed.error.message
    monkeypatch.setattr(compiled, "maps_in_use", lambda: (1_000, 65_530))
    done = _ask(worker, [3, 4, 5])
    assert isinstance(done, Done) and done.usage["completion_tokens"] >= 1
  finally:
    worker.stop(timeout=60)
  assert not worker.thread.is_alive()


@pytest.fixture
def room_for_four(monkeypatch):
  yield from live_maps(monkeypatch, 4)


def test_a_start_up_past_the_map_limit_serves_compiling_the_rest_on_first_use(room_for_four):
  """Where the server's programs (prefill, plain and speculative loops in every window, form
  and slot count, insertions, resizes) pass the memory-map limit, its start-up compiles what
  fits and says how many are left; requests are then served, the least recently used
  programs making room for those they need."""
  target, drafter = zeros_drafter_pair(V)
  engine = Engine(target, drafter=drafter, stop_ids=[V - 1],
                  shapes=ShapeOptions(max_len=64, length_buckets=(16,)),
                  batching=BatchOptions(batch_size=2, sync_cycles=2))
  secs, left = warm_up(engine, 4)
  assert left > 0 and secs > 0 and len(engine.compiled.keys()) <= 4
  metrics = Metrics()
  worker = EngineWorker(engine, DigitTokenizer(), metrics, block_size=4)
  worker.start()
  try:
    for prompt in ([3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7]):
      done = _ask(worker, prompt)
      assert isinstance(done, Done) and done.usage["completion_tokens"] >= 1
  finally:
    worker.stop(timeout=60)
  assert engine.compiled.evicted >= 1 and metrics.programs_let_go == engine.compiled.evicted
