"""A chat request's plan: the messages the template renders, the grammar, and how to
read the reply (any thread; the backend renders and tokenizes with it).

The backend renders the messages :func:`~actors.chat.template_messages` makes, then
asks :func:`chat_grammar` for the grammar (which depends on whether the rendered
prompt opened a thinking block). What it returns is plain frozen data: the engine
builds one :class:`~actors.chat.ReplyParser` per choice from a :class:`ReplySpec`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.chat._formats import TemplateInfo
from actors.chat._grammar import ToolGrammar, tool_grammar
from actors.chat._parse import ReplyParser
from actors.chat._rules import WS, literal, plain
from actors.chat._syntax import Syntax
from actors.contract import InvalidRequest

__all__ = ["ReplySpec", "chat_grammar", "param_types", "template_tools"]


@dataclass(frozen=True, slots=True)
class ReplySpec:
    """How to read one chat's reply: what :class:`ReplyParser` is built with.

    ``param_types`` (from :func:`param_types`) tells formats that write arguments as
    XML (GLM, Qwen3-Coder) a string parameter from a JSON one; without it a value
    that parses as JSON is JSON.
    """

    syntax: Syntax
    tools: bool
    reasoning: bool
    thinking: bool = False
    param_types: Mapping[str, Mapping[str, str]] | None = field(default=None, compare=False)

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker texts the parser reads (special tokens spelling them must be shown)."""
        return self.syntax.markers(tools=self.tools, reasoning=self.reasoning)

    def parser(self) -> ReplyParser:
        """A fresh parser for one reply."""
        return ReplyParser(
            self.syntax,
            tools=self.tools,
            reasoning=self.reasoning,
            thinking=self.thinking,
            param_types=self.param_types,
        )


def param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, str]]:
    """Each function's parameters' schema types (``{"get_weather": {"city": "string"}}``),
    where a parameter's schema names one type."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[str(function.get("name"))] = {
            str(k): v["type"]
            for k, v in properties.items()
            if isinstance(v, Mapping) and isinstance(v.get("type"), str)
        }
    return types


def chat_grammar(
    info: TemplateInfo,
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    choice: str | Mapping[str, Any],
    parallel: bool,
    convert: Callable[[Mapping[str, Any]], str],
    thinking: bool,
    response_schema: Mapping[str, Any] | None,
) -> ToolGrammar | None:
    """The grammar of a chat with ``tools`` under ``choice`` (None without tools, or
    with ``"none"``); ``thinking`` says the rendered prompt leaves the reply inside a
    thinking block.

    Raises:
        InvalidRequest: a tool's schema is refused, or ``json_schema`` is combined with
            tools in a format that cannot constrain both.
    """
    if not tools or choice == "none":
        return None
    if response_schema is not None and not info.syntax.json_reply:
        raise InvalidRequest(
            f"json_schema with tools needs the generic format; this model's template writes "
            f"calls as {info.syntax.name!r}, whose answers a grammar cannot constrain alongside"
        )
    syntax = info.syntax
    if thinking and choice != "auto" and syntax.think is not None and not syntax.json_reply:
        # The prompt opened the thinking: the calls are required after it closes. A
        # grammar that walked the thinking text itself costs tens of ms per token over
        # a large vocabulary; a lazy one wakes at the close marker and costs nothing
        # before it (a thinking budget's forced close wakes it too).
        closer = syntax.think[1]
        calls = tool_grammar(
            dataclasses.replace(syntax, think=None),
            tools,
            choice,
            parallel=parallel,
            convert=convert,
            response_schema=response_schema,
        )
        assert calls is not None and not calls.lazy
        lines = calls.grammar.splitlines()
        lines = [
            f"root ::= {literal(closer)} {WS} {line.split('::=', 1)[1].strip()}"
            if line.split("::=", 1)[0].strip() == "root"
            else line
            for line in lines
        ]
        return ToolGrammar(
            "\n".join(lines), lazy=True, trigger_patterns=(re.escape(closer),), trigger_words=(closer,)
        )
    return tool_grammar(
        syntax,
        tools,
        choice,
        parallel=parallel,
        convert=convert,
        thinking=thinking,
        response_schema=response_schema,
    )


def template_tools(
    tools: Sequence[Mapping[str, Any]] | None, info: TemplateInfo
) -> list[dict[str, Any]] | None:
    """The tools as the template renders them (plain), or None when it cannot."""
    return [plain(t) for t in tools] if tools and info.tools else None
