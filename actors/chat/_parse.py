"""A chat reply, split as it streams: content, thinking and tool calls.

:class:`ReplyParser` is fed the reply's text piece by piece (one generated token's
text at a time, in the engine thread) and returns, for each piece, the content,
thinking and tool-call deltas it releases. Each character is scanned a bounded number
of times: no piece re-parses what came before.

The parser reads thinking and content itself and hands each call region (from its
marker on) to the format's reader: JSON bodies (:mod:`actors.chat._json_region`) or
tagged calls (:mod:`actors.chat._tagged`); GPT-OSS's channels have a reader of their
own (:mod:`actors.chat._harmony`).

Text that could still be the start of a marker (``<tool`` before ``_call>``) is held
back until the next piece tells; at :meth:`ReplyParser.finish` whatever is held is
released as what it turned out to be. A call region that is not a valid call (a
model writing without a grammar) is given back as content, from its marker on, and no
further calls are looked for. Content's pieces join to :attr:`ReplyParser.content`,
thinking's to :attr:`ReplyParser.reasoning`, and each call's argument fragments to its
:class:`~actors.contract.ToolCall`'s ``arguments``, the JSON text of an object.
"""

from __future__ import annotations

from collections.abc import Mapping

from actors.chat._calls import NOTHING, CallLog, Out, Parsed, Region, held_prefix, new_call_id
from actors.chat._harmony import HarmonyReader
from actors.chat._json_region import JsonRegion
from actors.chat._syntax import Syntax
from actors.chat._tagged import RawRegion, TaggedRegion
from actors.contract import ToolCall

__all__ = ["Parsed", "ReplyParser", "new_call_id"]


