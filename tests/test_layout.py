"""The package layout's rules: inference code loads no training code (read statically, every
import including those inside functions, and at run time), no import cycle between modules or
between sub-packages, and the public API is importable from `bp_jax` itself."""

from __future__ import annotations

import os
import subprocess
import sys

import layout_rules

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import importlib, pkgutil, sys
import bp_jax
from bp_jax.decode_job import run as run_decode  # decode.py's whole path, before anything else
print(sorted(m for m in sys.modules if m.startswith("tensorflow")))
for pkg in ("bp_jax.models", "bp_jax.decoding", "bp_jax.policy", "bp_jax.weights", "bp_jax.text",
            "bp_jax.parallel"):
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


def test_no_inference_module_imports_training_code_anywhere():
  """Statically, imports inside functions included: models/ weights/ decoding/ policy/ text/
  parallel/ import nothing of train/, data/ or TensorFlow; decode.py's job imports no training
  code, and reads label sets (data/) inside a function only."""
  assert layout_rules.violations(REPO) == []


def test_no_import_cycles_between_modules_or_subpackages():
  assert layout_rules.cycles(REPO, top_only=False) == []
  packages = layout_rules.package_graph(REPO)
  assert layout_rules.package_cycles(packages) == [], packages


def _write(root, name: str, text: str) -> None:
  path = root / (name.replace(".", "/") + ".py")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_the_rules_catch_hidden_imports_and_cycles(tmp_path):
  """The checker itself: a function-level import of training data from decoding/, and a cycle
  hidden behind a function-level import, are both found."""
  for pkg in ("bp_jax", "bp_jax.decoding", "bp_jax.policy", "bp_jax.data"):
    _write(tmp_path, pkg + ".__init__", "")
  _write(tmp_path, "bp_jax.data.sets", "import tensorflow_datasets as tfds\n")
  _write(tmp_path, "bp_jax.decoding.choice",
         "from bp_jax.policy import rules\n\ndef f():\n  from bp_jax.data import sets\n")
  _write(tmp_path, "bp_jax.policy.rules", "def g():\n  from bp_jax.decoding import choice\n")
  bad = layout_rules.violations(str(tmp_path))
  assert bad == ["bp_jax.decoding.choice imports bp_jax.data.sets (inside a function, line 4)"]
  assert layout_rules.cycles(str(tmp_path), top_only=True) == []
  assert layout_rules.cycles(str(tmp_path), top_only=False) == [
      ["bp_jax.decoding.choice", "bp_jax.policy.rules"]]
  assert layout_rules.package_cycles(layout_rules.package_graph(str(tmp_path))) == [
      ["bp_jax.decoding", "bp_jax.policy"]]
