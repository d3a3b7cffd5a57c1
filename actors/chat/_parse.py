"""A chat reply, split as it streams: content, thinking and tool calls.

:class:`ReplyParser` is fed the reply's text piece by piece (one generated token's
text at a time, in the engine thread) and returns, for each piece, the content,
thinking and tool-call deltas it releases. Each character is scanned a bounded number
of times: no piece re-parses what came before.

Text that could still be the start of a marker (``<tool`` before ``_call>``) is held
back until the next piece tells; at :meth:`ReplyParser.finish` whatever is held is
released as what it turned out to be. A call region that is not valid JSON (a model
writing without a grammar) is given back as content, from its marker on, and no
further calls are looked for.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from actors.chat._json_stream import JsonError, JsonReader, Path
from actors.chat._syntax import Syntax
from actors.contract._results import ToolCall, ToolCallDelta

__all__ = ["Parsed", "ReplyParser", "new_call_id"]

_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: str = "call") -> str:
    """A fresh tool-call id: ``call_`` and 24 letters and digits, or nine of them
    (``"alnum9"``, what Mistral's templates accept)."""
    if style == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Parsed:
    """What one piece of the reply released."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


_NOTHING = Parsed()


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest


@dataclass(slots=True)
class _Call:
    id: str
    name: str | None = None
    args_start: int = -1  # offset of the arguments' value in the region, -1 before it
    args_end: int = -1
    args_sent: int = 0  # characters of the arguments released so far
    index: int = -1  # its index in the reply, once announced (its name known)

    @property
    def announced(self) -> bool:
        return self.index >= 0


@dataclass(slots=True)
class _Region:
    """A JSON region being read: a call region, or the generic format's whole reply."""

    reader: JsonReader
    start: int  # the region's first character, in the reply's text
    raw: list[str] = field(default_factory=list)
    calls: dict[Path, _Call] = field(default_factory=dict)
    marker: str = ""
    gap: str = ""  # the whitespace before the marker, given back if it is no call
    response_start: int = -1  # the generic format's answer, when it is not a string


class ReplyParser:
    """Splits one reply (see the module's docstring); engine thread, one per request.

    Args:
        syntax: how the format writes thinking and calls.
        tools: whether to look for tool calls (the chat has tools and ``tool_choice`` is
            not ``"none"``).
        reasoning: whether to split thinking out (``reasoning_format`` not ``"none"``).
        thinking: whether the prompt left the reply inside a thinking block (the
            template opened it).
    """

    def __init__(self, syntax: Syntax, *, tools: bool, reasoning: bool, thinking: bool = False) -> None:
        self.syntax = syntax
        self._tools = tools and syntax.has_calls
        self._think = syntax.think if reasoning else None
        self._mode = "reasoning" if (self._think and thinking) else "start"
        self._held = ""  # text not yet released
        self._pending_ws = ""  # content's trailing whitespace, released only before more content
        self._text_len = 0  # characters of the reply fed so far
        self._region: _Region | None = None
        self._trim = False  # drop the whitespace that opens content after thinking
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self._n_announced = 0
        self._raw_tail = False  # a broken region: everything else is content
        if self._tools and syntax.json_reply:
            self._mode = "start"

    # -- the public face -------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        """Read one piece of the reply; what it releases."""
        if not text:
            return _NOTHING
        out = _Out()
        self._step(self._held + text, out, final=False)
        self._text_len += len(text)
        return out.parsed(self)

    def finish(self) -> Parsed:
        """The reply ended: release what is held, as what it turned out to be."""
        out = _Out()
        held, self._held = self._held, ""
        if self._region is not None:
            self._region_feed("", out, final=True)
        if held:
            self._step(held, out, final=True)
        if self._region is not None:
            self._abandon_region(out, complete=False)
        if self._pending_ws and not self.calls:
            out.content.append(self._pending_ws)
        self._pending_ws = ""
        return out.parsed(self)

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking now (what a thinking budget counts)."""
        return self._mode == "reasoning" or (
            self._mode == "start" and self._think is not None and bool(self._held)
        )

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The complete calls read so far."""
        return tuple(self.calls)

    # -- the modes ---------------------------------------------------------------

    def _step(self, buffer: str, out: _Out, *, final: bool) -> None:
        """Read ``buffer`` (held text and the new piece) from the current mode on."""
        self._held = ""
        while buffer:
            mode = self._mode
            if self._region is not None:
                buffer = self._region_feed(buffer, out, final=final)
                if self._held:
                    return
                continue
            if mode == "start":
                buffer = self._at_start(buffer, out, final)
            elif mode == "reasoning":
                buffer = self._in_reasoning(buffer, out, final)
            else:
                buffer = self._in_content(buffer, out, final)
            if self._held:
                return

    def _at_start(self, buffer: str, out: _Out, final: bool) -> str:
        stripped = buffer.lstrip()
        if self._think is not None:
            opener = self._think[0]
            if stripped.startswith(opener):
                self._mode = "reasoning"
                return stripped[len(opener) :].lstrip()
            if not final and (not stripped or opener.startswith(stripped)):
                self._held = buffer
                return ""
        if self._tools and self.syntax.json_reply:
            self._mode = "content"
            self._open_region(out, marker="")
            return buffer
        if self._tools and self.syntax.call_open == "":
            # A bare JSON call begins the reply (Llama 3.x): its first character tells.
            if not stripped and not final:
                self._held = buffer
                return ""
            self._mode = "content"
            if stripped.startswith("{") or stripped.startswith("["):
                self._open_region(out, marker="")
                return stripped
            return buffer
        self._mode = "content"
        return buffer

    def _in_reasoning(self, buffer: str, out: _Out, final: bool) -> str:
        assert self._think is not None
        closer = self._think[1]
        i = buffer.find(closer)
        if i >= 0:
            if i:
                out.reasoning.append(buffer[:i])
            self._mode, self._trim = "content", True
            return buffer[i + len(closer) :]
        keep = 0 if final else _held_prefix(buffer, (closer,))
        if len(buffer) > keep:
            out.reasoning.append(buffer[: len(buffer) - keep])
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _in_content(self, buffer: str, out: _Out, final: bool) -> str:
        if self._trim:
            buffer = buffer.lstrip()
            if not buffer:
                return ""
            self._trim = False
        marker = self.syntax.call_open if (self._tools and not self._raw_tail) else None
        if marker:
            i = buffer.find(marker)
            if i >= 0:
                gap = self._content(buffer[:i], out, before_call=True)
                self._open_region(out, marker=marker)
                assert self._region is not None
                self._region.gap = gap
                return buffer[i + len(marker) :]
            keep = 0 if final else _held_prefix(buffer, (marker,))
        else:
            keep = 0
        self._content(buffer[: len(buffer) - keep], out)
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _content(self, text: str, out: _Out, *, before_call: bool = False) -> str:
        """Release content; before a call, the whitespace next to the call is kept
        aside (returned) instead."""
        body = text.rstrip()
        if before_call:
            gap = self._pending_ws + text[len(body) :]
            if body:
                out.content.append(self._pending_ws + body)
                gap = text[len(body) :]
            self._pending_ws = ""
            return gap
        if not text:
            return ""
        if body:
            out.content.append(self._pending_ws + body)
            self._pending_ws = text[len(body) :]
        else:
            self._pending_ws += text
        return ""

    # -- JSON regions ------------------------------------------------------------

    def _open_region(self, out: _Out, marker: str) -> None:
        syntax = self.syntax
        wants = ("response",) if syntax.json_reply else ()
        reader = JsonReader(decode=lambda path: path == wants)
        self._region = _Region(reader, self._text_len, marker=marker)

    def _call_at(self, path: Path) -> bool:
        """Whether a JSON object at ``path`` (in the region) is a call."""
        syntax = self.syntax
        if syntax.json_reply:
            return (len(path) == 2 and path[0] == "tool_calls" and isinstance(path[1], int)) or path == (
                "tool_call",
            )
        if syntax.body == "array":
            return len(path) == 1 and isinstance(path[0], int)
        return path == ()

    def _region_feed(self, buffer: str, out: _Out, *, final: bool) -> str:
        region = self._region
        assert region is not None
        reader = region.reader
        if reader.done:
            return self._after_region(buffer, out, final)
        base = sum(len(r) for r in region.raw)
        try:
            events = reader.feed(buffer)
            if final:
                events += reader.finish()
        except JsonError:
            region.raw.append(buffer)
            self._abandon_region(out, complete=False)
            return ""
        used = buffer if not reader.done else buffer[: reader.consumed - base]
        region.raw.append(used)
        # The region's text is joined only when an event or a streaming argument needs
        # it: a long generic answer (one string event per piece) never joins it.
        needs_raw = self._streaming_args(region) or any(kind != "chars" for kind, _, _ in events)
        raw = "".join(region.raw) if needs_raw else ""
        for kind, path, value in events:
            self._on_event(region, kind, path, value, raw, out)
        self._send_args(region, raw, base + len(used), out)
        if reader.done:
            return self._after_region(buffer[len(used) :], out, final)
        return ""

    @staticmethod
    def _streaming_args(region: _Region) -> bool:
        return any(c.args_start >= 0 and c.args_end < 0 and c.announced for c in region.calls.values())

    def _on_event(self, region: _Region, kind: str, path: Path, value: object, raw: str, out: _Out) -> None:
        syntax = self.syntax
        if kind == "chars":
            if syntax.json_reply and path == ("response",):
                out.content.append(str(value))
            return
        assert isinstance(value, int)
        offset = value
        if kind == "start":
            if self._call_at(path) and raw[offset : offset + 1] == "{":
                region.calls[path] = _Call(new_call_id(syntax.id_style))
            elif path and path[:-1] in region.calls:
                call = region.calls[path[:-1]]
                if path[-1] in syntax.args_keys and call.args_start < 0:
                    call.args_start = offset
            elif syntax.json_reply and path == ("response",) and raw[offset : offset + 1] != '"':
                region.response_start = offset  # an object under response_format: its JSON text
            return
        # kind == "end"
        if path and path[:-1] in region.calls:
            call = region.calls[path[:-1]]
            key = path[-1]
            if key == syntax.name_key and call.name is None:
                try:
                    name = json.loads(raw[self._value_start(raw, offset) : offset])
                except ValueError:
                    name = None
                if isinstance(name, str):
                    call.name = name
                    self._announce(region, call, out)
            elif key in syntax.args_keys and call.args_start >= 0 and call.args_end < 0:
                call.args_end = offset
        elif path in region.calls:
            call = region.calls[path]
            self._complete(region, call, raw, out)
        elif syntax.json_reply and path == ("response",) and region.response_start >= 0:
            out.content.append(raw[region.response_start : offset])

    @staticmethod
    def _value_start(raw: str, end: int) -> int:
        # A name is a JSON string: its opening quote is the last unescaped one before
        # the closing one. Names are short; scan back from the end.
        i = end - 2
        while i >= 0:
            if raw[i] == '"':
                backslashes = 0
                j = i - 1
                while j >= 0 and raw[j] == "\\":
                    backslashes += 1
                    j -= 1
                if backslashes % 2 == 0:
                    return i
            i -= 1
        return 0

    def _announce(self, region: _Region, call: _Call, out: _Out) -> None:
        call.index, self._n_announced = self._n_announced, self._n_announced + 1
        out.calls.append(ToolCallDelta(call.index, call.id, call.name, ""))

    def _send_args(self, region: _Region, raw: str, length: int, out: _Out) -> None:
        for call in region.calls.values():
            if not call.announced or call.args_start < 0:
                continue
            end = call.args_end if call.args_end >= 0 else length
            start = call.args_start + call.args_sent
            if end > start:
                out.calls.append(ToolCallDelta(call.index, None, None, raw[start:end]))
                call.args_sent = end - call.args_start

    def _complete(self, region: _Region, call: _Call, raw: str, out: _Out) -> None:
        """A call object closed: it is complete if it named a function and its arguments."""
        if call.name is None or call.args_start < 0 or call.args_end < 0:
            return
        self._send_args(region, raw, call.args_end, out)
        arguments = raw[call.args_start : call.args_end]
        self.calls.append(ToolCall(call.id, call.name, arguments))

    def _after_region(self, buffer: str, out: _Out, final: bool) -> str:
        """The region's JSON is complete: expect its closing marker, then go on."""
        region = self._region
        assert region is not None
        closer = self.syntax.call_close
        if closer:
            stripped = buffer.lstrip()
            if stripped.startswith(closer):
                self._close_region(out)
                return stripped[len(closer) :]
            if not final and closer.startswith(stripped):
                self._held = buffer
                return ""
            # No closing marker: the calls stand; what follows is content.
        self._close_region(out)
        return buffer

    def _close_region(self, out: _Out) -> None:
        self._region = None
        self._mode = "content"
        self._pending_ws = ""
        self._trim = True

    def _abandon_region(self, out: _Out, *, complete: bool) -> None:
        """The region is not a call after all (or was cut off): its text is content."""
        region = self._region
        assert region is not None
        self._region = None
        announced = [c for c in region.calls.values() if c.announced]
        finished = [c for c in announced if c.args_end >= 0 and c.name is not None]
        if announced and len(finished) == len(announced) and self.calls:
            return  # every call it announced is complete: nothing to give back
        if not announced:
            text = region.gap + region.marker + "".join(region.raw)
            if text.strip():
                out.content.append(self._pending_ws + text)
                self._pending_ws = ""
        self._raw_tail = True
        self._mode = "content"


@dataclass(slots=True)
class _Out:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)

    def parsed(self, parser: ReplyParser) -> Parsed:
        if not (self.content or self.reasoning or self.calls):
            return _NOTHING
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        if content:
            parser.content.append(content)
        if reasoning:
            parser.reasoning.append(reasoning)
        return Parsed(content, reasoning, tuple(self.calls))
