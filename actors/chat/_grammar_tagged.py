"""Grammars for formats whose function name stands outside its arguments.

Tagged calls (``<function=NAME>{...}</function>``, DeepSeek's, Kimi's, Mistral's
``[TOOL_CALLS]NAME[ARGS]{...}``, GLM's and Qwen3-Coder's XML arguments) and GPT-OSS's
channels: each tool gets its own alternative, its name written as a literal and its
arguments constrained by its own parameters schema (converted on its own, its rules
renamed ``a<i>-...``). XML arguments are constrained one parameter at a time: a
string parameter is free text up to its closing tag (as the template writes it), any
other is its schema's JSON; parameters come in the schema's order, the required ones
always. Under ``"required"`` the format's thinking may come first, as with JSON
bodies (GPT-OSS: one analysis message, then the call; ``<|call|>`` ends the
generation, so it makes one call).

Lazy grammars (``"auto"``) wake on the format's opener, which is a special token for
most of these models. Where the opener is plain text that the next characters may
share a token with (Functionary's ``<function=`` and ``>>>``), the trigger is the
opener *with* a tool's name: llama.cpp replays the token that completed the match
into the grammar, and a replayed text the grammar refuses aborts the process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.chat._rules import (
    WS,
    ToolGrammar,
    literal,
    parameters_of,
    pattern,
    prefixed,
    text_until,
    think_prefix,
)
from actors.chat._syntax import Syntax, Tagged, XmlArgs

__all__ = ["named_tool_grammar"]

Convert = Callable[[Mapping[str, Any]], str]

_CHANNELS = '( "commentary" | "analysis" )'


def named_tool_grammar(
    syntax: Syntax,
    functions: Sequence[Mapping[str, Any]],
    *,
    required: bool,
    parallel: bool,
    convert: Convert,
    thinking: bool,
) -> ToolGrammar:
    """The grammar of calls of ``functions`` (plain dicts) in a tagged or channel
    format: the whole reply under ``required``, else lazy (see the module's docstring).

    Raises:
        InvalidRequest: from ``convert``, for a schema it refuses.
    """
    rules: list[str] = []
    alternatives = []
    for i, function in enumerate(functions):
        args = _arguments(syntax.tagged, function, i, convert, rules)
        alternatives.append(f"tool-fn-{i}")
        name = function["name"]
        if syntax.tagged is None:
            rules.append(f"tool-fn-{i} ::= {_harmony_head(name)} {args}")
        else:
            rules.append(
                f"tool-fn-{i} ::= {_tagged_head(syntax.tagged, name)} {args}{_tagged_tail(syntax.tagged)}"
            )
    rules.append("tool-call ::= " + " | ".join(alternatives))
    if syntax.tagged is None:
        return _harmony(rules, required)
    t = syntax.tagged
    # Between calls any little whitespace: templates of one family differ there.
    between, one = f"{WS} " if t.between else "", f"{literal(t.open)} tool-call"
    if syntax.opened:
        more = f" ( {between}{literal(t.open)} tool-call )*" if parallel else ""
        calls = f"tool-call{more}"
    else:
        more = f" ( {between}{one} )*" if parallel else ""
        calls = f"{one}{more}"
        if t.section is not None:
            calls = f"{literal(t.section[0])} {calls} {literal(t.section[1])}"
    rules.append(f"tool-calls ::= {calls}")
    if required:
        rules.append(f"root ::= {think_prefix(syntax, thinking, rules)}tool-calls")
        return ToolGrammar("\n".join(rules))
    rules.append("root ::= tool-calls")
    names = "(?:" + "|".join(pattern(f["name"]) for f in functions) + ")"
    if syntax.opened:
        # The prompt ends with the opener: a name at the start, or after the opener.
        after = pattern(t.after_name)
        triggers: tuple[str, ...] = (f"^\\s*({names}{after})", f"{pattern(t.open)}({names}{after})")
        return ToolGrammar("\n".join(rules), lazy=True, trigger_patterns=triggers)
    if t.name_trigger:
        triggers = (f"({pattern(t.open + t.before_name)}{names}{pattern(t.after_name.strip())})",)
        return ToolGrammar("\n".join(rules), lazy=True, trigger_patterns=triggers)
    return ToolGrammar(
        "\n".join(rules), lazy=True, trigger_patterns=(pattern(t.opener),), trigger_words=(t.opener,)
    )


def _tagged_head(t: Tagged, name: str) -> str:
    """A call's text before its arguments (after ``open``)."""
    parts = [literal(t.before_name + name)] if t.before_name else [literal(name)]
    if t.index_sep:
        parts.append(f"{literal(t.index_sep)} [0-9]{{1,3}}")
    if t.id_open:
        parts.append(f"{literal(t.id_open)} [a-zA-Z0-9]{{9}}")
    if t.after_name:
        parts.append(literal(t.after_name))
    return " ".join(parts)


def _tagged_tail(t: Tagged) -> str:
    tail = t.after_args + t.close
    return f" {literal(tail)}" if tail else ""


def _arguments(
    t: Tagged | None, function: Mapping[str, Any], i: int, convert: Convert, rules: list[str]
) -> str:
    """The rule of one function's arguments (its rules appended to ``rules``)."""
    parameters = parameters_of(function)
    if t is None or t.xml is None:
        body, root = prefixed(convert(parameters), f"a{i}-")
        rules.append(body)
        return root
    return _xml_arguments(t.xml, parameters, i, convert, rules)


def _xml_arguments(
    x: XmlArgs, parameters: Mapping[str, Any], i: int, convert: Convert, rules: list[str]
) -> str:
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    closer = x.value_close.strip()
    name = f"tool-args-{i}"
    if not properties:
        key = "[A-Za-z0-9_.-]{1,64}"
        rules.append(
            f"{name} ::= ( {literal(x.key_open)} {key} {literal(x.key_close + x.value_open)} "
            f"{text_until(closer)} {literal(x.value_close)} )*"
        )
        return name
    parts = []
    for j, (key, schema) in enumerate(properties.items()):
        value = _xml_value(schema, parameters, closer, f"a{i}-{j}-", convert, rules)
        item = f"{literal(x.key_open + key + x.key_close + x.value_open)} {value} {literal(x.value_close)}"
        parts.append(item if key in required else f"( {item} )?")
    rules.append(f"{name} ::= " + " ".join(parts))
    return name


def _xml_value(
    schema: Any, parameters: Mapping[str, Any], closer: str, prefix: str, convert: Convert, rules: list[str]
) -> str:
    """One XML value: a string as the template writes it (raw), anything else JSON."""
    if not isinstance(schema, Mapping):
        return text_until(closer)
    choices = schema.get("enum")
    if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
        return "( " + " | ".join(literal(c) for c in choices) + " )"
    if schema.get("type") == "string":
        return text_until(closer)
    alone = dict(schema)
    for defs in ("$defs", "definitions"):  # a $ref in the parameter points at the parameters' own
        if defs in parameters and defs not in alone:
            alone[defs] = parameters[defs]
    body, root = prefixed(convert(alone), prefix)
    rules.append(body)
    return root


def _harmony_head(name: str) -> str:
    """GPT-OSS's header of a call: the recipient in the role's header or the
    channel's, an optional constraint, then the message marker."""
    recipient = literal(" to=functions." + name)
    return (
        f'( {recipient} "<|channel|>" {_CHANNELS} | "<|channel|>" {_CHANNELS} {recipient} ) '
        '( " <|constrain|>json" | " json" )? "<|message|>"'
    )


def _harmony(rules: list[str], required: bool) -> ToolGrammar:
    if required:
        # Its thinking first (an analysis message), then the call.
        analysis = f'"<|channel|>analysis<|message|>" {text_until("<|end|>")} "<|end|>" "<|start|>assistant"'
        rules.append(f"root ::= ( {analysis} )? tool-call")
        return ToolGrammar("\n".join(rules))
    rules.append("root ::= tool-call")
    channel = r"<\|channel\|>(?:commentary|analysis)"
    triggers = (
        r"^( to=functions\.)",
        rf"^({channel} to=functions\.)",
        r"<\|start\|>assistant( to=functions\.)",
        rf"<\|start\|>assistant({channel} to=functions\.)",
    )
    return ToolGrammar("\n".join(rules), lazy=True, trigger_patterns=triggers)
