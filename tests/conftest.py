"""Shared fixtures: one tiny transformers/JAX Qwen3 pair, and a runner for the command lines."""

from __future__ import annotations

import faulthandler
import gc
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite's time is mostly XLA:CPU compiling small programs that then run for milliseconds.
# LLVM's optimisation level 0 compiles them in ~0.57x the time with the same tokens, and XLA's
# older elemental emitters (`--xla_cpu_use_fusion_emitters=false`) in ~0.65x of that again
# (docs/results/suite.md); tests time nothing, so they and the scripts they start run so. Each
# executable's code is generated as one module, not split for parallel compilation
# (`--xla_cpu_parallel_codegen_split_count=1`): the same tokens and compile time, and it maps
# ~0.63x the memory regions (99 against 157 per program of the toy engines), so a worker keeps
# more shared programs under its map budget (`decoding/compiled.py`). Set before JAX creates
# its CPU backend (no test module is imported yet); a caller's own choice of any of the three
# flags is kept.
for _flag, _value in (("xla_backend_optimization_level", "0"),
                      ("xla_cpu_use_fusion_emitters", "false"),
                      ("xla_cpu_parallel_codegen_split_count", "1")):
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()

# Python's cyclic collector runs every 700 net allocations by default, and tracing a loop
# allocates millions of objects while the process holds many compiled programs' Python objects,
# so frequent full passes scan them again and again: tests/test_batched_decode.py alone spent
# 2.6-2.9 s in 1,992 collections (2.1-2.3 s in full ones), and 0.55 s in 91 with these
# thresholds, at the same peak memory (docs/results/suite.md).
gc.set_threshold(10_000, 10, 10)


@pytest.fixture(scope="session")
def tiny_pair():
  """(transformers Qwen3ForCausalLM, our Qwen3) with the same random weights (hf_fixtures.TINY:
  V=128, D=64, 3 layers, 4 query heads over 2 kv heads, head_dim 24, rope_theta 1e4)."""
  from hf_fixtures import jax_qwen3_from_torch, make_hf_qwen3
  hf = make_hf_qwen3(seed=0)
  return hf, jax_qwen3_from_torch(hf)


class CliResult:
  def __init__(self, proc: subprocess.CompletedProcess):
    self.rc, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr

  def error_line(self, script: str) -> str:
    """Asserts a clean failure (non-zero exit, no traceback, a single `<script>: error: ...`
    line on stderr) and returns the error from its marker on."""
    assert self.rc != 0, f"expected a failure:\n{self.stdout}\n{self.stderr}"
    assert "Traceback" not in self.stderr, self.stderr
    marker = f"{script}: error: "
    assert self.stderr.count(marker) == 1 and "error:" not in self.stderr.replace(marker, ""), \
        self.stderr
    line = next(l for l in self.stderr.splitlines() if marker in l)
    return line[line.index(marker):]

  def error_is_last_line_of_its_own(self, script: str) -> bool:
    """The error starts its line and nothing (e.g. a progress bar) is printed after it."""
    lines = [l for l in self.stderr.splitlines() if l.strip()]
    return bool(lines) and lines[-1].startswith(f"{script}: error: ")


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_in_tmp(tmp_path_factory):
  """decode.py's and train.py's default compile cache (~/.cache/bp_jax/jax) lives in a folder
  of this test session, for code run in-process as for the scripts (`run_cli`)."""
  old = os.environ.get("XDG_CACHE_HOME")
  os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache_inproc"))
  yield
  if old is None:
    os.environ.pop("XDG_CACHE_HOME", None)
  else:
    os.environ["XDG_CACHE_HOME"] = old


