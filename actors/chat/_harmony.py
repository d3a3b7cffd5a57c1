"""GPT-OSS's replies: harmony messages, each with a header naming its channel.

After the generation prompt ``<|start|>assistant`` the model writes messages::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer
    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>

``analysis`` is thinking, ``final`` (and ``commentary`` to nobody, a preamble) is
content, and a message whose recipient (``to=``, in the role's header or the
channel's) is ``functions.NAME`` is a call of NAME with the message as its JSON
arguments. Messages to anyone else (built-in tools such as ``python``) are dropped, as
llama.cpp drops them. ``<|call|>`` and ``<|return|>`` end the generation (they are
end-of-generation tokens), ``<|end|>`` ends one message.

Thinking off (``reasoning_format`` ``"none"``), an analysis message is content with
its markers, as llama.cpp gives it. Text that is no harmony header at all is content.
"""

from __future__ import annotations

import re

from actors.chat._calls import CallLog, Out, held_prefix
from actors.chat._json_stream import JsonError, JsonReader

__all__ = ["HARMONY_TOKENS", "HarmonyReader"]

HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)
"""The special tokens of the layout (shown as text to the parser)."""

_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_START = "<|start|>"
_BODY_ENDS = (*_ENDS, _START)
_HEADER_STARTS = ("<|start|>", "<|channel|>", "to=", "assistant")
_MAX_HEADER = 512
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyReader:
    """Reads one GPT-OSS reply (see the module's docstring); the parser's engine.

    Args:
        log: the reply's calls.
        tools: whether calls to ``functions.*`` are tool calls (else dropped).
        reasoning: whether analysis is thinking (else content, markers and all).
    """

    def __init__(self, log: CallLog, *, tools: bool, reasoning: bool) -> None:
        self._log = log
        self._tools = tools
        self._reasoning = reasoning
        self._state = "header"  # header, body, plain (no harmony: all is content)
        self._header: list[str] = []
        self._kind = ""  # the body's: reasoning, content, analysis (as content), call, drop
        self._held = ""
        self._name = ""
        self._json: JsonReader | None = None
        self._args: list[str] = []
        self._index = -1
        self._call_id = ""

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside an analysis message now."""
        return self._state == "body" and self._kind == "reasoning"

    def feed(self, text: str, out: Out) -> None:
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "plain":
                out.content.append(text)
                return
            if self._state == "header":
                text = self._read_header(text, out)
            elif self._kind == "call":
                text = self._read_call(text, out)
            else:
                text = self._read_body(text, out)
            if self._held:
                return

    def finish(self, out: Out) -> None:
        held, self._held = self._held, ""
        if self._state == "header":
            header = "".join(self._header) + held
            if header.strip() and not self._is_header_start(header):
                out.content.append(header)
        elif self._state == "body":
            if self._kind == "call":
                self._end_call(out, ended=True)
            else:
                self._emit(held, out)
        elif held:
            out.content.append(held)

    # -- headers -------------------------------------------------------------------

    @staticmethod
    def _is_header_start(text: str) -> bool:
        head = text.lstrip()
        return any(head.startswith(s) or s.startswith(head) for s in _HEADER_STARTS)

    def _read_header(self, text: str, out: Out) -> str:
        so_far = "".join(self._header)
        i = text.find(_MESSAGE)
        if i < 0:
            keep = held_prefix(text, (_MESSAGE,))
            self._header.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            header = "".join(self._header) + self._held
            if not self._is_header_start(header) or len(header) > _MAX_HEADER:
                self._to_plain(header, out)
            return ""
        header = so_far + text[:i]
        self._header = []
        if not self._is_header_start(header) or "<|channel|>" not in header:
            self._to_plain(header + text[i:], out)  # every harmony header names a channel
            return ""
        self._open_body(header, out)
        return text[i + len(_MESSAGE) :]

    def _to_plain(self, text: str, out: Out) -> None:
        self._state, self._header, self._held = "plain", [], ""
        out.content.append(text)

    def _open_body(self, header: str, out: Out) -> None:
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else ""
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        recipient = recipients[-1] if recipients else ""
        self._state = "body"
        if recipient.startswith("functions.") and self._tools:
            self._kind, self._name = "call", recipient[len("functions.") :]
            self._json, self._args, self._index = JsonReader(), [], -1
        elif recipient:
            self._kind = "drop"  # a built-in tool's call, or one without tools: llama.cpp drops it
        elif channel == "analysis":
            self._kind = "reasoning" if self._reasoning else "analysis"
            if not self._reasoning:
                out.content.append(header.replace("<|start|>assistant", "").lstrip() + _MESSAGE)
        else:
            self._kind = "content"

    # -- bodies --------------------------------------------------------------------

    def _emit(self, text: str, out: Out) -> None:
        if not text or self._kind == "drop":
            return
        (out.reasoning if self._kind == "reasoning" else out.content).append(text)

    def _read_body(self, text: str, out: Out) -> str:
        ends = [(i, end) for end in _BODY_ENDS if (i := text.find(end)) >= 0]
        if not ends:
            keep = held_prefix(text, _BODY_ENDS)
            self._emit(text[: len(text) - keep], out)
            self._held = text[len(text) - keep :]
            return ""
        i, end = min(ends)
        self._emit(text[:i], out)
        self._state = "header"
        if end == _START:  # a message the model did not end: the next one's header
            return text[i:]
        if self._kind == "analysis":
            out.content.append(end)
        return text[i + len(end) :]

    def _read_call(self, text: str, out: Out) -> str:
        reader = self._json
        if reader is None:  # the call's arguments are read: its end marker follows
            stripped = text.lstrip()
            for end in _ENDS:
                if stripped.startswith(end):
                    self._state = "header"
                    return stripped[len(end) :]
            if not stripped or held_prefix(stripped, _ENDS) == len(stripped):
                self._held = text
                return ""
            self._state = "header"  # no end marker: what follows is read as a header
            return stripped
        if self._index < 0:
            stripped = text.lstrip()
            if not stripped:
                return ""
            if not stripped.startswith("{"):
                self._kind = "drop"  # arguments that are no JSON object: no call
                return stripped
            text = stripped
            self._index, self._call_id = self._log.announce(self._name, out)
        base = reader.fed
        try:
            reader.feed(text)
        except JsonError as e:
            self._kind = "drop"  # no call: the message is dropped up to its end
            return text[e.offset - base :]
        used = text if not reader.done else text[: reader.consumed - base]
        self._args.append(used)
        self._log.args(self._index, used, out)
        if reader.done:
            self._end_call(out, ended=False)
            return text[len(used) :]
        return ""

    def _end_call(self, out: Out, *, ended: bool) -> None:
        if self._json is not None and self._json.done:
            self._log.complete(self._call_id, self._name, "".join(self._args))
        self._json = None
        if ended:
            self._state = "header"
