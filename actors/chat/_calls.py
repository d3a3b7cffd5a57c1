"""What the parts of the reply parser share: what a piece releases, the reply's calls,
and the small text matchers the region readers are made of.

A *region* is the text from a call marker to the end of its calls: the reader of
JSON bodies (:mod:`actors.chat._json_region`) and the reader of tagged calls
(:mod:`actors.chat._tagged`) each implement :class:`Region`. The parser
(:mod:`actors.chat._parse`) finds the marker, opens the region, and feeds it all the
text until it reports its end.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Literal, Protocol

from actors.contract import ToolCall, ToolCallDelta

__all__ = [
    "NAME_CHARS",
    "CallLog",
    "Out",
    "Parsed",
    "Region",
    "Step",
    "Words",
    "held_prefix",
    "new_call_id",
]

_ALNUM = string.ascii_letters + string.digits

NAME_CHARS = frozenset(_ALNUM + "_-.:/@$")
"""What a function name written outside JSON may hold (anything else ends or breaks it)."""


def new_call_id(style: str = "call") -> str:
    """A fresh tool-call id: ``call_`` and 24 letters and digits, or nine of them
    (``"alnum9"``, what Mistral's templates accept)."""
    if style == "alnum9":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``."""
    longest = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-k:]):
                longest = k
                break
    return longest


@dataclass(frozen=True, slots=True)
class Parsed:
    """What one piece of the reply released."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


NOTHING = Parsed()


@dataclass(slots=True)
class Out:
    """What one piece releases, gathered as it is read."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)

    def parsed(self, content: list[str], reasoning: list[str]) -> Parsed:
        """The release, its content and reasoning also appended to the reply's lists."""
        if not (self.content or self.reasoning or self.calls):
            return NOTHING
        text, thought = "".join(self.content), "".join(self.reasoning)
        if text:
            content.append(text)
        if thought:
            reasoning.append(thought)
        return Parsed(text, thought, tuple(self.calls))


@dataclass(slots=True)
class CallLog:
    """The reply's calls: their numbering and ids, the deltas, the complete calls."""

    id_style: str = "call"
    done: list[ToolCall] = field(default_factory=list)
    announced: int = 0

    def announce(self, name: str, out: Out) -> tuple[int, str]:
        """A call's name is known: its first delta; its index and id."""
        index, call_id = self.announced, new_call_id(self.id_style)
        self.announced += 1
        out.calls.append(ToolCallDelta(index, call_id, name, ""))
        return index, call_id

    @staticmethod
    def args(index: int, text: str, out: Out) -> None:
        """A fragment of call ``index``'s arguments."""
        if text:
            out.calls.append(ToolCallDelta(index, None, None, text))

    def complete(self, call_id: str, name: str, arguments: str) -> None:
        self.done.append(ToolCall(call_id, name, arguments))


Step = tuple[Literal["more", "done", "broken"], str]
"""A region's answer to a feed: ``("more", "")``: all read, more wanted; ``("done",
rest)``: its calls ended, ``rest`` follows them; ``("broken", text)``: not a call after
all, ``text`` is given back as content (and no more calls are looked for)."""


class Region(Protocol):
    """A call region being read (see the module's docstring)."""

    def feed(self, text: str, out: Out) -> Step:
        """Read ``text``, the reply's next characters."""
        ...

    def finish(self, out: Out) -> Step:
        """The reply ended inside the region."""
        ...

    @property
    def after_call(self) -> bool:
        """Whether a call has just ended here (the region awaits another, or its end)."""
        ...

    def closing(self) -> str | None:
        """The shortest text that ends the current call's JSON arguments from here
        (None: there are none open, or only more of the model's text can end them)."""
        ...


class Words:
    """Matches a literal whose words may be separated by any whitespace (or none),
    and preceded by some: ``"\\n```json\\n"`` matches ``"```json"`` and ``" ```json\\n"``.

    Trailing whitespace is not consumed: what follows the literal reads it.
    """

    __slots__ = ("_at", "_literal", "_word", "_words", "failed_at")

    def __init__(self, literal: str) -> None:
        self._literal = literal
        self._words = literal.split()
        self._word = 0
        self._at = 0
        self.failed_at = -1  # where in the last text fed a character did not match

    @property
    def done(self) -> bool:
        return self._word >= len(self._words)

    def rest(self) -> str:
        """What is left of the literal to write, its own whitespace kept."""
        if self.done:
            return ""
        spans = [m.span() for m in re.finditer(r"\S+", self._literal)]
        start, _ = spans[self._word]
        if self._at == 0:  # the word not begun: from the whitespace before it
            return self._literal[spans[self._word - 1][1] if self._word else 0 :]
        return self._literal[start + self._at :]

    def feed(self, text: str, start: int = 0) -> int:
        """Read ``text`` from ``start``; the offset just past the match, -1 for more
        text wanted, or -2 when ``text`` does not match (at :attr:`failed_at`)."""
        i = start
        while not self.done:
            if i >= len(text):
                return -1
            c = text[i]
            word = self._words[self._word]
            if self._at == 0 and c.isspace():
                i += 1
                continue
            if c != word[self._at]:
                self.failed_at = i
                return -2
            self._at += 1
            i += 1
            if self._at == len(word):
                self._word, self._at = self._word + 1, 0
        return i