class ReplyParser:
    """Splits one reply (see the module's docstring); engine thread, one per request.

    Args:
        syntax: how the format writes thinking and calls.
        tools: whether to look for tool calls (the chat has tools and ``tool_choice`` is
            not ``"none"``).
        reasoning: whether to split thinking out (``reasoning_format`` not ``"none"``).
        thinking: whether the prompt left the reply inside a thinking block (the
            template opened it).
        param_types: each function's parameters' schema types (``{"get_weather":
            {"city": "string"}}``), which formats that write arguments as XML need to
            tell a string from JSON (:func:`~actors.chat.param_types`).
    """

    def __init__(
        self,
        syntax: Syntax,
        *,
        tools: bool,
        reasoning: bool,
        thinking: bool = False,
        param_types: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.syntax = syntax
        self._tools = tools and syntax.has_calls
        self._think = syntax.think if reasoning else None
        self._types = param_types or {}
        self._mode = "reasoning" if (self._think and thinking) else "start"
        if self._tools and syntax.json_reply:
            # The generic format's grammar holds the whole reply to one JSON document,
            # even where the prompt opened a thinking block: no thinking comes first.
            self._mode = "start"
        self._held = ""  # text not yet released
        self._pending_ws = ""  # content's trailing whitespace, released only before more content
        self._region: Region | None = None
        self._trim = False  # drop the whitespace that opens content after thinking or calls
        self._thought_started = False  # thinking's first characters (not whitespace) came
        self._thought_ws = ""  # thinking's trailing whitespace, released only before more
        self._raw_tail = False  # a broken region: everything else is content
        self._log = CallLog(syntax.id_style)
        self._harmony = (
            HarmonyReader(self._log, tools=self._tools, reasoning=reasoning)
            if syntax.body == "channels"
            else None
        )
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self._openers = self._content_markers()

    def _content_markers(self) -> tuple[str, ...]:
        """What content is scanned for: call openers, then the markers it drops."""
        syntax = self.syntax
        markers = []
        if self._tools and syntax.call_open:
            markers.append(syntax.call_open)
            tagged = syntax.tagged
            if tagged is not None and tagged.raw is not None:
                markers.append(tagged.raw[0])
            if tagged is not None and tagged.bare_open:
                markers.append(tagged.bare_open)
        return (*markers, *syntax.drop)

    # -- the public face -------------------------------------------------------

    def feed(self, text: str) -> Parsed:
        """Read one piece of the reply; what it releases."""
        if not text:
            return NOTHING
        out = Out()
        if self._harmony is not None:
            self._harmony.feed(text, out)
        else:
            self._step(self._held + text, out, final=False)
        return out.parsed(self.content, self.reasoning)

    def finish(self) -> Parsed:
        """The reply ended: release what is held, as what it turned out to be."""
        out = Out()
        if self._harmony is not None:
            self._harmony.finish(out)
            return out.parsed(self.content, self.reasoning)
        held, self._held = self._held, ""
        if held:
            self._step(held, out, final=True)
        while self._region is not None:  # each round reads what the last one left
            rest = self._after_region(self._region.finish(out), out, final=True)
            if rest:
                self._step(rest, out, final=True)
        if self._pending_ws and not self._log.done:
            out.content.append(self._pending_ws)
        self._pending_ws = ""
        return out.parsed(self.content, self.reasoning)

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking now (what a thinking budget counts)."""
        if self._harmony is not None:
            return self._harmony.thinking
        return self._mode == "reasoning" or (
            self._mode == "start" and self._think is not None and bool(self._held)
        )

    @property
    def in_call(self) -> bool:
        """Whether a call region is open (its marker was read, its end not yet)."""
        return self._region is not None

    @property
    def after_call(self) -> bool:
        """Whether the open region has just ended a call (another may follow in it, or
        the region's end)."""
        return self._region is not None and self._region.after_call

    def closing(self) -> str | None:
        """The shortest text that ends the open call's JSON arguments (``'"}}'``), or
        None: no call is open, its arguments are not JSON, or only more of the
        model's text can end them (a key awaits its value)."""
        return self._region.closing() if self._region is not None else None

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls read so far (the parser's own list)."""
        return self._log.done

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The complete calls read so far."""
        return tuple(self._log.done)

    # -- the modes ---------------------------------------------------------------

    def _step(self, buffer: str, out: Out, *, final: bool) -> None:
        """Read ``buffer`` (held text and the new piece) from the current mode on."""
        self._held = ""
        while buffer:
            if self._region is not None:
                buffer = self._after_region(self._region.feed(buffer, out), out, final=final)
                continue
            mode = self._mode
            if mode == "start":
                buffer = self._at_start(buffer, out, final)
            elif mode == "reasoning":
                buffer = self._in_reasoning(buffer, out, final)
            else:
                buffer = self._in_content(buffer, out, final)
            if self._held:
                return

    def _at_start(self, buffer: str, out: Out, final: bool) -> str:
        stripped = buffer.lstrip()
        syntax = self.syntax
        if self._think is not None:
            opener = self._think[0]
            if stripped.startswith(opener):
                self._mode = "reasoning"
                return stripped[len(opener) :]
            if not final and (not stripped or opener.startswith(stripped)):
                self._held = buffer
                return ""
        self._mode = "content"
        if not self._tools:
            if syntax.opened and syntax.tagged is not None and syntax.tagged.content_name:
                # Functionary v3.2 answers as a message to "all": its recipient is markup.
                recipient = syntax.tagged.content_name + "\n"
                if not final and len(stripped) < len(recipient) and recipient.startswith(stripped):
                    self._mode, self._held = "start", buffer
                    return ""
                if stripped.startswith(recipient):
                    return stripped[len(recipient) :]
            return buffer
        if syntax.json_reply:
            self._region = JsonRegion(syntax, self._log)
            return buffer
        if syntax.call_open == "":
            # A bare JSON call begins the reply (Llama 3.x): its first character tells.
            if not stripped and not final:
                self._mode, self._held = "start", buffer
                return ""
            if stripped.startswith("{") or stripped.startswith("["):
                self._region = JsonRegion(syntax, self._log)
                return stripped
        elif syntax.opened and syntax.tagged is not None and syntax.call_open:
            # The prompt ended with the opener (Functionary v3.2's ">>>"): the reply is
            # inside it, unless the model wrote it again.
            opener = syntax.call_open
            if not final and len(stripped) < len(opener) and opener.startswith(stripped):
                self._mode, self._held = "start", buffer
                return ""
            marker = opener if stripped.startswith(opener) else ""
            self._region = TaggedRegion(syntax.tagged, self._log, self._types, marker=marker)
            return stripped[len(marker) :]
        return buffer

    def _in_reasoning(self, buffer: str, out: Out, final: bool) -> str:
        assert self._think is not None
        if not self._thought_started:
            # The whitespace that opens thinking is markup (``<think>\n``).
            buffer = buffer.lstrip()
            if not buffer:
                return ""
            self._thought_started = True
        closer = self._think[1]
        i = buffer.find(closer)
        if i >= 0:
            self._thought(buffer[:i], out, closing=True)
            self._mode, self._trim = "content", True
            return buffer[i + len(closer) :]
        keep = 0 if final else held_prefix(buffer, (closer,))
        self._thought(buffer[: len(buffer) - keep], out, closing=False)
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _thought(self, text: str, out: Out, *, closing: bool) -> None:
        """Release thinking; its trailing whitespace waits for more (the whitespace
        before the close marker is markup too)."""
        body = text.rstrip()
        if body:
            out.reasoning.append(self._thought_ws + body)
            self._thought_ws = ""
        self._thought_ws = "" if closing else self._thought_ws + text[len(body) :]

    def _in_content(self, buffer: str, out: Out, final: bool) -> str:
        if self._trim:
            buffer = buffer.lstrip()
            if not buffer:
                return ""
            self._trim = False
        markers = self._openers if not self._raw_tail else self.syntax.drop
        found = [(i, marker) for marker in markers if (i := buffer.find(marker)) >= 0]
        if found:
            i, marker = min(found, key=lambda f: (f[0], -len(f[1])))
            rest = buffer[i + len(marker) :]
            if marker in self.syntax.drop:
                self._content(buffer[:i], out)
                return rest
            gap = self._content(buffer[:i], out, before_call=True)
            self._region = self._open_region(marker, gap)
            return rest
        keep = 0 if final else held_prefix(buffer, markers)
        self._content(buffer[: len(buffer) - keep], out)
        self._held = buffer[len(buffer) - keep :]
        return ""

    def _content(self, text: str, out: Out, *, before_call: bool = False) -> str:
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

    # -- regions -----------------------------------------------------------------

    def _open_region(self, marker: str, gap: str) -> Region:
        syntax = self.syntax
        tagged = syntax.tagged
        if tagged is None:
            return JsonRegion(syntax, self._log, marker=marker, gap=gap)
        if tagged.raw is not None and marker == tagged.raw[0]:
            return RawRegion(tagged.raw[1], tagged.raw[2], self._log)
        bare = marker == tagged.bare_open
        return TaggedRegion(tagged, self._log, self._types, marker=marker, gap=gap, bare=bare)

    def _after_region(self, step: tuple[str, str], out: Out, *, final: bool) -> str:
        """Act on a region's answer; the text left to read."""
        status, text = step
        if status == "more":
            return ""
        self._region = None
        self._mode = "content"
        self._pending_ws = ""
        if status == "done":
            self._trim = True
            return text
        # Broken: its text is content, read as content is (the markers it drops go).
        self._raw_tail = True
        return text
