"""The README's front door cannot rot: its Python API example runs on the demo (and decodes what
plain decoding does), and every relative link in README.md and docs/ points at a file."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
  with open(os.path.join(REPO, "README.md")) as f:
    return f.read()


def test_readme_is_short():
  assert len(_readme().splitlines()) <= 250


def test_the_python_api_example_runs_on_the_demo(monkeypatch):
  section = _readme().split("## Python API", 1)[1]
  code = section.split("```python\n", 1)[1].split("```", 1)[0]
  assert len(code.strip().splitlines()) <= 8, code
  monkeypatch.chdir(REPO)
  scope: dict = {}
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(code, "README.md", "exec"), scope)
  out = scope["out"]
  assert out.new_tokens > 0 and out.tau is not None and "(tau " in printed.getvalue()
  from bp_jax import Engine, ShapeOptions, encode_prompt
  plain = Engine(scope["target"], shapes=ShapeOptions(max_len=640, block_sizes=(1,))).generate(
      encode_prompt(scope["tokenizer"], "def fibonacci(n):", False), max_new_tokens=64,
      block_size=1)
  assert out.output_ids == plain.output_ids


def test_every_relative_link_resolves():
  files = [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                        recursive=True)
  broken = []
  for path in files:
    with open(path) as f:
      text = f.read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+://|#|mailto:", target):
        continue
      resolved = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
      if not os.path.exists(resolved):
        broken.append(f"{os.path.relpath(path, REPO)}: {target}")
  assert broken == []
