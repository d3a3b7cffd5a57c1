"""How a model family writes its thinking and its tool calls: plain data.

A :class:`Syntax` is what the reply parser (:mod:`actors.chat._parse`) and the
grammar builder (:mod:`actors.chat._grammar`) need to know about a format; the
formats themselves (which template gets which syntax) are in
:mod:`actors.chat._families`. Frozen, so one crosses threads and pickles as it is.

Three layouts of calls exist:

- JSON bodies (``body`` ``"object"`` or ``"array"``): a marker, then the call as a
  JSON object that holds its name and its arguments (Hermes' ``<tool_call>{...}``,
  Mistral's ``[TOOL_CALLS][...]``, Command R7B's ``<|START_ACTION|>[...]``), or the
  whole reply as one JSON document (the generic format).
- Tagged calls (``body`` ``"tagged"``, described by a :class:`Tagged`): the name
  stands outside the arguments, between markers (Functionary's
  ``<function=NAME>{...}</function>``, DeepSeek's ``tool▁call▁begin`` NAME
  ``tool▁sep`` ``{...}``, its markers between fullwidth bars); the arguments are a
  JSON object, or key/value pairs in XML tags (:class:`XmlArgs`, GLM and Qwen3-Coder)
  that the parser turns into one.
- Channels (``body`` ``"channels"``): GPT-OSS's harmony messages, each with a header
  that names its channel and recipient (:mod:`actors.chat._harmony`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Syntax", "Tagged", "XmlArgs"]

_TAGS = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")


@dataclass(frozen=True, slots=True)
class XmlArgs:
    """Arguments written as one XML-tagged pair per parameter.

    GLM: ``<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n``; Qwen3-Coder:
    ``<parameter=k>\\nv\\n</parameter>\\n``. A string value is written as it is, any
    other as JSON, so a value is read as a string when its parameter's schema says
    so (or when it is not JSON).

    Attributes:
        key_open: the text before a parameter's name.
        key_close: the text after it (and before the value, with ``value_open``).
        value_open: the text that opens the value (``""`` when ``key_close`` does).
        value_close: the text that ends the value.
        trim_newline: one newline at each end of the value belongs to the markup.
    """

    key_open: str
    key_close: str
    value_open: str
    value_close: str
    trim_newline: bool = False


@dataclass(frozen=True, slots=True)
class Tagged:
    """How a format writes a call whose name stands outside its arguments.

    Every text is the template's own rendering, whitespace included (the grammar
    and :func:`~actors.chat.write_calls` write it so); the parser lets whitespace
    between the words of a text vary.

    Attributes:
        open: what starts each call (``"<function="``, ``"[TOOL_CALLS]"``, ``">>>"``).
        section: the markers around a block of calls, or None.
        before_name: the text between ``open`` and the name (DeepSeek R1's
            ``function`` and ``tool▁sep`` marker, Kimi's ``"functions."``).
        index_sep: the text between the name and a call counter (Kimi's ``":"`` in
            ``functions.NAME:0``), or ``""``.
        id_open: the text that starts a call id between the name and ``after_name``
            (Mistral Small 3.2's ``"[CALL_ID]"``), or ``""``.
        after_name: the text between the name (or id) and the arguments.
        xml: the arguments' XML layout, or None for a JSON object.
        after_args: the text after the arguments (DeepSeek R1's closing fence).
        close: the text that ends a call, or ``""`` when the arguments' end does.
        between: what the template writes between two calls (a grammar lets any
            little whitespace stand there when it is not ``""``: templates of one
            family differ).
        content_name: a recipient whose "call" is content up to the next ``open``
            (Functionary v3.2's ``"all"``), or ``""``.
        raw: ``(marker, tool, key)``: after ``marker`` the rest of the reply is one
            call of ``tool`` with ``{key: <the text>}`` (Functionary v3.1's
            ``<|python_tag|>`` code), unless it is a JSON object (the arguments).
        bare_open: what the model may write for ``open`` and ``before_name`` when it
            skips ``open`` (Qwen3-Coder's ``<function=``), or ``""``.
        name_trigger: ``open`` is plain text that may share a token with the name
            (``<function=``): a lazy grammar wakes on the opener and a tool's name.
    """

    open: str
    section: tuple[str, str] | None = None
    before_name: str = ""
    index_sep: str = ""
    id_open: str = ""
    after_name: str = ""
    xml: XmlArgs | None = None
    after_args: str = ""
    close: str = ""
    between: str = ""
    content_name: str = ""
    raw: tuple[str, str, str] | None = None
    bare_open: str = ""
    name_trigger: bool = False

    @property
    def opener(self) -> str:
        """The text that opens a region of calls (the section's marker, or a call's)."""
        return self.section[0] if self.section else self.open

    @property
    def texts(self) -> tuple[str, ...]:
        """Every marker text of the layout (the special tokens among them must be shown)."""
        texts = [self.open, self.before_name, self.id_open, self.after_name, self.after_args, self.close]
        texts += [*(self.section or ())]
        if self.xml is not None:
            x = self.xml
            texts += [x.key_open, x.key_close, x.value_open, x.value_close]
        if self.raw is not None:
            texts.append(self.raw[0])
        texts.append(self.bare_open)
        # Each text, and the tags in it (DeepSeek R1's "function" and sep marker hold one).
        pieces = [t.strip() for t in texts if t.strip()]
        pieces += [p for t in pieces for p in _TAGS.findall(t)]
        return tuple(dict.fromkeys(pieces))


@dataclass(frozen=True, slots=True)
class Syntax:
    """The markers and the layout of one format's replies.

    Attributes:
        name: the format's name (``"hermes"``, ``"generic"``...), shown in ``GetInfo``.
        think: the markers around thinking (``("<think>", "</think>")``), or None.
        call_open: the text that starts a tool-call region (``"<tool_call>"``); ``""``
            when a call is a bare JSON value that begins the reply (Llama 3.x). For
            tagged calls, the region's opener (:attr:`Tagged.opener`).
        call_close: the text that ends a region, or ``""`` when the JSON value's end
            ends it.
        body: ``"object"``: a region holds one call object; ``"array"``: a JSON array
            of call objects (``[TOOL_CALLS][...]``); ``"tagged"``: calls as ``tagged``
            describes; ``"channels"``: GPT-OSS's harmony messages.
        json_reply: the whole reply is one JSON document that holds either tool calls
            (``{"tool_calls": [...]}``) or the answer (``{"response": ...}``): the
            generic format, for templates that know no tools.
        name_key: the key of a call's function name.
        args_keys: the keys a call's arguments may have, the first one preferred
            (Llama 3.x writes ``parameters``).
        id_key: a key that the grammar makes a call object carry first, a counter
            (Command R7B's ``tool_call_id``), or None.
        trailing_id: a key a call object may end with, its id in ``id_style``
            (Mistral Nemo's ``"id"``), or None.
        id_style: ``"call"`` (``call_`` and 24 letters and digits) or ``"alnum9"``
            (nine letters and digits, which Mistral's templates require).
        open_ws: what the grammar writes right after ``call_open`` (the template's own
            rendering: Hermes writes ``"<tool_call>\\n"``).
        parallel: whether the template can take several calls in one turn.
        tagged: the layout of tagged calls (``body`` ``"tagged"``).
        drop: markers that wrap the answer (Command R7B's ``<|START_RESPONSE|>``),
            taken out of the content.
        opened: the generation prompt ends with the call opener, so the reply starts
            inside it (Functionary v3.2's ``>>>``).
        specials: further marker texts the parser reads whatever the request asks
            (GPT-OSS's channel tokens): their special tokens must be shown.
    """

    name: str
    think: tuple[str, str] | None = None
    call_open: str | None = None
    call_close: str = ""
    body: Literal["object", "array", "tagged", "channels"] = "object"
    json_reply: bool = False
    name_key: str = "name"
    args_keys: tuple[str, ...] = ("arguments",)
    id_key: str | None = None
    trailing_id: str | None = None
    id_style: Literal["call", "alnum9"] = "call"
    open_ws: str = ""
    parallel: bool = True
    tagged: Tagged | None = None
    drop: tuple[str, ...] = ()
    opened: bool = False
    specials: tuple[str, ...] = ()

    @property
    def has_calls(self) -> bool:
        """Whether replies in this format can call tools at all."""
        return self.json_reply or self.call_open is not None or self.body == "channels"

    def markers(self, *, tools: bool, reasoning: bool) -> tuple[str, ...]:
        """The marker texts a reply's parser reads, for a request with ``tools`` and
        ``reasoning`` (the special tokens that spell them must be shown as text)."""
        words = [*self.specials]
        if reasoning and self.think is not None:
            words += self.think
        if tools:
            if self.tagged is not None:
                words += self.tagged.texts
            elif self.call_open:
                words.append(self.call_open)
                if self.call_close:
                    words.append(self.call_close)
        return tuple(dict.fromkeys(w for w in words if w))
