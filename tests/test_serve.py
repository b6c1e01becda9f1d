"""serve.py end to end: one server process (the demo models, 4 slots, a small max_len) on a free
port of 127.0.0.1 for the whole module, talked to with the `openai` client and raw HTTP.

Shown here: greedy completions equal the engine's own decoding of the same prompts; streamed
deltas concatenate to the non-streamed text; the chat template is applied; per-request sampling
settings are honoured inside one batch (each equals the request sent alone); every bad input is
answered with its status and a message naming the field, the server serving on between them;
a client that disconnects mid-stream frees its slot; SIGTERM finishes the stream in flight and
exits.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key-3f9a"
MAX_LEN, BODY_LIMIT = 128, 4096
PROMPTS = ["def add(a, b):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def push(self"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "BP_JAX_API_KEY": KEY,
         "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
  log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
  proc = subprocess.Popen(
      [sys.executable, "serve.py", "--port", str(port), "--batch_size", "4",
       "--max_body_bytes", str(BODY_LIMIT), f"--config.max_len={MAX_LEN}",
       "--config.length_buckets=32,64,128", "--config.sync_cycles=2", "--config.verify=exact",
       # Given costs: no start-up measurement (16.2 s -> 3.6 s to load here), which
       # decode.py's tests and tests/test_costs.py cover on the same engine builder.
       "--config.controller_costs=1,1.1,1.3,1.6", "--config.controller_draft_cost=0.8",
       # Its warm-up compiles every program a request may take: with tails in fewer slots, each
       # slot size and resize too (tests/test_per_request_sampling.py checks that warm-up).
       "--config.shrink_batches=false"],
      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  deadline = time.time() + 600
  while time.time() < deadline:
    if proc.poll() is not None:
      log.seek(0)
      pytest.fail(f"serve.py exited {proc.returncode}:\n{log.read()[-3000:]}")
    try:
      with urllib.request.urlopen(base + "/health", timeout=2) as r:
        if r.status == 200:
          break
    except OSError:
      time.sleep(1)
  else:
    proc.kill()
    pytest.fail("serve.py did not come up")
  yield {"base": base, "port": port, "proc": proc, "log": log}
  if proc.poll() is None:
    proc.kill()
  proc.wait()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0,
                       timeout=120)


@pytest.fixture(scope="module")
def reference():
  """The engine's own greedy decoding of PROMPTS (plain AR, one request at a time: the same
  tokens as any exact mode), as text."""
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import ShapeOptions
  from bp_jax.text.tokenizer import load_tokenizer, stop_token_ids
  from bp_jax.weights.loading import load_target
  target = load_target(os.path.join(REPO, "demo/target"), "float32")
  tok = load_tokenizer(os.path.join(REPO, "demo/target"))
  stops = stop_token_ids(tok)
  eng = Engine(target, stop_ids=stops, shapes=ShapeOptions(max_len=MAX_LEN,
                                                           length_buckets=(32, 64, 128)))

  def decode(text: str, n: int) -> str:
    ids = eng.generate(tok.encode(text, add_special_tokens=False), max_new_tokens=n).output_ids
    return tok.decode([t for t in ids if t not in stops])

  return tok, decode


def _post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None):
  data = raw if raw is not None else json.dumps(body).encode()
  headers = {"Content-Type": "application/json"}
  if key:
    headers["Authorization"] = f"Bearer {key}"
  req = urllib.request.Request(server["base"] + path, data=data, headers=headers)
  try:
    with urllib.request.urlopen(req, timeout=120) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _metrics(server) -> dict:
  req = urllib.request.Request(server["base"] + "/metrics",
                               headers={"Authorization": f"Bearer {KEY}"})
  with urllib.request.urlopen(req, timeout=30) as r:
    text = r.read().decode()
  from bp_jax.serving.metrics import parse
  return parse(text)


def test_models_and_health(server, client):
  assert [m.id for m in client.models.list().data] == ["target"]
  with urllib.request.urlopen(server["base"] + "/health") as r:
    assert json.loads(r.read()) == {"status": "ok"}
  # What start-up made is frozen out of later garbage collections (`bp_jax.gc_freeze`).
  server["log"].seek(0)
  frozen = re.search(r"([\d,]+) start-up objects kept out of garbage collections",
                     server["log"].read())
  assert frozen and int(frozen.group(1).replace(",", "")) > 10_000


def test_freezing_after_start_up_keeps_those_objects_out_of_full_collections():
  """`freeze_after_startup`: start-up's garbage collected, every object left frozen; a full
  collection then walks only what was made after (a process of its own: freezing is for the
  whole process)."""
  code = ("import gc, time\n"
          "from bp_jax.gc_freeze import freeze_after_startup\n"
          "kept = [[i] for i in range(200_000)]\n"
          "def full():\n"
          "  t0 = time.perf_counter(); gc.collect(); return time.perf_counter() - t0\n"
          "before = min(full() for _ in range(3))\n"
          "n = freeze_after_startup()\n"
          "after = min(full() for _ in range(3))\n"
          "assert n >= 200_000 and gc.get_freeze_count() == n, n\n"
          "assert after < before / 2, (before, after)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_greedy_completions_equal_the_engine_and_streams_concatenate(server, client, reference):
  _, decode = reference
  results = {}

  def one(i, p):  # concurrently: the requests share a batch
    results[i] = client.completions.create(model="target", prompt=p, max_tokens=24,
                                           temperature=0)

  threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(PROMPTS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i, p in enumerate(PROMPTS):
    expected = decode(p, 24)
    assert results[i].choices[0].text == expected
    chunks = list(client.completions.create(model="target", prompt=p, max_tokens=24,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert results[i].usage.prompt_tokens == len(reference[0].encode(p))
  # What the speculation chose for them: each request's loop and its forwards by verify length
  # (at most 24 tokens each, one forward or more per token after the prefill's), and the start
  # rule's state for the server's bucket.
  m = _metrics(server)
  paths = [m[f'bp_jax_serve_requests_finished_total{{path="{p}"}}']
           for p in ("speculative", "plain", "moved_plain")]
  assert sum(paths) == 2 * len(PROMPTS)
  forwards = {k.split('"')[1]: v for k, v in m.items()
              if k.startswith("bp_jax_serve_target_forwards_total")}
  assert set(forwards) <= {"ar", "k=0", "k=7"} and 0 < sum(forwards.values()) <= 6 * 23
  assert m["bp_jax_serve_start_price"] > 0 and m["bp_jax_serve_start_plain"] in (0, 1)


def test_chat_applies_the_template(client, reference):
  from bp_jax.serving.protocol import chat_text
  tok, decode = reference
  messages = [{"role": "system", "content": "You write Python."},
              {"role": "user", "content": "def square(x):"}]
  out = client.chat.completions.create(model="target", messages=messages, max_tokens=16)
  rendered = chat_text(tok, messages)
  assert "You write Python." in rendered and rendered != "def square(x):"
  assert out.choices[0].message.content == decode(rendered, 16)
  assert out.choices[0].message.role == "assistant"
  chunks = list(client.chat.completions.create(model="target", messages=messages,
                                               max_tokens=16, stream=True))
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
      out.choices[0].message.content)


SETTINGS = [dict(temperature=0), dict(temperature=1.0, seed=5),
            dict(temperature=0.8, seed=9, extra_body={"top_k": 5}),
            dict(temperature=1.2, top_p=0.8, seed=3, extra_body={"min_p": 0.05})]


def test_per_request_settings_in_one_batch(client):
  def run(kw):
    return client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=20,
                                     **kw).choices[0].text

  together = {}
  threads = [threading.Thread(target=lambda i=i, kw=kw: together.__setitem__(i, run(kw)))
             for i, kw in enumerate(SETTINGS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  alone = [run(kw) for kw in SETTINGS]
  assert [together[i] for i in range(len(SETTINGS))] == alone
  assert len(set(alone)) >= 3  # the settings do differ in effect
  # A stop string ends the text before it (a greedy request cut where its text has it).
  full = alone[0]
  stop = full[len(full) // 2:len(full) // 2 + 3]
  cut = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=20,
                                  temperature=0, stop=[stop]).choices[0]
  assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_bad_inputs_are_answered_and_the_server_goes_on(server, client):
  good = {"model": "target", "prompt": "x = 1\n", "max_tokens": 4}
  cases = [
      (None, b'{"model": "target", "prompt": ', 400, None),                # malformed JSON
      (None, b'[1, 2]', 400, None),                                        # not an object
      ({**good, "max_tokens": "ten"}, None, 400, "max_tokens"),            # wrong type
      ({**good, "max_tokens": 10 * MAX_LEN}, None, 400, "max_tokens"),     # beyond max_len
      ({**good, "prompt": [5] * (MAX_LEN + 1)}, None, 400, "prompt"),      # prompt too long
      ({**good, "temperature": -0.5}, None, 400, "temperature"),
      ({**good, "top_p": 0}, None, 400, "top_p"),
      ({**good, "top_p": 1.5}, None, 400, "top_p"),
      ({**good, "model": "gpt-5"}, None, 400, "model"),                    # unknown model
      ({**good, "prompt": "x" * (2 * BODY_LIMIT)}, None, 413, None),       # body too large
      ({**good, "stream": "yes"}, None, 400, "stream"),
  ]
  for body, raw, status, param in cases:
    got, answer = _post(server, "/v1/completions", body, raw=raw)
    assert got == status, (body or raw, answer)
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param:
      assert param in err["message"]
    assert _post(server, "/v1/completions", good)[0] == 200  # still serving
  got, answer = _post(server, "/v1/chat/completions",
                      {"model": "target", "messages": [{"role": "wizard", "content": "hi"}]})
  assert got == 400 and answer["error"]["param"] == "messages[0].role"
  got, answer = _post(server, "/v1/completions", good, key=None)
  assert got == 401 and answer["error"]["type"] == "authentication_error"
  assert _post(server, "/v1/completions", good, key="wrong-key")[0] == 401
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=server["base"] + "/v1", api_key="nope", max_retries=0
                  ).models.list()
  assert _post(server, "/v1/nothing", good)[0] == 404
  assert client.completions.create(model="target", prompt="y", max_tokens=2).choices


def test_a_client_gone_mid_stream_frees_its_slot(server):
  before = _metrics(server)
  conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
  body = json.dumps({"model": "target", "prompt": PROMPTS[1], "max_tokens": MAX_LEN - 20,
                     "temperature": 0, "stream": True, "stop_token_ids": []})
  conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                 "Authorization": f"Bearer {KEY}"})
  resp = conn.getresponse()
  assert resp.status == 200
  assert resp.readline().startswith(b"data: ")  # the first delta arrived
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  deadline = time.time() + 60
  while time.time() < deadline:
    m = _metrics(server)
    if m["bp_jax_serve_cancelled_total"] > before["bp_jax_serve_cancelled_total"]:
      break
    time.sleep(0.2)
  assert m["bp_jax_serve_cancelled_total"] == before["bp_jax_serve_cancelled_total"] + 1
  assert m['bp_jax_serve_batch_occupancy{block_size="8"}'] == 0
  assert m["bp_jax_serve_requests_in_flight"] == 0
  assert m["bp_jax_serve_compilations"] == before["bp_jax_serve_compilations"]


def test_sigterm_finishes_the_stream_in_flight_and_exits(server, client):
  """Last: the module's server goes away."""
  stream = client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=60,
                                     temperature=0, stream=True)
  first = next(iter(stream))
  server["proc"].send_signal(signal.SIGTERM)
  rest = list(stream)
  assert rest and rest[-1].choices[0].finish_reason in ("length", "stop")
  assert server["proc"].wait(timeout=60) == 0
  with pytest.raises(OSError):
    urllib.request.urlopen(server["base"] + "/health", timeout=5)
  assert first.choices
