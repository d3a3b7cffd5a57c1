"""A region of calls written as JSON objects that hold their name and arguments.

Hermes' ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Mistral's and
Command R7B's arrays of calls, Llama 3.x's bare object, and the generic format's
whole reply (``{"tool_calls": [...]}`` or ``{"response": ...}``) are read here, by one
:class:`~actors.chat._json_stream.JsonReader` per region: each character is read
once, and the region's text is kept in its pieces, sliced where an event points.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass

from actors.chat._calls import CallLog, Out, Step, held_prefix
from actors.chat._json_stream import JsonError, JsonReader, Path
from actors.chat._syntax import Syntax

__all__ = ["JsonRegion"]


class _Text:
    """A region's text, kept as the pieces it came in: a slice joins only the pieces
    it overlaps, so streaming arguments never copies the whole region per piece."""

    __slots__ = ("_pieces", "_starts", "length")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._starts.append(self.length)
            self.length += len(piece)

    def slice(self, start: int, end: int) -> str:
        if end <= start:
            return ""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        parts = []
        while i < len(self._pieces) and self._starts[i] < end:
            at = self._starts[i]
            parts.append(self._pieces[i][max(start - at, 0) : end - at])
            i += 1
        return "".join(parts)

    def whole(self) -> str:
        return "".join(self._pieces)


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: str | None = None
    name_start: int = -1  # offset of the name's string in the region
    args_start: int = -1  # offset of the arguments' value in the region, -1 before it
    args_end: int = -1
    args_sent: int = 0  # characters of the arguments released so far
    args_kind: str = ""  # the arguments' first character: "{" streams, '"' is decoded at its end
    args_text: str | None = None  # arguments written as a JSON string: its decoded text
    index: int = -1  # its index in the reply, once announced (its name known)

    @property
    def announced(self) -> bool:
        return self.index >= 0


class JsonRegion:
    """Reads one JSON region (a :class:`~actors.chat._calls.Region`).

    Args:
        syntax: the format (its keys, its body, its closing marker).
        log: the reply's calls.
        marker: the text that opened the region (given back if it is no call).
        gap: the whitespace before the marker (given back likewise).
    """

    def __init__(self, syntax: Syntax, log: CallLog, marker: str = "", gap: str = "") -> None:
        self._syntax = syntax
        self._log = log
        wants = ("response",) if syntax.json_reply else ()
        self._reader = JsonReader(decode=lambda path: path == wants)
        self._text = _Text()
        self._calls: dict[Path, _Call] = {}
        self._marker = marker
        self._gap = gap
        self._response_start = -1  # the generic format's answer, when it is not a string
        self._after = ""  # text after the JSON value, while its closing marker is awaited

    def feed(self, text: str, out: Out) -> Step:
        reader = self._reader
        if reader.done:
            return self._after_value(text, final=False)
        base = self._text.length
        try:
            events = reader.feed(text)
        except JsonError as e:
            cut = e.offset - base
            self._text.append(text[:cut])
            self._read(list(e.events), out)  # what came before the break counts
            return self._broken(text[cut:])
        used = text if not reader.done else text[: reader.consumed - base]
        self._text.append(used)
        self._read(events, out)
        if reader.done:
            return self._after_value(text[len(used) :], final=False)
        return ("more", "")

    def finish(self, out: Out) -> Step:
        if not self._reader.done:
            try:
                events = self._reader.finish()
            except JsonError:
                return self._broken()
            self._read(events, out)
        if self._reader.done:
            return self._after_value("", final=True)
        return self._broken()

    @property
    def after_call(self) -> bool:
        # Its calls are written and only its closing marker is due, or a call in its
        # array of calls just ended (another, or the array's end, is next).
        reader = self._reader
        return reader.done or any(
            call.args_end >= 0 and reader.between_items(len(path)) for path, call in self._calls.items()
        )

    def closing(self) -> str | None:
        closer = "" if self._syntax.json_reply else (self._syntax.call_close or "")
        if not self._reader.done:
            head = self._reader.closing()
            return None if head is None else head + closer
        after = self._after.lstrip()  # the closing marker's start, written so far
        return closer[len(after) :] if closer and closer.startswith(after) else None

    def _read(self, events: list[tuple[str, Path, object]], out: Out) -> None:
        for kind, path, value in events:
            self._on_event(kind, path, value, out)
        self._send_args(self._text.length, out)

    def _call_at(self, path: Path) -> bool:
        """Whether a JSON object at ``path`` (in the region) is a call."""
        syntax = self._syntax
        if syntax.json_reply:
            return (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int)) or path == (
                "tool_call",
            )
        if syntax.body == "array":
            return len(path) == 1 and isinstance(path[0], int)
        return path == ()

    def _on_event(self, kind: str, path: Path, value: object, out: Out) -> None:
        syntax = self._syntax
        text = self._text
        if kind == "chars":
            if syntax.json_reply and path == ("response",):
                out.content.append(str(value))
            return
        assert isinstance(value, int)
        offset = value
        if kind == "start":
            first = text.slice(offset, offset + 1)
            if self._call_at(path) and first == "{":
                self._calls[path] = _Call()
            elif path and path[:-1] in self._calls:
                call = self._calls[path[:-1]]
                if path[-1] == syntax.name_key and call.name_start < 0:
                    call.name_start = offset
                elif path[-1] in syntax.args_keys and call.args_start < 0 and first in ("{", '"'):
                    call.args_start, call.args_kind = offset, first
            elif syntax.json_reply and path == ("response",) and first != '"':
                self._response_start = offset  # an object under response_format: its JSON text
            return
        # kind == "end"
        if path and path[:-1] in self._calls:
            call = self._calls[path[:-1]]
            key = path[-1]
            if key == syntax.name_key and call.name is None:
                try:
                    name = json.loads(text.slice(call.name_start, offset))
                except ValueError:
                    name = None
                if isinstance(name, str) and name:
                    call.name = name
                    call.index, call.id = self._log.announce(name, out)
            elif key in syntax.args_keys and call.args_start >= 0 and call.args_end < 0:
                call.args_end = offset
                if call.args_kind == '"':
                    call.args_text = _object_text(text.slice(call.args_start, offset))
        elif path in self._calls:
            call = self._calls[path]
            # A call object closed: it is complete if it named a function and its
            # arguments; with no arguments at all, they are an empty object.
            if call.name is not None and call.args_start < 0:
                self._log.args(call.index, "{}", out)
                self._log.complete(call.id, call.name, "{}")
                return
            if call.name is None or call.args_end < 0:
                return
            if call.args_kind == "{":
                self._send_args(call.args_end, out)
                self._log.complete(call.id, call.name, text.slice(call.args_start, call.args_end))
            elif call.args_text is not None:
                self._log.args(call.index, call.args_text, out)
                self._log.complete(call.id, call.name, call.args_text)
        elif syntax.json_reply and path == ("response",) and self._response_start >= 0:
            out.content.append(text.slice(self._response_start, offset))

    def _send_args(self, length: int, out: Out) -> None:
        for call in self._calls.values():
            if not call.announced or call.args_kind != "{":
                continue
            end = call.args_end if call.args_end >= 0 else length
            start = call.args_start + call.args_sent
            if end > start:
                self._log.args(call.index, self._text.slice(start, end), out)
                call.args_sent = end - call.args_start

    def _after_value(self, text: str, *, final: bool) -> Step:
        """The region's JSON is complete: expect its closing marker, then go on."""
        buffer = self._after + text
        self._after = ""
        if not self._syntax.json_reply and not any(c.announced for c in self._calls.values()):
            # JSON, but no call in it (a model quoting JSON after the marker): content.
            return ("broken", self._gap + self._marker + self._text.whole() + buffer)
        closer = self._syntax.call_close
        if closer:
            stripped = buffer.lstrip()
            if stripped.startswith(closer):
                return ("done", stripped[len(closer) :])
            if not final and held_prefix(stripped, (closer,)) == len(stripped):
                self._after = buffer
                return ("more", "")
            # No closing marker: the calls stand; what follows is content.
        return ("done", buffer)

    def _broken(self, tail: str = "") -> Step:
        """The region is not a call after all (or was cut off); ``tail`` is the
        text from the character that broke it on."""
        announced = [c for c in self._calls.values() if c.announced]
        finished = [c for c in announced if c.args_end >= 0]
        if announced and len(finished) == len(announced) and self._log.done:
            return ("done", tail)  # every call it announced is complete: they stand
        if announced:
            return ("broken", tail)  # a call was announced: its text cannot be taken back
        text = self._gap + self._marker + self._text.whole() + tail
        return ("broken", text if text.strip() else "")


def _object_text(literal: str) -> str | None:
    """The text of a JSON string literal when it is itself a JSON object's text (a
    model that wrote its arguments as a string), else None."""
    try:
        text = json.loads(literal)
        return text if isinstance(text, str) and isinstance(json.loads(text), dict) else None
    except ValueError:
        return None
