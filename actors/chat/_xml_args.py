"""Arguments written as XML-tagged key/value pairs, read into a JSON object's text.

GLM writes ``<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>``, Qwen3-Coder
``<parameter=city>\\nParis\\n</parameter>`` (:class:`~actors.chat._syntax.XmlArgs`).
:class:`XmlArgsReader` turns them, as they stream, into the text of a JSON object
(``{"city": "Paris", "days": 3}``) whose fragments it releases in order, so they join
to the call's arguments.

A template writes a string value as it is and any other value as JSON, so the text
alone cannot tell ``3`` the number from ``"3"`` the string: a parameter whose schema
says ``string`` is a string, one whose schema says another type is JSON (Python's
``True``/``False``, which Jinja writes for booleans, are read as JSON's), and one of no
known type is JSON when it parses as JSON, else a string. A string value streams
character by character; any other is released when its closing tag arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from actors.chat._calls import Words, held_prefix
from actors.chat._syntax import XmlArgs

__all__ = ["XmlArgsReader"]

_MAX_KEY = 256
_JSON_START = frozenset('{["-0123456789tfnTF')
_BOOLEANS = {"True": "true", "False": "false"}

Status = tuple[Literal["more", "end", "broken"], str]


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class XmlArgsReader:
    """Reads one call's XML arguments (see the module's docstring).

    Args:
        xml: the layout.
        types: the call's parameters' schema types (``{"city": "string"}``), as known.
    """

    def __init__(self, xml: XmlArgs, types: Mapping[str, str]) -> None:
        self._xml = xml
        self._types = types
        self._phase = "between"  # between, key_open, key, key_close, value_open, value
        self._words: Words | None = None
        self._held = ""
        self._key: list[str] = []
        self._n_keys = 0
        self._value: list[str] = []  # a value not yet released (its type is not yet known)
        self._value_mode = ""  # "" undecided, "string" streaming, "json" whole at its close
        self._value_started = False  # the leading newline (when trimmed) is behind
        self.started = False  # a key was opened: the call is real
        self.text: list[str] = []  # the JSON object's fragments released so far

    def feed(self, text: str, out: list[str]) -> Status:
        """Read ``text``; the JSON fragments it releases are appended to ``out``."""
        text = self._held + text
        self._held = ""
        xml = self._xml
        i = 0
        while i <= len(text):
            phase = self._phase
            if phase == "between":
                # Whitespace, then another key, or the end of the arguments.
                while i < len(text) and text[i].isspace():
                    i += 1
                rest = text[i:]
                opener = xml.key_open.strip()
                if rest.startswith(opener):
                    self._phase, self._words = "key_open", Words(xml.key_open)
                    self.started = True
                    continue
                if not rest or held_prefix(rest, (opener,)) == len(rest):
                    self._held = rest
                    return ("more", "")
                self._emit(out, "}" if self._n_keys else "{}")
                return ("end", rest)
            if phase in ("key_open", "key_close", "value_open"):
                assert self._words is not None
                j = self._words.feed(text, i)
                if j == -1:
                    return ("more", "")
                if j == -2:
                    return ("broken", text[self._words.failed_at :])
                i = j
                if phase == "key_open":
                    self._phase, self._key = "key", []
                elif phase == "key_close":
                    self._phase, self._words = "value_open", Words(xml.value_open)
                else:
                    self._phase, self._value, self._value_mode, self._value_started = "value", [], "", False
                continue
            if phase == "key":
                closer = xml.key_close.strip()
                end = text.find(closer, i)
                if end < 0:
                    keep = held_prefix(text[i:], (closer,))
                    self._key.append(text[i : len(text) - keep])
                    self._held = text[len(text) - keep :]
                    if sum(map(len, self._key)) > _MAX_KEY:
                        return ("broken", "")
                    return ("more", "")
                self._key.append(text[i:end])
                key = "".join(self._key).strip()
                if not key or len(key) > _MAX_KEY:
                    return ("broken", text[end:])
                self._emit(
                    out, ("{" if not self._n_keys else ", ") + json.dumps(key, ensure_ascii=False) + ": "
                )
                self._n_keys += 1
                self._key = [key]
                self._phase, self._words = "key_close", Words(xml.key_close)
                i = end
                continue
            # phase == "value"
            return self._read_value(text, i, out)
        return ("more", "")

    def _read_value(self, text: str, i: int, out: list[str]) -> Status:
        xml = self._xml
        closer = xml.value_close.strip()
        end = text.find(closer, i)
        chunk = text[i:] if end < 0 else text[i:end]
        keep = 0 if end >= 0 else held_prefix(chunk, (closer,))
        if xml.trim_newline and end < 0 and chunk[len(chunk) - keep - 1 : len(chunk) - keep] == "\n":
            keep += 1  # it may be the markup's newline before the closing tag
        body = chunk[: len(chunk) - keep]
        self._held = chunk[len(chunk) - keep :]
        if xml.trim_newline and not self._value_started and body:
            body = body[1:] if body[0] == "\n" else body
        if body:
            self._value_started = True
        if end >= 0 and xml.trim_newline and body.endswith("\n"):
            body = body[:-1]
        self._value_text(body, out)
        if end < 0:
            return ("more", "")
        self._close_value(out)
        self._held = ""
        self._phase = "between"
        return self.feed(text[end + len(closer) :], out)

    def _value_text(self, body: str, out: list[str]) -> None:
        if not body:
            return
        self._value.append(body)
        if not self._value_mode:
            kind = self._types.get(self._key[0])
            so_far = "".join(self._value)
            if kind == "string" or (
                kind is None and so_far.lstrip()[:1] not in _JSON_START and so_far.strip()
            ):
                self._value_mode = "string"
                self._emit(out, '"')
            elif so_far.strip():
                self._value_mode = "json"
        if self._value_mode == "string":
            self._emit(out, _escaped("".join(self._value)))
            self._value = []

    def _close_value(self, out: list[str]) -> None:
        if self._value_mode == "string":
            self._emit(out, '"')
            return
        raw = "".join(self._value)
        text = raw.strip()
        kind = self._types.get(self._key[0])
        if kind == "boolean" and text in _BOOLEANS:
            text = _BOOLEANS[text]
        try:
            json.loads(text)
        except ValueError:
            text = json.dumps(raw, ensure_ascii=False)  # not JSON: the string it is
        self._emit(out, text)

    def _emit(self, out: list[str], fragment: str) -> None:
        out.append(fragment)
        self.text.append(fragment)

    @property
    def n_keys(self) -> int:
        """How many parameters were read."""
        return self._n_keys
