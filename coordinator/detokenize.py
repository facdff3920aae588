"""Incremental detokenisation: text deltas of a growing list of committed tokens.

Decoding only a window of recent tokens keeps the cost per step constant, but a token boundary
is not always a character boundary (byte-level BPE splits multi-byte UTF-8 characters), so the
window's text is taken only once it no longer ends in U+FFFD (an incomplete character), and
it is measured against the decode of the same window start so decoders that treat a leading
token specially (SentencePiece's leading space) stay consistent.

Stop strings are cut as the engine cuts them (at the start of the earliest match), so a delta
never includes a suffix that could still grow into a stop string: that suffix is held back until
it can no longer match or the request finishes. The last delta is taken against the engine's
own final text, which is the truth.

Example:
    >>> d = IncrementalDetokenizer(lambda ids: "".join(chr(96 + i) for i in ids), stop=("cd",))
    >>> d.push([1, 2]), d.push([3]), d.finish("ab")
    ('ab', '', '')
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix = 0  # window start: text of tokens before it is settled
        self._read = 0  # tokens whose text is in self._text
        self._text = ""  # settled text: emitted, then held back
        self._emitted = 0  # characters of self._text already returned

    def push(self, token_ids: Sequence[int]) -> str:
        """Append committed tokens; returns the text that is now safe to send."""
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        end = len(self._text) - self._stop_prefix_len()
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the engine's output text) after what was already sent."""
        sent = self._text[: self._emitted]
        if not final_text.startswith(sent):
            # Only a decoder whose window text differs from the full decode gets here; the
            # client then sees deltas that do not add up to the final text. Log it loudly.
            logger.error("streamed text %r is not a prefix of the final text %r", sent, final_text)
            return final_text[len(sent) :] if len(final_text) > len(sent) else ""
        return final_text[len(sent) :]

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
