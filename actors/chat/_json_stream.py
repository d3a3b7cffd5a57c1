"""An incremental JSON reader: text in, piece by piece; where each value starts and ends out.

Pure Python, one object per reply (the engine thread feeds it one token's text at a
time). Each character is looked at once, so a reply costs time in proportion to its
length, never to its length squared.

The reader reports, for every value whose path is at most :data:`MAX_DEPTH` deep,
``("start", path, offset)`` and ``("end", path, offset)`` (offsets into the text fed so
far, end exclusive), and for string values whose path ``decode`` accepts, their decoded
characters as ``("chars", path, text)``. A path is the keys and indexes from the root:
``("tool_calls", 0, "name")``. A ``\\u`` surrogate pair decodes to its one
character, a lone surrogate to U+FFFD (UTF-8 cannot carry it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["MAX_DEPTH", "JsonError", "JsonReader", "Path"]

Path = tuple[str | int, ...]

MAX_DEPTH = 4
"""Values deeper than this are read but not reported (a call's arguments are one value)."""

_WS = frozenset(" \t\r\n")
_SCALAR = frozenset("0123456789+-.eEtrufalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonError(ValueError):
    """The text is not JSON (the reader stops at the first character that cannot be).

    ``offset`` is that character's offset in all the text fed (for a number or
    literal that is not one, the character that ended it; the text's end at
    :meth:`JsonReader.finish`), and ``events`` what the piece completed before it.
    """

    offset: int = -1
    events: tuple[tuple[str, Path, object], ...] = ()


@dataclass(slots=True)
class _Frame:
    container: str  # "{" or "["
    key: str | int | None = None
    expect: str = "key"  # in an object: key, colon, value, comma; in an array: value, comma
    empty: bool = True  # no member yet: it may close at once


class JsonReader:
    """Reads one JSON value from text fed in pieces (see the module's docstring).

    ``done`` turns True when the value is complete; ``consumed`` is then the offset just
    past it in all the text fed (what follows the value is left to the caller).
    """

    def __init__(self, decode: Callable[[Path], bool] = lambda path: False) -> None:
        self._decode = decode
        self._stack: list[_Frame] = []
        self._offset = 0
        self._state = "value"  # value, string, escape, unicode, scalar, after
        self._is_key = False
        self._key_chars: list[str] = []
        self._decoding = False
        self._unicode = ""
        self._high: int | None = None  # a \\u high surrogate waiting for its low half
        self._scalar: list[str] = []
        self.done = False
        self.consumed = 0

    @property
    def fed(self) -> int:
        """How many characters were fed so far."""
        return self._offset

    def _path(self) -> Path:
        return tuple(f.key for f in self._stack)  # type: ignore[misc]

    def feed(self, text: str) -> list[tuple[str, Path, object]]:
        """Read ``text``; the events it completes, in order.

        Raises:
            JsonError: the text cannot continue a JSON value.
        """
        events: list[tuple[str, Path, object]] = []
        chars: list[str] = []  # decoded characters of the string being read, this feed
        try:
            self._read(text, events, chars)
        except JsonError as e:
            if chars:
                events.append(("chars", self._path(), "".join(chars)))
            e.events = tuple(events)
            raise
        self._offset += len(text)
        if chars:
            events.append(("chars", self._path(), "".join(chars)))
        return events

    def _read(self, text: str, events: list[tuple[str, Path, object]], chars: list[str]) -> None:
        i = 0
        try:
            for i, c in enumerate(text):
                if self.done:
                    break
                pos = self._offset + i
                state = self._state
                if state == "string_high":  # a \\u high surrogate waits for its low half
                    if c == "\\":
                        self._state = "escape"
                        continue
                    self._flush_high(chars)
                    self._state = state = "string"
                if state == "string":
                    if c == '"':
                        self._close_string(events, chars, pos)
                    elif c == "\\":
                        self._state = "escape"
                    elif c < " ":
                        raise JsonError("a control character inside a JSON string")
                    elif self._is_key:
                        self._key_chars.append(c)
                    elif self._decoding:
                        chars.append(c)
                    continue
                if state == "escape":
                    if c == "u":
                        self._state, self._unicode = "unicode", ""
                        continue
                    if c not in _ESCAPES:
                        raise JsonError(f"a bad escape \\{c} in a JSON string")
                    self._flush_high(chars)
                    self._string_char(_ESCAPES[c], chars)
                    self._state = "string"
                    continue
                if state == "unicode":
                    if c not in "0123456789abcdefABCDEF":
                        raise JsonError("a bad \\u escape in a JSON string")
                    self._unicode += c
                    if len(self._unicode) == 4:
                        self._unicode_char(int(self._unicode, 16), chars)
                    continue
                if state == "scalar":
                    if c in _SCALAR:
                        self._scalar.append(c)
                        continue
                    self._end_value(events, pos)
                    state = self._state  # then this character is read as what follows
                if c in _WS:
                    continue
                if state == "value":
                    self._start_value(c, events, pos)
                else:  # after a key, a value, or a container's opening
                    self._punctuation(c, events, pos)
        except JsonError as e:
            e.offset = self._offset + i
            raise

    def finish(self) -> list[tuple[str, Path, object]]:
        """The text has ended: a top-level number or literal ends with it."""
        events: list[tuple[str, Path, object]] = []
        if self._state == "scalar" and not self._stack:
            try:
                self._end_value(events, self._offset)
            except JsonError as e:
                e.offset = self._offset
                raise
        return events

    def between_items(self, depth: int) -> bool:
        """Whether the reader is in an array ``depth`` containers deep, right after one
        of its items (a comma or the array's end is next)."""
        if self.done or self._state != "after" or len(self._stack) != depth:
            return False
        frame = self._stack[-1]
        return frame.container == "[" and frame.expect == "comma"

    def closing(self) -> str | None:
        """The shortest text that completes the value from here (``'"}}'`` inside a
        string two objects deep; ``""`` once it is done), or None where only more of
        the value can (a key, or a value after a colon or a comma, is awaited; an
        escape or a number is half written)."""
        if self.done:
            return ""
        state, text = self._state, ""
        if state in ("string", "string_high") and not self._is_key:
            text = '"'
        elif state == "scalar":
            try:
                json.loads("".join(self._scalar))
            except ValueError:
                return None
        elif state == "after" and self._stack:
            frame = self._stack[-1]
            if not (frame.expect == "comma" or (frame.empty and frame.expect in ("key", "value"))):
                return None
        else:
            return None
        return text + "".join("}" if f.container == "{" else "]" for f in reversed(self._stack))

    def _unicode_char(self, code: int, chars: list[str]) -> None:
        """A ``\\uXXXX`` escape: a surrogate pair joins into one character; a lone
        surrogate (which no UTF-8 text can hold) becomes U+FFFD."""
        high, self._high = self._high, None
        self._state = "string"
        if high is not None and 0xDC00 <= code < 0xE000:
            self._string_char(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)), chars)
            return
        if high is not None:
            self._string_char("\ufffd", chars)
        if 0xD800 <= code < 0xDC00:
            self._high, self._state = code, "string_high"
        else:
            self._string_char("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code), chars)

    def _flush_high(self, chars: list[str]) -> None:
        if self._high is not None:
            self._high = None
            self._string_char("\ufffd", chars)

    def _string_char(self, c: str, chars: list[str]) -> None:
        if self._is_key:
            self._key_chars.append(c)
        elif self._decoding:
            chars.append(c)

    def _close_string(self, events: list[tuple[str, Path, object]], chars: list[str], pos: int) -> None:
        if self._is_key:
            frame = self._stack[-1]
            frame.key, frame.expect = "".join(self._key_chars), "colon"
            self._key_chars, self._is_key = [], False
            self._state = "after"
            return
        if chars:
            events.append(("chars", self._path(), "".join(chars)))
            chars.clear()
        self._decoding = False
        self._end_value(events, pos + 1)

    def _start_value(self, c: str, events: list[tuple[str, Path, object]], pos: int) -> None:
        path = self._path()
        if len(path) <= MAX_DEPTH:
            events.append(("start", path, pos))
        if c == "{" or c == "[":
            self._stack.append(_Frame(c, None if c == "{" else 0, "key" if c == "{" else "value"))
            self._state = "after"
        elif c == '"':
            self._state, self._is_key = "string", False
            self._decoding = len(path) <= MAX_DEPTH and self._decode(path)
        elif c in _SCALAR:
            self._state, self._scalar = "scalar", [c]
        else:
            raise JsonError(f"{c!r} cannot start a JSON value")

    def _end_value(self, events: list[tuple[str, Path, object]], end: int) -> None:
        if self._state == "scalar":
            # Checked whole, once: its characters were only collected by class.
            try:
                json.loads("".join(self._scalar))
            except ValueError:
                raise JsonError(f"{''.join(self._scalar)[:20]!r} is not a JSON number or literal") from None
        path = self._path()
        if len(path) <= MAX_DEPTH:
            events.append(("end", path, end))
        self._state = "after"
        if not self._stack:
            self.done, self.consumed = True, end
            return
        self._stack[-1].expect, self._stack[-1].empty = "comma", False

    def _punctuation(self, c: str, events: list[tuple[str, Path, object]], pos: int) -> None:
        frame = self._stack[-1]
        expect = frame.expect
        if frame.container == "{":
            if expect == "key" and c == '"':
                self._state, self._is_key = "string", True
                return
            if expect == "colon" and c == ":":
                frame.expect, self._state = "value", "value"
                return
            if expect == "comma" and c == ",":
                frame.expect, frame.key = "key", None
                return
            if c == "}" and (expect == "comma" or (expect == "key" and frame.empty)):
                self._close_container(events, pos)
                return
        else:
            if expect == "comma" and c == ",":
                assert isinstance(frame.key, int)
                frame.key += 1
                frame.expect, self._state = "value", "value"
                return
            if c == "]" and (expect == "comma" or frame.empty):
                self._close_container(events, pos)
                return
            if expect == "value":
                self._state = "value"
                self._start_value(c, events, pos)
                return
        raise JsonError(f"{c!r} cannot follow here in JSON")

    def _close_container(self, events: list[tuple[str, Path, object]], pos: int) -> None:
        self._stack.pop()
        self._end_value(events, pos + 1)
