"""How a model family writes its thinking and its tool calls: plain data.

A :class:`Syntax` is what the reply parser (:mod:`actors.chat._parse`) and the
grammar builder (:mod:`actors.chat._grammar`) need to know about a format; the
formats themselves (which template gets which syntax) are in
:mod:`actors.chat._formats`. Frozen, so one crosses threads and pickles as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Syntax"]


@dataclass(frozen=True, slots=True)
class Syntax:
    """The markers and the JSON layout of one format's replies.

    Attributes:
        name: the format's name (``"hermes"``, ``"generic"``...), shown in ``GetInfo``.
        think: the markers around thinking (``("<think>", "</think>")``), or None.
        call_open: the text that starts a tool-call region (``"<tool_call>"``); ``""``
            when a call is a bare JSON value that begins the reply (Llama 3.x).
        call_close: the text that ends a region, or ``""`` when the JSON value's end
            ends it.
        body: ``"object"``: a region holds one call object; ``"array"``: a JSON array
            of call objects (``[TOOL_CALLS][...]``).
        json_reply: the whole reply is one JSON document that holds either tool calls
            (``{"tool_calls": [...]}``) or the answer (``{"response": ...}``): the
            generic format, for templates that know no tools.
        name_key: the key of a call's function name.
        args_keys: the keys a call's arguments may have, the first one preferred
            (Llama 3.x writes ``parameters``).
        id_style: ``"call"`` (``call_`` and 24 letters and digits) or ``"alnum9"``
            (nine letters and digits, which Mistral's templates require).
        open_ws: what the grammar writes right after ``call_open`` (the template's own
            rendering: Hermes writes ``"<tool_call>\\n"``).
        parallel: whether the template can take several calls in one turn.
    """

    name: str
    think: tuple[str, str] | None = None
    call_open: str | None = None
    call_close: str = ""
    body: Literal["object", "array"] = "object"
    json_reply: bool = False
    name_key: str = "name"
    args_keys: tuple[str, ...] = ("arguments",)
    id_style: Literal["call", "alnum9"] = "call"
    open_ws: str = ""
    parallel: bool = True

    @property
    def has_calls(self) -> bool:
        """Whether replies in this format can call tools at all."""
        return self.json_reply or self.call_open is not None
