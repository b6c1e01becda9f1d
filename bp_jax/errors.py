"""Errors raised for bad user input: each names the file, key, parameter or flag at fault."""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator


class BadInputError(ValueError):
  """A user-supplied file, key, flag or prompt is invalid; the message says which and why."""


@contextlib.contextmanager
def named_as_flags(names: Iterable[str], prefix: str = "--config.") -> Iterator[None]:
  """At the command-line edge: a `BadInputError` raised inside names the library's parameters
  (`ar_fallback=-1 ...`); re-raised, it names the flags the user typed (`--config.ar_fallback=-1
  ...`) for each of `names`."""
  try:
    yield
  except BadInputError as e:
    msg = str(e)
    for name in names:
      msg = re.sub(rf"(?<![\w.-]){re.escape(name)}=", f"{prefix}{name}=", msg)
    raise BadInputError(msg) from None
