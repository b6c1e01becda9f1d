"""Bounded load test of serve.py on 127.0.0.1: many requests, some concurrent, streamed and not,
greedy and sampled, against a server started here (the demo by default), then the same requests
through the engine in this process as decode.py runs them (`Engine.generate_batch` at the same
batch size, per-request settings), for the throughput ratio.

  python -m benchmarks.serve_load                                   # 96 requests, 24 at once
  python -m benchmarks.serve_load --num_requests 32 --concurrency 8

Checks (the run fails if one does not hold): every request is answered once, with 200 (nothing
lost, nothing duplicated: each response's id is new and its text goes to its own request); each
greedy request's text equals its prompt's output decoded in the engine; every streamed text is
the concatenation of its deltas. Figures:
  TTFT              time from sending a request to its first text (streamed requests; for the
                    others, the whole response) p50 / p99
  inter-token       time between consecutive streamed chunks divided by the tokens between them,
                    p50 / p99 (chunks come per loop return, several tokens each)
  server tokens/s   completion tokens of all requests / wall time from the first request sent to
                    the last answer
  engine tokens/s   the same requests' new tokens / wall time of `Engine.generate_batch` over all
                    of them (decode.py's path at --config.batch_size), compiled beforehand
Writes <out>/serve_load.json.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from absl import flags

from benchmarks import common
from bp_jax import cli

common.define_flags("max_len", max_new_tokens=64)
flags.DEFINE_integer("num_requests", 96, "Requests sent in all.")
flags.DEFINE_integer("concurrency", 24, "Requests in flight at once (client threads).")
flags.DEFINE_integer("batch_size", 8, "Server slots (and the engine baseline's batch size).")
flags.DEFINE_integer("sync_cycles", 4, "Cycles between slot refills (server and baseline).")
flags.DEFINE_float("sampled_frac", 0.5, "Fraction of requests sampled (T=0.8, top_p=0.95); the "
                   "others greedy.")
flags.DEFINE_float("stream_frac", 0.5, "Fraction of requests streamed.")
flags.DEFINE_string("config", "configs/demo.py", "serve.py's --config.")
flags.DEFINE_string("out", "out/serve_load", "Output folder (JSON).")
FLAGS = flags.FLAGS


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
  cmd = [sys.executable, "serve.py", f"--config={FLAGS.config}", "--port", str(port),
         "--batch_size", str(FLAGS.batch_size), f"--config.max_len={FLAGS.max_len}",
         f"--config.sync_cycles={FLAGS.sync_cycles}"]
  proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT)
  deadline = time.time() + 1200
  while time.time() < deadline:
    if proc.poll() is not None:
      raise SystemExit(f"serve.py exited with {proc.returncode}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
        return proc
    except OSError:
      time.sleep(1)
  proc.kill()
  raise SystemExit("serve.py did not come up")


def _requests(prompts) -> list[dict]:
  rng = np.random.default_rng(0)
  out = []
  for i in range(FLAGS.num_requests):
    sampled = rng.random() < FLAGS.sampled_frac
    body = {"model": "target", "prompt": prompts[i % len(prompts)][1],
            "max_tokens": FLAGS.max_new_tokens, "stream": bool(rng.random() < FLAGS.stream_frac),
            "temperature": 0.8 if sampled else 0.0, "seed": i}
    if sampled:
      body["top_p"] = 0.95
    if body["stream"]:
      body["stream_options"] = {"include_usage": True}
    out.append(body)
  return out


def _send(port: int, i: int, body: dict) -> dict:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  t0 = time.perf_counter()
  conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
  resp = conn.getresponse()
  rec = {"i": i, "status": resp.status, "stream": body["stream"]}
  if not body["stream"]:
    data = json.loads(resp.read())
    rec.update(ttft=time.perf_counter() - t0, id=data.get("id"),
               text=data["choices"][0]["text"], tokens=data["usage"]["completion_tokens"])
    return rec
  parts, times, ids, usage = [], [], set(), {}
  while True:
    line = resp.readline()
    if not line:
      break
    if not line.startswith(b"data: "):
      continue
    payload = line[6:].strip()
    if payload == b"[DONE]":
      break
    chunk = json.loads(payload)
    ids.add(chunk["id"])
    usage = chunk.get("usage") or usage
    text = chunk["choices"][0]["text"] if chunk["choices"] else ""
    if text:
      parts.append(text)
      times.append(time.perf_counter() - t0)
  conn.close()
  rec.update(ttft=times[0] if times else time.perf_counter() - t0, id=ids.pop() if len(ids) == 1
             else None, text="".join(parts), chunk_times=times, chunks=parts,
             tokens=usage.get("completion_tokens"))
  return rec


def main(_):
  from bp_jax.text.tokenizer import load_tokenizer
  from configs import demo  # noqa: F401  (the prompt split's config)
  tok = load_tokenizer("demo/target")
  prompts = common.demo_prompts(tok, "eval")
  room = FLAGS.max_len - FLAGS.max_new_tokens - 16
  prompts = [(k, ids) for k, ids in prompts if len(ids) <= room]
  bodies = _requests(prompts)

  port = _free_port()
  proc = _start_server(port)
  try:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(FLAGS.concurrency) as pool:
      recs = list(pool.map(lambda ib: _send(port, *ib), enumerate(bodies)))
    wall = time.perf_counter() - t0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
      metrics_text = r.read().decode()
  finally:
    proc.terminate()
    proc.wait(120)

  # Nothing lost or duplicated.
  assert len(recs) == len(bodies) and sorted(r["i"] for r in recs) == list(range(len(bodies)))
  assert all(r["status"] == 200 for r in recs), [r for r in recs if r["status"] != 200][:3]
  assert len({r["id"] for r in recs}) == len(recs) and None not in {r["id"] for r in recs}

  # The baseline: the same requests through the engine, as decode.py decodes them.
  from ml_collections import config_flags  # noqa: F401
  from bp_jax import cli as bp_cli
  from bp_jax.decode_job import run as run_decode
  from bp_jax.models.precision import matmul_precision, precision_of
  from bp_jax.text.tokenizer import stop_token_ids
  cfg = bp_cli.load_config(FLAGS.config)
  cfg.max_len, cfg.batch_size, cfg.sync_cycles = FLAGS.max_len, FLAGS.batch_size, FLAGS.sync_cycles
  stops = set(stop_token_ids(tok))
  with matmul_precision(precision_of(cfg)):
    engine, _, _ = run_decode.build_engine(cfg)
    b = int(cfg.block_size) if cfg.mode == "spec" else 1
    kw = dict(max_new_tokens=FLAGS.max_new_tokens, block_size=b,
              seeds=[x["seed"] for x in bodies],
              temperature=[x["temperature"] for x in bodies],
              top_p=[x.get("top_p", 1.0) for x in bodies])
    engine.generate_batch([x["prompt"] for x in bodies[:FLAGS.batch_size]],
                          **{k: (v[:FLAGS.batch_size] if isinstance(v, list) else v)
                             for k, v in kw.items()})  # compile and warm
    t1 = time.perf_counter()
    gens = engine.generate_batch([x["prompt"] for x in bodies], **kw)
    engine_wall = time.perf_counter() - t1
  engine_tokens = sum(len(g.output_ids) for g in gens)

  greedy_ok = greedy_n = 0
  mismatches = []
  for rec, body, g in zip(recs, bodies, gens):
    if body["temperature"] == 0:
      greedy_n += 1
      expected = tok.decode([t for t in g.output_ids if t not in stops])
      if rec["text"] == expected:
        greedy_ok += 1
      else:
        mismatches.append(rec["i"])
  server_tokens = sum(r["tokens"] for r in recs)
  ttft = [r["ttft"] for r in recs if r["stream"]]
  itl = []
  for r in recs:
    if r["stream"] and len(r["chunk_times"]) > 1:
      for (a, b_), text in zip(zip(r["chunk_times"], r["chunk_times"][1:]), r["chunks"][1:]):
        n = max(1, len(tok.encode(text, add_special_tokens=False)))
        itl.append((b_ - a) / n)
  pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 1) if xs else None
  result = {
      "command": common.command_line(),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.platform()})",
      "requests": len(recs), "concurrency": FLAGS.concurrency, "batch_size": FLAGS.batch_size,
      "max_new_tokens": FLAGS.max_new_tokens, "max_len": FLAGS.max_len,
      "streamed": sum(r["stream"] for r in recs),
      "greedy": greedy_n, "greedy_identical": greedy_ok, "greedy_mismatches": mismatches,
      "lost_or_duplicated": 0,
      "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
      "inter_token_ms_p50": pct(itl, 50), "inter_token_ms_p99": pct(itl, 99),
      "server_wall_s": round(wall, 2), "server_tokens": server_tokens,
      "server_tokens_per_s": round(server_tokens / wall, 2),
      "engine_wall_s": round(engine_wall, 2), "engine_tokens": engine_tokens,
      "engine_tokens_per_s": round(engine_tokens / engine_wall, 2),
      "throughput_ratio": round((server_tokens / wall) / (engine_tokens / engine_wall), 3),
      "server_metrics": {k: v for k, v in __import__(
          "bp_jax.serving.metrics", fromlist=["parse"]).parse(metrics_text).items()
          if "tau" in k or "per_forward" in k or "compilations" in k or "cancelled" in k
          or "let_go" in k},
  }
  common.write_json(os.path.join(FLAGS.out, "serve_load.json"), result)
  print(json.dumps(result, indent=2))
  assert greedy_ok == greedy_n, f"greedy outputs differ for requests {mismatches}"


if __name__ == "__main__":
  cli.run(main, __doc__)
