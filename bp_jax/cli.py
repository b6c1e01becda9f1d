"""The command line's edge, shared by decode.py, train.py and convert_weights.py.

`check_config_fields(default)` (called before the config flag is defined: ml_collections
applies the overrides as it is defined) and `run(main)` (for `absl.app.run(main)`) give a
command two things a user expects:
  * `--help` / `-h` prints the script's usage, its flags and (for scripts with a `--config`
    file) every config field with its value, and exits 0 (absl exits 1);
  * a `--config.<field>` that the config file does not have ends in one line naming the closest
    field, exit status 2 (ml_collections raises a 50-line traceback from inside flag parsing).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Any, Callable, Iterator

HELP_ARGS = ("--help", "-h", "--helpshort", "-?")


def _config_spec(argv: list[str], default: str | None) -> tuple[str | None, str | None]:
  """(the --config file named on the command line, `--config=F[:arg]` or `--config F[:arg]`,
  else `default`; its argument or None)."""
  spec = default
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      spec = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  if spec is None:
    return None, None
  path, _, config_arg = spec.partition(":")
  return path, (config_arg or None)


def load_config(path: str, arg: str | None = None) -> Any:
  """`get_config([arg])` of a config file (a Python file, as ml_collections reads it)."""
  spec = importlib.util.spec_from_file_location("_bp_jax_cli_config", path)
  if spec is None or not os.path.exists(path):
    raise FileNotFoundError(path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def config_fields(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
  """(dotted field, value) of every leaf of a ConfigDict (nested dicts by their dotted path)."""
  for key in sorted(cfg.keys()):
    value = cfg[key]
    if hasattr(value, "keys") and callable(value.keys):
      yield prefix + key, None
      yield from config_fields(value, prefix + key + ".")
    else:
      yield prefix + key, value


def _overridden(argv: list[str]) -> Iterator[str]:
  """The dotted fields that `--config.<field>[=value]` / `--noconfig.<field>` arguments set."""
  for arg in argv:
    for lead in ("--config.", "--noconfig."):
      if arg.startswith(lead):
        yield arg[len(lead):].split("=", 1)[0]


def unknown_field_error(argv: list[str], cfg: Any, path: str) -> str | None:
  """One line naming the first `--config.<field>` that `cfg` lacks and its closest field."""
  fields = [name for name, _ in config_fields(cfg)]
  for name in _overridden(argv):
    if name not in fields:
      close = difflib.get_close_matches(name, fields, n=1, cutoff=0.5)
      hint = f"; did you mean --config.{close[0]}?" if close else \
          f"; see {path} (or --help) for the fields"
      return f"--config.{name} is not a field of {path}{hint}"
  return None


def _help(script: str, doc: str | None, config_default: str | None, argv: list[str]) -> str:
  from absl import flags
  lines = [(doc or "").strip(), "", "flags:", flags.FLAGS.main_module_help().strip()
           or "  (none)"]
  path, config_arg = _config_spec(argv, config_default)
  if path:
    lines += ["", f"config fields of {path} (set any with --config.<field>=value; the file "
              "says what each means):"]
    for name, value in config_fields(load_config(path, config_arg)):
      lines.append(f"  {name}" + ("" if value is None else f" = {value!r}"))
  return "\n".join(lines) + "\n"


def check_config_fields(config_default: str) -> None:
  """Exits with one line (status 2) when the command line sets a config field that the
  --config file lacks, or names a config file that does not exist. Call it before
  `config_flags.DEFINE_config_file`; `--help` skips it (`run` answers it)."""
  argv = sys.argv[1:]
  if any(a in HELP_ARGS for a in argv):
    return
  script = os.path.basename(sys.argv[0])
  path, config_arg = _config_spec(argv, config_default)
  try:
    cfg = load_config(path, config_arg)
  except FileNotFoundError:
    sys.stderr.write(f"{script}: error: --config={path}: no such config file\n")
    sys.exit(2)
  message = unknown_field_error(argv, cfg, path)
  if message:
    sys.stderr.write(f"{script}: error: {message}\n")
    sys.exit(2)


def run(main: Callable, doc: str | None = None, config_default: str | None = None) -> None:
  """`absl.app.run(main)`, except that `--help` prints the usage, the flags and the config
  fields and exits 0, and that a `BadInputError` out of `main` (a file, flag or limit at
  fault) exits 1 with its message, not a traceback."""
  from absl import app
  from bp_jax.errors import BadInputError
  prog = os.path.basename(sys.argv[0])
  if any(a in HELP_ARGS for a in sys.argv[1:]):
    sys.stdout.write(_help(prog, doc, config_default, sys.argv[1:]))
    sys.exit(0)

  def main_or_error(argv):
    try:
      return main(argv)
    except BadInputError as e:
      sys.exit(f"{prog}: error: {e}")
  app.run(main_or_error)
