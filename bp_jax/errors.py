"""Errors raised for bad user input: each names the file, key or flag at fault."""


class BadInputError(ValueError):
  """A user-supplied file, key, flag or prompt is invalid; the message says which and why."""
