"""The package layout's rules: inference code loads no training code, and the public API is
importable from `bp_jax` itself."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import importlib, pkgutil, sys
import bp_jax
from bp_jax.decoding import run_decode  # decode.py's whole path, before anything else
print(sorted(m for m in sys.modules if m.startswith("tensorflow")))
for pkg in ("bp_jax.models", "bp_jax.decoding", "bp_jax.policy", "bp_jax.weights", "bp_jax.text"):
  mod = importlib.import_module(pkg)
  for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
    importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "bp_jax.train" or m.startswith("bp_jax.train.")))
"""


def test_inference_packages_import_no_training_code():
  """Every module of models/, decoding/, policy/, weights/, text/ (and bp_jax itself) imports
  without loading bp_jax.train; decode.py's path loads no tensorflow(-datasets) either."""
  out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True).stdout
  tf_modules, train_modules = out.strip().splitlines()
  assert train_modules == "[]", train_modules
  assert tf_modules == "[]", tf_modules


def test_public_api():
  import bp_jax
  for name in bp_jax.__all__:
    assert getattr(bp_jax, name) is not None, name
  assert {"Qwen3", "DFlashDrafter", "Engine", "load_target", "load_drafter", "load_policy",
          "BlockPolicy"} <= set(bp_jax.__all__)
