"""`serving.textstream.TextStream` with a toy tokenizer (one character per id, ids 0/1 stop):
deltas concatenate to the final text, a stop string ends the text before it (also when it spans
several loop returns), and text that may still change is held back."""

from __future__ import annotations

import pytest

from bp_jax.serving.textstream import TextStream

ALPHABET = "\x00\x01abcdefghij XYZ\ufffd"


class CharTokenizer:
  def encode(self, text, add_special_tokens=False):
    return [ALPHABET.index(c) for c in text]

  def decode(self, ids, skip_special_tokens=False):
    return "".join(ALPHABET[i] for i in ids)


def _run(text: str, steps, stops=(), stop_ids=(0, 1)):
  tok = CharTokenizer()
  ids = tok.encode(text)
  s = TextStream(tok, stops, stop_ids)
  deltas = []
  for end in steps:
    deltas.append(s.update(ids[:end]))
    if s.stopped:
      break
  else:
    deltas.append(s.update(ids, final=True))
  return deltas, s


@pytest.mark.parametrize("steps", [[1, 2, 3], [5], [2, 4, 6, 8, 10]])
def test_deltas_concatenate_and_stop_ids_are_not_text(steps):
  deltas, s = _run("abc def gh\x00", steps)
  assert "".join(deltas) == "abc def gh" == s.sent and not s.stopped


def test_a_stop_string_across_loop_returns_ends_the_text_before_it():
  deltas, s = _run("abc XYZ def", [5, 6, 7, 9], stops=["XYZ"])
  assert s.stopped and "".join(deltas) == "abc "
  # While "X" / "XY" could begin the stop string, they were not sent.
  assert deltas[:2] == ["abc ", ""]


def test_an_incomplete_character_is_held_back():
  deltas, s = _run("ab\ufffdc", [3, 4])
  assert deltas[0] == "ab" and "".join(deltas) == "ab\ufffdc"


def test_the_earliest_of_several_stop_strings_wins():
  deltas, s = _run("abcdefgh", [8], stops=["fg", "cd"])
  assert "".join(deltas) == "ab" and s.stopped
