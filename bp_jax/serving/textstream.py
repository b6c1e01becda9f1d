"""Token ids to text as they come: the deltas a stream sends, and stop strings.

`TextStream.update(ids)` takes a request's generated ids so far (each loop return) and gives the
text to send now. Text is held back while it may still change: an incomplete UTF-8 character at
the end (decoded as U+FFFD), or a tail that could be the start of a stop string. The deltas
always concatenate to the final text, which ends before the first stop string (not included,
as OpenAI does) and leaves out stop tokens.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
  def __init__(self, tokenizer, stop_strings: Sequence[str] = (),
               stop_token_ids: Sequence[int] = ()):
    self.tok = tokenizer
    self.stops = [s for s in stop_strings if s]
    self.stop_ids = set(int(t) for t in stop_token_ids)
    self.sent = ""          # text sent so far
    self.stopped = False    # a stop string was found (the request should end)
    self.n_tokens = 0

  def _text(self, ids: Sequence[int]) -> str:
    ids = list(ids)
    while ids and ids[-1] in self.stop_ids:
      ids.pop()
    return self.tok.decode(ids, skip_special_tokens=False) if ids else ""

  def _cut_at_stop(self, text: str) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)

  def update(self, ids: Sequence[int], final: bool = False) -> str:
    """The new text to send after generated ids `ids` (all of them so far); `final`: the
    request ended, send the rest. Sets `stopped` when a stop string appeared."""
    if self.stopped:
      return ""
    self.n_tokens = len(ids)
    text, self.stopped = self._cut_at_stop(self._text(ids))
    if not (final or self.stopped):
      text = text.rstrip("\ufffd")  # an incomplete multi-byte character
      hold = max((len(s) - 1 for s in self.stops), default=0)
      for k in range(min(hold, len(text)), 0, -1):  # a tail that may start a stop string
        if any(s.startswith(text[-k:]) for s in self.stops):
          text = text[:-k]
          break
    if not text.startswith(self.sent):  # the text changed before what was sent: wait
      return ""
    delta, self.sent = text[len(self.sent):], text
    return delta