def _run_folder(tmp_path_factory) -> str:
  """A folder shared by every pytest-xdist worker of this run (each worker's base temp is a
  sub-folder `popen-gwN` of the run's folder), or the session's base temp without xdist."""
  base = tmp_path_factory.getbasetemp()
  return str(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session", autouse=True)
def _shared_compile_cache(tmp_path_factory):
  """One persistent JAX compilation cache for the whole run, shared by the xdist workers: tests
  build many engines with the same shapes, and each engine jits its own functions, so the same
  program would otherwise be compiled again in every test (and every worker) that builds one.
  A hit loads the executable the first compilation wrote; `compile_counting.BackendCompiles`
  counts it as the compilation it replaces. Scripts started by `run_cli` keep their own cache."""
  from bp_jax import compile_cache
  compile_cache.enable(os.path.join(_run_folder(tmp_path_factory), "jax_compile_cache"))
  yield


@pytest.fixture(autouse=True)
def _programs_traced_afresh_under_patches(request):
  """Engines share their compiled programs within a process (`compiled.CompiledCache`): a test
  that patches code a program traces (a deliberately wrong rule, a spy counting calls) must
  trace its own, and its patched programs must not reach the tests after it; the programs
  compiled before it stay shared with those (`compiled.shared_programs_set_aside`)."""
  if "monkeypatch" not in request.fixturenames:
    yield
    return
  from bp_jax.decoding.compiled import shared_programs_set_aside
  with shared_programs_set_aside():
    yield


@pytest.fixture(scope="session")
def run_cli(tmp_path_factory):
  """run_cli("decode.py", *flags) -> CliResult; runs a top-level script of the repository. The
  scripts' default compile cache is a folder of this test session (`env` overrides)."""
  cache_home = str(tmp_path_factory.mktemp("xdg_cache"))

  def run(script: str, *args: str, timeout: float = 300, env: dict | None = None) -> CliResult:
    env = {**os.environ, "XDG_CACHE_HOME": cache_home, **(env or {})}
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return CliResult(proc)

  return run


# The files that take longest (setup + calls, docs/results/suite.md), started first: with
# `--dist loadfile` each file runs whole on one worker, and a long file started last would run
# alone at the end while the other worker idles. The rest follow in their usual order.
SLOWEST_FILES = ("test_batched_decode.py", "test_controller.py", "test_labels.py",
                 "test_priced.py", "test_decode_options.py", "test_controllers_bench.py",
                 "test_decode_cli.py", "test_sharding.py", "test_spec_decode.py",
                 "test_drafter_convert.py", "test_rejection_sampling.py",
                 "test_per_request_sampling.py", "test_serve.py")


# A run that stops making progress fails after SUITE_LIMIT_S seconds instead of holding CI until
# its own limit (90 minutes): once a worker crashed, pytest-xdist replaced it and then the other
# workers and the controlling process all waited (docs/results/suite.md). The controlling
# process (or the only one, without xdist) then prints its threads' stacks and exits 1.
# BP_JAX_SUITE_LIMIT_S sets it (0: no limit); a full run takes ~10 minutes on 2 cores.
SUITE_LIMIT_S = 2400.0


def pytest_configure(config):
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return
  text = os.environ.get("BP_JAX_SUITE_LIMIT_S", str(SUITE_LIMIT_S))
  try:
    limit = float(text)
  except ValueError:
    raise pytest.UsageError(f"BP_JAX_SUITE_LIMIT_S={text!r}: expected seconds (0: no limit)")
  if limit > 0:
    faulthandler.dump_traceback_later(limit, exit=True)


def pytest_unconfigure(config):
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))  # stable


@pytest.fixture(scope="session")
def zeros_models():
  """`toy_models.zeros_drafter_pair(64)`: (target, drafter) whose drafter always drafts token 0,
  shared by the modules that decode on it."""
  from toy_models import zeros_drafter_pair
  return zeros_drafter_pair(64)


@pytest.fixture(scope="session")
def zeros_ar_outputs(zeros_models):
  """Plain AR outputs of `toy_models.toy_requests(6)` on `zeros_models`."""
  from toy_models import toy_ar_outputs
  return toy_ar_outputs(zeros_models, 6)
