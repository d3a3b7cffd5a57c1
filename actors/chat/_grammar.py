"""The grammar that makes a reply call tools the way its format writes them.

Pure text building (any thread): the tools' parameter schemas become one JSON Schema
of "a call of one of these tools", converted once by the caller's converter (llama-cpp-
python's, passed in), then wrapped in the format's markers.

- ``tool_choice`` ``"required"`` or a named function: the whole reply is constrained
  (after an optional thinking block, when the format thinks): it must be calls.
- ``"auto"``: the grammar is *lazy*: free text until the format's call marker appears
  (a trigger), constrained from the marker on. The generic format has no marker; its
  whole reply is one JSON document holding either calls or the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.chat._syntax import Syntax

__all__ = ["ToolGrammar", "call_schema", "tool_grammar"]

_THINK_BODY = '( [^<] | "<" [^/] )*'
"""Thinking, as the required grammar lets it pass: any text without ``</`` (the close
marker's start), then the close marker."""


@dataclass(frozen=True, slots=True)
class ToolGrammar:
    """A GBNF grammar (its start rule is ``root``) and, when lazy, what triggers it.

    ``trigger_patterns`` are regular expressions searched in the reply so far (the
    grammar applies from the first capture group, or the match); ``trigger_words`` are
    texts that trigger it when one token spells them exactly.
    """

    grammar: str
    lazy: bool = False
    trigger_patterns: tuple[str, ...] = ()
    trigger_words: tuple[str, ...] = ()


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_schema(
    tools: Sequence[Mapping[str, Any]], syntax: Syntax, *, only: str | None = None
) -> dict[str, Any]:
    """The JSON Schema of one call object: ``{"name": <a tool's name>, <args key>:
    <its parameters>}``, one alternative per tool (only the named one, with ``only``)."""
    alternatives = []
    for tool in _plain(tools):
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        alternatives.append(
            {
                "type": "object",
                "properties": {syntax.name_key: {"const": function["name"]}, syntax.args_keys[0]: parameters},
                "required": [syntax.name_key, syntax.args_keys[0]],
            }
        )
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


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
    one_call = call_schema(tools, syntax, only=only)
    if syntax.json_reply:
        calls: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
        }
        if not required:
            answer = _plain(response_schema) if response_schema is not None else {"type": "string"}
            schema = {
                "anyOf": [
                    schema,
                    {"type": "object", "properties": {"response": answer}, "required": ["response"]},
                ]
            }
        return ToolGrammar(convert(schema))
    body = convert(one_call)
    names = _free_names(body)
    call_rule, block, calls_rule = names("call"), names("block"), names("calls")
    body = _rename_root(body, call_rule)
    opener, closer = syntax.call_open or "", syntax.call_close
    if syntax.body == "array":
        sep = '"," " "?'
        inner = (
            f'"[" " "? {call_rule} ( {sep} {call_rule} )* "]"' if parallel else f'"[" " "? {call_rule} "]"'
        )
        rules = [f"{block} ::= {_literal(opener)} {inner}" if opener else f"{block} ::= {inner}"]
        rules.append(f"{calls_rule} ::= {block}")
    else:
        head = _literal(opener + syntax.open_ws) + " " if opener else ""
        tail = f" [ \\t\\n]* {_literal(closer)}" if closer else ""
        rules = [f"{block} ::= {head}{call_rule}{tail}"]
        more = f" ( [ \\t\\n]* {block} )*" if parallel else ""
        rules.append(f"{calls_rule} ::= {block}{more}")
    if required:
        think = ""
        if syntax.think is not None:
            think_rule = names("think")
            close = _literal(syntax.think[1])
            if thinking:
                rules.append(f"{think_rule} ::= {_THINK_BODY} {close} [ \\t\\n]*")
                think = f"{think_rule} "
            else:
                rules.append(f"{think_rule} ::= {_literal(syntax.think[0])} {_THINK_BODY} {close} [ \\t\\n]*")
                think = f"{think_rule}? "
        rules.append(f"root ::= {think}{calls_rule}")
        return ToolGrammar("\n".join([*rules, body]))
    rules.append(f"root ::= {calls_rule}")
    grammar = "\n".join([*rules, body])
    if opener:
        return ToolGrammar(grammar, lazy=True, trigger_patterns=(re.escape(opener),), trigger_words=(opener,))
    # A bare JSON call that begins the reply (Llama 3.x): the reply's first character.
    return ToolGrammar(grammar, lazy=True, trigger_patterns=(r"^\s*(\{[\s\S]*)$",))


def _free_names(grammar: str) -> Callable[[str], str]:
    """Rule names for the wrapper that the converted grammar does not use."""
    used = {line.split("::=", 1)[0].strip() for line in grammar.splitlines() if "::=" in line}
    prefix = "tool"
    while any(name.startswith(prefix + "-") for name in used):
        prefix += "x"
    return lambda name: f"{prefix}-{name}"


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9-]+|.', re.S)


def _rename_root(grammar: str, name: str) -> str:
    """``grammar`` with its rule ``root`` (definition and references) named ``name``;
    literals and character classes are left alone."""
    out = []
    for line in grammar.splitlines():
        head, sep, rhs = line.partition("::=")
        if not sep:
            out.append(line)
            continue
        head = name + " " if head.strip() == "root" else head
        parts = [name if m.group(0) == "root" else m.group(0) for m in _TOKEN.finditer(rhs)]
        out.append(head + sep + "".join(parts))
    return "\n".join(out)


def _plain(value: Any) -> Any:
    """Plain dicts and lists of a frozen JSON value (a schema for the converter)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
