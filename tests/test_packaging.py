"""`pip install .` installs the whole package: a wheel built from the checkout imports the
engine outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_packages() -> set[str]:
  """Dotted names of bp_jax and of every sub-package in the checkout (a new one included)."""
  out = set()
  for folder, dirs, files in os.walk(os.path.join(REPO, "bp_jax")):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    if "__init__.py" in files:
      out.add(os.path.relpath(folder, REPO).replace(os.sep, "."))
  return out


def test_a_wheel_holds_every_subpackage(tmp_path):
  wheels, target, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
  # A copy of what the build reads, so that building leaves nothing in the checkout.
  shutil.copytree(os.path.join(REPO, "bp_jax"), src / "bp_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(os.path.join(REPO, "pyproject.toml"), src)
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
  subprocess.run(pip + ["wheel", str(src), "--no-deps", "--no-build-isolation", "-w",
                        str(wheels)], check=True, capture_output=True, cwd=tmp_path)
  (wheel,) = wheels.glob("bp_jax-*.whl")
  with zipfile.ZipFile(wheel) as z:
    in_wheel = {os.path.dirname(n).replace("/", ".") for n in z.namelist()
                if n.endswith("/__init__.py")}
  assert _source_packages() <= in_wheel, sorted(_source_packages() - in_wheel)
  subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)],
                 check=True, capture_output=True, cwd=tmp_path)
  check = ("import bp_jax, bp_jax.decoding.engine, bp_jax.models.qwen3, bp_jax.weights.loading, "
           "bp_jax.policy.mlp, bp_jax.text.tokenizer, bp_jax.eval.bootstrap, bp_jax.parallel.rules\n"
           "from bp_jax import Engine\n"
           "print(bp_jax.__file__)")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True,
                       text=True, env={**env, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().startswith(str(target)), out.stdout  # the wheel's copy, not the repo
