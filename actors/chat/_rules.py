"""What the tool grammars share: their result, and small pieces of GBNF text (pure
text, any thread).

Converted schemas are merged into one grammar by renaming their rules (a prefix per
schema, so two tools' ``string`` rules never meet); literals and character classes
are never touched. :func:`text_until` is free text up to a closing marker, and
:func:`pattern` a trigger pattern for llama.cpp's ``std::regex`` (ECMAScript).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.chat._syntax import Syntax

__all__ = [
    "WS",
    "ToolGrammar",
    "embedded",
    "literal",
    "parameters_of",
    "pattern",
    "plain",
    "prefixed",
    "text_until",
    "think_prefix",
    "with_defs",
]

WS = "[ \\t\\n]{0,20}"
"""Optional whitespace, bounded (a model cannot loop in it)."""

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z0-9-]+|.', re.S)
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")
_REGEX_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


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


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


_CLASS_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "]": "\\]", "[": "\\["}


def _class_char(c: str) -> str:
    """``c`` inside a character class (llama.cpp knows only these escapes)."""
    return _CLASS_ESCAPES.get(c, c)


def text_until(closer: str) -> str:
    """A GBNF expression for any text that does not contain ``closer`` (which the
    caller writes next): one character that cannot begin it, or a proper prefix of it
    followed by a character that does not continue it. Exact when ``closer``'s first
    character does not recur in it (``</think>``, ``<|END_THINKING|>``)."""
    alternatives = [f"[^{_class_char(closer[0])}]"]
    for k in range(1, len(closer)):
        alternatives.append(f"{literal(closer[:k])} [^{_class_char(closer[k])}]")
    return "( " + " | ".join(alternatives) + " )*"


def prefixed(grammar: str, prefix: str) -> tuple[str, str]:
    """``grammar`` with every rule renamed ``prefix + name`` (definitions and
    references); the new name of its ``root``."""
    lines = [line for line in grammar.splitlines() if line.strip()]
    names = {line.split("::=", 1)[0].strip() for line in lines if "::=" in line}
    out = []
    for line in lines:
        head, sep, rhs = line.partition("::=")
        if not sep:
            out.append(_rename(line, names, prefix))  # a rule continued on the next line
            continue
        out.append(prefix + head.strip() + " ::=" + _rename(rhs, names, prefix))
    return "\n".join(out), prefix + "root"


def _rename(rhs: str, names: set[str], prefix: str) -> str:
    return "".join(prefix + m.group(0) if m.group(0) in names else m.group(0) for m in _TOKEN.finditer(rhs))


def pattern(text: str) -> str:
    """``text`` as a regular expression that matches it exactly (ECMAScript)."""
    return "".join(_REGEX_ESCAPES.get(c, "\\" + c if c in _REGEX_SPECIAL else c) for c in text)


def parameters_of(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (an empty object's when it has none)."""
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def embedded(schema: Mapping[str, Any], key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` made fit to sit anywhere inside a larger schema: when it has local
    ``$ref``s (pydantic writes nested models as ``#/$defs/...``), it moves into
    ``defs[key]`` with each ``#...`` ref rebased onto its new place, and a ``$ref`` to it
    stands in; ``defs`` becomes the larger schema's root ``$defs``."""
    if not _has_local_ref(schema):
        return dict(schema)
    base = f"#/$defs/{key}"
    defs[key] = _rebased(schema, base)
    return {"$ref": base}


def with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``defs`` as its root ``$defs`` (none: unchanged)."""
    return {**schema, "$defs": {**schema.get("$defs", {}), **defs}} if defs else schema


def _has_local_ref(value: Any) -> bool:
    if isinstance(value, Mapping):
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_local_ref(v) for v in value)
    return False


def _rebased(value: Any, base: str) -> Any:
    if isinstance(value, Mapping):
        out = {k: _rebased(v, base) for k, v in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(value, list | tuple):
        return [_rebased(v, base) for v in value]
    return value


def think_prefix(syntax: Syntax, thinking: bool, rules: list[str]) -> str:
    """What a required grammar lets come before the calls: the format's thinking
    block (closed, when the prompt opened it; optional, when it did not), as a rule
    appended to ``rules``; its reference, or ``""``."""
    if syntax.think is None:
        return ""
    opener, closer = syntax.think
    body = f"{text_until(closer)} {literal(closer)} {WS}"
    if thinking:
        rules.append(f"tool-think ::= {body}")
        return "tool-think "
    rules.append(f"tool-think ::= {literal(opener)} {body}")
    return "tool-think? "


def plain(value: Any) -> Any:
    """Plain dicts and lists of a frozen JSON value (a schema for the converter)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
