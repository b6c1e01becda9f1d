"""The package's import graph, read statically (every `import`, at module top or inside a
function), and the layering rules it must obey (tests/test_layout.py)."""

from __future__ import annotations

import ast
import os
from typing import NamedTuple

# Inference code: may not import training code, training datasets or TensorFlow, at all.
INFERENCE = ("bp_jax.models", "bp_jax.weights", "bp_jax.decoding", "bp_jax.policy",
             "bp_jax.text", "bp_jax.parallel")
TRAINING = ("bp_jax.train", "bp_jax.data", "tensorflow_datasets", "tensorflow")
# decode.py's job (the edge): may read label sets for `block_policy=oracle`, inside a function
# only, so that decoding loads no TensorFlow; never training code.
EDGE = ("bp_jax.decode_job",)
# The HTTP server (serve.py's package): the outermost layer. Nothing else in the package may
# import it, and it may import no training code, training datasets or TensorFlow, at all.
SERVING = ("bp_jax.serving",)


class Edge(NamedTuple):
  src: str       # importing module
  dst: str       # imported module (a bp_jax module, or the top-level name of another package)
  top: bool      # at module top (False: inside a function or class body)
  line: int


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
  return any(name == p or name.startswith(p + ".") for p in prefixes)


def modules(repo: str) -> dict[str, str]:
  """bp_jax module name -> file."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(repo, "bp_jax")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        name = os.path.relpath(path, repo)[:-3].replace(os.sep, ".")
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
  return out


def edges(repo: str) -> list[Edge]:
  """Every import of every bp_jax module. `from pkg import name` counts as importing
  `pkg.name` when that is a module, else `pkg`."""
  mods, out = modules(repo), []
  for src, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    top_level = {id(node) for node in tree.body}
    package = src if path.endswith("__init__.py") else src.rpartition(".")[0]
    for node in ast.walk(tree):
      top = id(node) in top_level
      if isinstance(node, ast.Import):
        out += [Edge(src, a.name, top, node.lineno) for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for a in node.names:
          full = f"{base}.{a.name}"
          out.append(Edge(src, full if full in mods else base, top, node.lineno))
  return out


def violations(repo: str) -> list[str]:
  """Imports that break the layering rules, one line each."""
  bad = []
  for e in edges(repo):
    where = f"{e.src} imports {e.dst} ({'module top' if e.top else 'inside a function'}, " \
            f"line {e.line})"
    if _under(e.src, INFERENCE) and _under(e.dst, TRAINING + EDGE):
      bad.append(where)
    elif _under(e.src, EDGE) and (_under(e.dst, ("bp_jax.train", "tensorflow")) or
                                 (e.top and _under(e.dst, TRAINING))):
      bad.append(where)
    elif _under(e.src, SERVING) and _under(e.dst, TRAINING):
      bad.append(where)
    elif not _under(e.src, SERVING) and _under(e.dst, SERVING):
      bad.append(where)
  return bad


def _subpackage(module: str) -> str:
  return ".".join(module.split(".")[:2])


def package_graph(repo: str) -> dict[str, list[str]]:
  """bp_jax sub-package (or top-level module) -> the others it imports, any import."""
  graph: dict[str, set[str]] = {}
  mods = modules(repo)
  for e in edges(repo):
    if e.dst in mods and e.src != "bp_jax" and e.dst != "bp_jax":
      a, b = _subpackage(e.src), _subpackage(e.dst)
      graph.setdefault(a, set())
      if a != b:
        graph[a].add(b)
  return {k: sorted(v) for k, v in sorted(graph.items())}


def package_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
  return strongly_connected(graph)


def cycles(repo: str, top_only: bool) -> list[list[str]]:
  """Import cycles among bp_jax modules (strongly connected components of more than one
  module, or a module importing itself), over module-top imports or over all imports."""
  mods = modules(repo)
  graph: dict[str, set[str]] = {m: set() for m in mods}
  for e in edges(repo):
    if e.dst in mods and (e.top or not top_only):
      graph[e.src].add(e.dst)
  return strongly_connected(graph)


def strongly_connected(graph) -> list[list[str]]:
  """The cycles of a directed graph {node: successors}: its strongly connected components of
  more than one node, and nodes with an edge to themselves."""
  graph = {v: set(ws) for v, ws in graph.items()}
  for ws in list(graph.values()):
    for w in ws:
      graph.setdefault(w, set())
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v: str) -> None:  # Tarjan's algorithm
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in graph[v]:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out
