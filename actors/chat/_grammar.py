"""The grammar that makes a reply call tools the way its format writes them.

Pure text building (any thread): tool parameter schemas become GBNF through the
caller's converter (llama-cpp-python's, passed in), then are wrapped in the format's
markers.

- ``tool_choice`` ``"required"`` or a named function: the whole reply is constrained
  (after an optional thinking block, when the format thinks): it must be calls.
- ``"auto"``: the grammar is *lazy*: free text until the format's call marker appears
  (a trigger), constrained from the marker on. The generic format has no marker; its
  whole reply is one JSON document holding either calls or the answer.

Formats whose calls are JSON objects holding their name (Hermes, Mistral, Command
R7B...) convert one schema, "a call of one of these tools". Formats whose name
stands outside the arguments (tagged calls, GPT-OSS's channels) convert each tool's
parameters on its own, in :mod:`actors.chat._grammar_tagged`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.chat._grammar_tagged import named_tool_grammar
from actors.chat._rules import (
    WS,
    ToolGrammar,
    embedded,
    literal,
    parameters_of,
    pattern,
    plain,
    prefixed,
    think_prefix,
    with_defs,
)
from actors.chat._syntax import Syntax

__all__ = ["ToolGrammar", "call_schema", "tool_grammar"]


def call_schema(
    tools: Sequence[Mapping[str, Any]], syntax: Syntax, *, only: str | None = None
) -> dict[str, Any]:
    """The JSON Schema of one call object: ``{"name": <a tool's name>, <args key>:
    <its parameters>}``, one alternative per tool (only the named one, with ``only``).
    A format with an ``id_key`` gets it first, a counter as a string; one with a
    ``trailing_id`` may end with it."""
    alternatives = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(plain(tools)):
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        properties: dict[str, Any] = {}
        if syntax.id_key is not None:
            properties[syntax.id_key] = {"type": "string", "pattern": "^[0-9]{1,3}$"}
        properties[syntax.name_key] = {"const": function["name"]}
        properties[syntax.args_keys[0]] = embedded(parameters_of(function), f"tool_{i}", defs)
        required = list(properties)
        if syntax.trailing_id is not None:
            properties[syntax.trailing_id] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        alternatives.append({"type": "object", "properties": properties, "required": required})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return with_defs(schema, defs)


def tool_grammar(
    syntax: Syntax,
    tools: Sequence[Mapping[str, Any]],
    choice: str | Mapping[str, Any],
    *,
    parallel: bool,
    convert: Callable[[Mapping[str, Any]], str],
    thinking: bool = False,
    response_schema: Mapping[str, Any] | None = None,
) -> ToolGrammar | None:
    """The grammar for a chat with ``tools`` under ``choice`` (``"auto"``,
    ``"required"`` or ``{"type": "function", "function": {"name": ...}}``).

    ``convert`` turns a JSON Schema into GBNF (it checks the schema's cost first);
    ``thinking`` says the prompt left the reply inside a thinking block. None when the
    format cannot call tools (nothing to constrain).

    Raises:
        InvalidRequest: from ``convert``, for a schema it refuses.
    """
    if not syntax.has_calls:
        return None
    only = choice["function"]["name"] if isinstance(choice, Mapping) else None
    required = choice != "auto"
    parallel = parallel and syntax.parallel and only is None
    if syntax.body in ("tagged", "channels"):
        functions = [t["function"] for t in plain(tools) if only is None or t["function"]["name"] == only]
        return named_tool_grammar(
            syntax, functions, required=required, parallel=parallel, convert=convert, thinking=thinking
        )
    one_call = call_schema(tools, syntax, only=only)
    if syntax.json_reply:
        return ToolGrammar(convert(_generic_schema(one_call, parallel, required, response_schema)))
    body, call_rule = prefixed(convert(one_call), "a0-")
    opener, closer = syntax.call_open or "", syntax.call_close
    rules: list[str] = []
    if syntax.body == "array":
        sep = f'"," {WS}'
        inner = (
            f'"[" {WS} {call_rule} ( {sep} {call_rule} )* {WS} "]"'
            if parallel
            else f'"[" {WS} {call_rule} {WS} "]"'
        )
        tail = f" {WS} {literal(closer)}" if closer else ""
        rules.append(
            f"tool-block ::= {literal(opener)} {WS} {inner}{tail}" if opener else f"tool-block ::= {inner}"
        )
        rules.append("tool-calls ::= tool-block")
    else:
        # Whitespace after the marker is free: a lazy grammar replays the token that
        # completed the marker, which may carry the newline and more.
        head = f"{literal(opener)} {WS} " if opener else ""
        tail = f" {WS} {literal(closer)}" if closer else ""
        rules.append(f"tool-block ::= {head}{call_rule}{tail}")
        more = f" ( {WS} tool-block )*" if parallel else ""
        rules.append(f"tool-calls ::= tool-block{more}")
    if required:
        think = think_prefix(syntax, thinking, rules)
        rules.append(f"root ::= {think}tool-calls")
        return ToolGrammar("\n".join([*rules, body]))
    rules.append("root ::= tool-calls")
    grammar = "\n".join([*rules, body])
    if opener:
        return ToolGrammar(grammar, lazy=True, trigger_patterns=(pattern(opener),), trigger_words=(opener,))
    # A bare JSON call that begins the reply (Llama 3.x): the reply's first character.
    return ToolGrammar(grammar, lazy=True, trigger_patterns=(r"^\s*(\{[\s\S]*)$",))


def _generic_schema(
    one_call: dict[str, Any], parallel: bool, required: bool, response_schema: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The generic format's whole reply: the calls, or (under ``"auto"``) the answer
    (the ``$defs`` of both at its root)."""
    one_call = dict(one_call)
    defs: dict[str, Any] = one_call.pop("$defs", {})
    calls: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
    }
    if required:
        return with_defs(schema, defs)
    answer = (
        embedded(plain(response_schema), "response", defs)
        if response_schema is not None
        else {"type": "string"}
    )
    answered = {"type": "object", "properties": {"response": answer}, "required": ["response"]}
    return with_defs({"anyOf": [schema, answered]}, defs)
