"""A region of tagged calls: a marker, the function's name, then its arguments.

Functionary's ``<function=NAME>{...}</function>`` and ``>>>NAME\\n{...}``, DeepSeek's
calls between its ``tool▁call▁begin`` and ``tool▁call▁end`` markers, Kimi K2's
``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}``, Mistral's
``[TOOL_CALLS]NAME[ARGS]{...}``, GLM's and Qwen3-Coder's XML arguments: one reader,
driven by the format's :class:`~actors.chat._syntax.Tagged` layout.

A call is announced when its arguments begin (a ``{``, or a first XML key), so a
marker followed by something else is given back as content unannounced. JSON
arguments stream as written; their end ends them (a
:class:`~actors.chat._json_stream.JsonReader` watches, without events). After a
call, another call or the section's end may follow; anything else ends the region
and is content again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from actors.chat._calls import NAME_CHARS, CallLog, Out, Step, Words, held_prefix
from actors.chat._json_stream import JsonError, JsonReader
from actors.chat._syntax import Tagged
from actors.chat._xml_args import XmlArgsReader

__all__ = ["RawRegion", "TaggedRegion"]

_MAX_NAME = 256


class TaggedRegion:
    """Reads one region of tagged calls (a :class:`~actors.chat._calls.Region`).

    Args:
        tagged: the layout.
        log: the reply's calls.
        types: each function's parameters' schema types, for XML arguments.
        marker: the text that opened the region (given back if it is no call).
        gap: the whitespace before the marker (given back likewise).
        bare: the marker was :attr:`~actors.chat._syntax.Tagged.bare_open`: the
            name follows it.
    """

    def __init__(
        self,
        tagged: Tagged,
        log: CallLog,
        types: Mapping[str, Mapping[str, str]],
        marker: str = "",
        gap: str = "",
        *,
        bare: bool = False,
    ) -> None:
        self._t = tagged
        self._log = log
        self._types = types
        self._lead = gap + marker  # given back with the first call
        self._held = ""
        t = tagged
        self._literals = {
            "open": t.open,
            "before_name": t.before_name,
            "index_sep": t.index_sep,
            "after_name": t.after_name,
            "after_args": t.after_args,
            "close": t.close,
        }
        self._steps = self._call_steps(first=True)
        self._step = self._steps.index("name") if bare else 0
        self._words: Words | None = None
        self._raw: list[str] = []  # the current call's text, given back if it breaks
        self._name: list[str] = []
        self._index = -1  # the current call's index once announced
        self._call_id = ""
        self._args: list[str] = []
        self._json: JsonReader | None = None
        self._xml: XmlArgsReader | None = None
        self._complete = False  # the current call's arguments are complete
        self._n_done = 0

    def _call_steps(self, *, first: bool) -> list[str]:
        """The steps of one call (their texts are the layout's)."""
        t = self._t
        steps = ["open"] if (t.section is not None or not first) else []
        steps += ["before_name", "name"]
        if t.index_sep:
            steps += ["index_sep", "index"]
        if t.id_open:
            steps.append("id")
        steps += ["after_name", "args", "after_args", "close", "next"]
        return steps

    # -- the Region protocol -------------------------------------------------------

    def feed(self, text: str, out: Out) -> Step:
        text = self._held + text
        self._held = ""
        i = 0
        while True:
            step = self._steps[self._step]
            literal = self._literals.get(step)
            if literal is not None:
                if self._words is None:
                    self._words = Words(literal)
                j = self._words.feed(text, i)
                if j == -1:
                    self._raw.append(text[i:])
                    return ("more", "")
                if j == -2:
                    return self._mismatch(text, i, self._words.failed_at, out)
                self._raw.append(text[i:j])
                i, self._words = j, None
                self._step += 1
                continue
            result: int | Step = getattr(self, "_read_" + step)(text, i, out)
            if isinstance(result, int):
                i = result
                self._step += 1
                continue
            return result

    def finish(self, out: Out) -> Step:
        held, self._held = self._held, ""
        if self._steps[self._step] == "next":
            self._finish_call(out)
            return ("done", held)
        if self._complete and self._index >= 0:
            self._finish_call(out)
            return ("done", "")
        return self._broken(held)

    @property
    def after_call(self) -> bool:
        return self._steps[self._step] == "next"

    def closing(self) -> str | None:
        steps, k = self._steps, self._step
        step = steps[k]
        if step == "args":
            reader = self._json
            head = reader.closing() if reader is not None and not reader.done else None
        elif step in ("after_args", "close") and self._complete:
            head = self._words.rest() if self._words is not None else self._literals[step]
        else:
            head = "" if step == "next" else None
        if head is None:
            return None
        tail = "".join(self._literals[s] for s in steps[k + 1 :] if s in ("after_args", "close"))
        if self._t.section is not None:  # the section's end, past what is held of it
            closer, held = self._t.section[1], self._held.lstrip()
            if not closer.startswith(held):
                return None
            tail += closer[len(held) :]
        return head + tail

    # -- the steps -------------------------------------------------------------------

    def _read_name(self, text: str, i: int, out: Out) -> int | Step:
        sep = self._t.index_sep[:1]
        start = i
        if not self._name:
            while start < len(text) and text[start].isspace():
                start += 1
        j = start
        while j < len(text) and text[j] in NAME_CHARS and text[j] != sep:
            j += 1
        if j > start:
            self._name.append(text[start:j])
        self._raw.append(text[i:j])
        name = "".join(self._name)
        if len(name) > _MAX_NAME:
            return self._broken(text[j:])
        if j == len(text):
            return ("more", "")
        if not name:
            return self._broken(text[j:])
        if name == self._t.content_name:
            return ("done", text[j:])  # a message to the user: content follows
        return j

    def _read_index(self, text: str, i: int, out: Out) -> int | Step:
        j = i
        while j < len(text) and text[j].isdigit():
            j += 1
        self._raw.append(text[i:j])
        return j if j < len(text) else ("more", "")

    def _read_id(self, text: str, i: int, out: Out) -> int | Step:
        opener = self._t.id_open
        rest = text[i:]
        if rest.startswith(opener):
            j = i + len(opener)
            while j < len(text) and text[j].isalnum():
                j += 1
            if j == len(text):
                self._held = rest
                return ("more", "")
            self._raw.append(text[i:j])
            return j
        if held_prefix(rest, (opener,)) == len(rest):
            self._held = rest
            return ("more", "")
        return i  # no id: the arguments' marker follows

    def _read_args(self, text: str, i: int, out: Out) -> int | Step:
        if self._t.xml is not None:
            return self._xml_args(text, i, out)
        if self._json is None:
            while i < len(text) and text[i].isspace():
                self._raw.append(text[i])
                i += 1
            if i == len(text):
                return ("more", "")
            if text[i] != "{":
                return self._broken(text[i:])
            self._json = JsonReader()
            self._announce(out)
        reader = self._json
        base = reader.fed
        try:
            reader.feed(text[i:])
        except JsonError as e:
            return self._broken(text[i:], text[i + e.offset - base :])
        end = len(text) if not reader.done else i + reader.consumed - base
        self._send(text[i:end], out)
        if not reader.done:
            return ("more", "")
        self._complete = True
        return end

    def _xml_args(self, text: str, i: int, out: Out) -> int | Step:
        assert self._t.xml is not None
        if self._xml is None:
            self._xml = XmlArgsReader(self._t.xml, self._types.get("".join(self._name), {}))
        fragments: list[str] = []
        self._raw.append(text[i:])
        status, rest = self._xml.feed(text[i:], fragments)
        if self._xml.started and self._index < 0:
            self._announce(out)
        for fragment in fragments:
            self._send(fragment, out)  # held back until announced, when no key came
        if status == "broken":
            return self._broken("", rest)  # what it read is in the call's text already
        if status == "more":
            return ("more", "")
        self._complete = True
        # What follows the arguments may include text the XML reader held from an
        # earlier piece: read on from its rest, which is the tail of what it was fed.
        raw = "".join(self._raw)
        self._raw = [raw[: len(raw) - len(rest)]]
        self._step += 1
        return self.feed(rest, out)

    def _read_next(self, text: str, i: int, out: Out) -> Step:
        """After a call: another call, the section's end, or the region's end."""
        self._finish_call(out)
        while i < len(text) and text[i].isspace():
            i += 1
        rest = text[i:]
        section = self._t.section
        closer = section[1] if section else ""
        if section is not None:
            for marker in (self._t.open.strip(), closer):
                if rest.startswith(marker):
                    self._steps, self._step = self._call_steps(first=False), 0
                    if marker == closer:
                        return ("done", rest[len(closer) :])
                    return self.feed(rest, out)
            if not rest or held_prefix(rest, (self._t.open.strip(), closer)) == len(rest):
                self._held = rest
                self._step = len(self._steps) - 1
                return ("more", "")
        return ("done", rest)

    # -- calls -------------------------------------------------------------------------

    def _announce(self, out: Out) -> None:
        self._index, self._call_id = self._log.announce("".join(self._name), out)

    def _send(self, fragment: str, out: Out) -> None:
        self._args.append(fragment)
        if self._index >= 0:
            self._log.args(self._index, fragment, out)

    def _finish_call(self, out: Out) -> None:
        if self._complete and self._index < 0:
            self._announce(out)  # XML arguments with no parameter: the call closed
            self._log.args(self._index, "".join(self._args), out)
        if self._complete and self._index >= 0:
            self._log.complete(self._call_id, "".join(self._name), "".join(self._args))
            self._n_done += 1
        self._complete = False
        self._index, self._name, self._args, self._raw = -1, [], [], []
        self._json = self._xml = None

    def _mismatch(self, text: str, i: int, at: int, out: Out) -> Step:
        """A marker did not follow (its text began at ``i``, broke at ``at``): after
        the arguments of an announced call the call stands and the rest is content;
        before them the call is broken."""
        if self._complete and self._index >= 0:
            self._finish_call(out)
            return ("done", text[at:])
        return self._broken(text[i:], text[at:])

    def _broken(self, rest: str, tail: str | None = None) -> Step:
        """Not a call after all: unannounced, the call's text and ``rest`` (the piece's
        text from the failing step on) are content; announced, its text cannot be
        taken back, and ``tail`` (from the failing character on) is content."""
        if self._index >= 0:
            return ("broken", rest if tail is None else tail)
        lead = self._lead if self._n_done == 0 else ""
        text = lead + "".join(self._raw) + rest
        return ("broken", text if text.strip() else "")


class RawRegion:
    """The rest of the reply as one call's raw text (Functionary v3.1's
    ``<|python_tag|>`` code): ``{key: <the text>}``, or the text itself when it is a
    JSON object (a :class:`~actors.chat._calls.Region`)."""

    def __init__(self, tool: str, key: str, log: CallLog) -> None:
        self._tool, self._key, self._log = tool, key, log
        self._index = -1
        self._call_id = ""
        self._mode = ""  # "" before the first character, "json" or "code"
        self._lead: list[str] = []
        self._json = JsonReader()
        self._args: list[str] = []

    def feed(self, text: str, out: Out) -> Step:
        if not self._mode:
            body = "".join(self._lead) + text
            if not body.strip():
                self._lead.append(text)
                return ("more", "")
            self._index, self._call_id = self._log.announce(self._tool, out)
            if body.lstrip().startswith("{"):
                self._mode, text = "json", body.lstrip()
            else:
                self._mode, text = "code", body.lstrip()
                self._send(json.dumps({self._key: ""}, ensure_ascii=False)[:-2], out)
        if self._mode == "code":
            self._send(json.dumps(text, ensure_ascii=False)[1:-1], out)
            return ("more", "")
        base = self._json.fed
        try:
            self._json.feed(text)
        except JsonError as e:
            return ("broken", text[e.offset - base :])  # announced: the rest is content
        used = text if not self._json.done else text[: self._json.consumed - base]
        self._send(used, out)
        if self._json.done:
            self._log.complete(self._call_id, self._tool, "".join(self._args))
            return ("done", text[len(used) :])
        return ("more", "")

    def _send(self, fragment: str, out: Out) -> None:
        self._args.append(fragment)
        self._log.args(self._index, fragment, out)

    @property
    def after_call(self) -> bool:
        return False  # the raw call runs to the reply's end

    def closing(self) -> str | None:
        return self._json.closing() if self._mode == "json" and not self._json.done else None

    def finish(self, out: Out) -> Step:
        if self._mode == "code":
            self._send('"}', out)
            self._log.complete(self._call_id, self._tool, "".join(self._args))
            return ("done", "")
        if not self._mode:
            return ("done", "".join(self._lead))
        return ("broken", "")
