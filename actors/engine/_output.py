"""From generated token bytes to the text a caller sees: UTF-8, then stop strings.

Pure Python, no llama.cpp; used by the engine thread, one object per request.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["StopMatcher", "TextStream"]


class StopMatcher:
    """Finds the earliest stop string in streamed text, holding back what might start one.

    ``feed(text)`` returns the text that can be released and the stop string that
    matched, if any. Text is held back while its end could be the start of a stop
    string and released as soon as it cannot; so no stop string can begin in text that
    was already released, and matches that span pieces, overlap each other or repeat
    a prefix (``"aab"`` against ``"ab"``) are found.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        # Every proper prefix of every stop string: what a held-back tail may be.
        self._prefixes = {stop[:i] for stop in self.stops for i in range(1, len(stop))}
        self._longest = max((len(stop) for stop in self.stops), default=0)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        buffer = self.held + text
        match: tuple[int, str] | None = None
        for stop in self.stops:
            i = buffer.find(stop)
            if i >= 0 and (match is None or i < match[0] or (i == match[0] and len(stop) > len(match[1]))):
                match = (i, stop)
        if match is not None:
            self.held = ""
            return buffer[: match[0]], match[1]
        keep = 0
        for k in range(min(len(buffer), self._longest - 1), 0, -1):
            if buffer[-k:] in self._prefixes:
                keep = k
                break
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Release what is held (the request ended another way)."""
        held, self.held = self.held, ""
        return held


class TextStream:
    """Turns each generated token's bytes into a releasable text piece.

    A multi-byte character split over tokens is held until complete; bytes that never
    complete become U+FFFD at :meth:`flush`. Stop strings are only looked for once
    ``min_tokens`` tokens have been generated; text before that passes straight on.
    """

    def __init__(self, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._matcher = StopMatcher(stops) if stops else None
        self._min_tokens = min_tokens
        self._n_tokens = 0

    def push(self, piece: bytes) -> tuple[str, str | None]:
        """Add one token's bytes; returns (text to release, stop string matched or None)."""
        self._n_tokens += 1
        text = self._decoder.decode(piece)
        if self._matcher is None or self._n_tokens <= self._min_tokens:
            return text, None
        return self._matcher.feed(text)

    def flush(self) -> str:
        """Everything held back, at a finish other than a stop string."""
        text = self._matcher.flush() if self._matcher is not None else ""
        return text + self._decoder.decode(b"", final=True)
