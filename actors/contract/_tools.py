"""The checks of a chat's tools, ``tool_choice`` and tool-call messages (any thread).

A tool is OpenAI's function tool: ``{"type": "function", "function": {"name": ...,
"description": ..., "parameters": <a JSON Schema of an object>}}``. Everything is
checked once, here, and kept as a frozen private copy: names are identifiers a grammar
and a template can carry, parameter schemas pass the same checks as ``json_schema``,
and the sizes are bounded, so no tool list can cost the engine more than a schema can.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from actors.contract._checks import (
    MAX_CHAT_MESSAGES,
    MAX_ID_LENGTH,
    MAX_PROMPT_CHARS,
    MAX_TEMPLATE_KWARGS_DEPTH,
    ROLES,
    _checked_schema,
    _frozen_json,
    _plain,
    _require,
    _show,
    checked_text,
)

__all__ = [
    "MAX_TOOLS",
    "MAX_TOOLS_BYTES",
    "MAX_TOOL_CALLS",
    "REASONING_FORMATS",
    "checked_chat",
    "checked_tool_calls",
    "checked_tool_choice",
    "checked_tools",
]

MAX_TOOLS = 256
"""Tools one chat may offer at most."""
MAX_TOOLS_BYTES = 256 * 1024
"""The JSON text of a chat's tools at most, in bytes (256 KiB)."""
MAX_TOOL_CALLS = 64
"""Tool calls one assistant message of the history may carry at most."""
REASONING_FORMATS = frozenset({"auto", "none", "deepseek"})
"""``reasoning_format`` values: split thinking out (``auto``, ``deepseek``: into
``Completion.reasoning``) or leave it in the text (``none``)."""

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _checked_name(what: str, value: object) -> str:
    _require(
        isinstance(value, str) and _NAME.fullmatch(value) is not None,
        f"{what} must be 1 to 64 letters, digits, '_', '.' or '-', got {_show(value)}",
    )
    assert isinstance(value, str)
    return str.__getitem__(value, slice(None))


def checked_tools(value: object) -> tuple[Mapping[str, Any], ...]:
    """A frozen copy of OpenAI function tools, each ``{"type": "function", "function":
    {"name", "description", "parameters"}}`` (names unique; parameters an object schema).

    Raises:
        InvalidRequest: anything else, or too many or too large.
    """
    _require(
        isinstance(value, Sequence) and not isinstance(value, str | bytes),
        "tools must be a list of {'type': 'function', 'function': {...}} objects",
    )
    assert isinstance(value, Sequence)
    tools = tuple(value)
    _require(len(tools) <= MAX_TOOLS, f"a chat may offer at most {MAX_TOOLS} tools, got {len(tools)}")
    checked: list[Mapping[str, Any]] = []
    names: set[str] = set()
    budget = [MAX_TOOLS_BYTES]
    for i, tool in enumerate(tools):
        _require(isinstance(tool, Mapping), f"tools[{i}] must be an object, got {type(tool).__name__}")
        assert isinstance(tool, Mapping)
        kind = tool.get("type", "function")
        _require(
            kind == "function", f"tools[{i}] has type {_show(kind)}; only 'function' tools are supported"
        )
        function = tool.get("function")
        _require(isinstance(function, Mapping), f"tools[{i}] needs a 'function' object")
        assert isinstance(function, Mapping)
        name = _checked_name(f"tools[{i}].function.name", function.get("name"))
        _require(name not in names, f"two tools are named {name!r}; tool names must be unique")
        names.add(name)
        entry: dict[str, Any] = {"name": name}
        description = function.get("description")
        if description is not None:
            entry["description"] = checked_text(f"tool {name!r}'s description", description, MAX_TOOLS_BYTES)
        parameters = function.get("parameters")
        if parameters is not None:
            _require(
                isinstance(parameters, Mapping), f"tool {name!r}'s parameters must be a JSON Schema object"
            )
            assert isinstance(parameters, Mapping)
            schema = _checked_schema(parameters)
            kind = schema.get("type", "object")
            _require(
                kind == "object" or kind == ["object"],
                f"tool {name!r}'s parameters must describe an object (type 'object'), got type {_show(kind)}",
            )
            entry["parameters"] = schema
        frozen = _frozen_json(
            f"tool {name!r}", {"type": "function", "function": entry}, MAX_TEMPLATE_KWARGS_DEPTH + 4, budget
        )
        checked.append(frozen)
    size = len(json.dumps(_plain(tuple(checked)), ensure_ascii=False).encode("utf-8"))
    _require(size <= MAX_TOOLS_BYTES, f"tools may have at most {MAX_TOOLS_BYTES} bytes of JSON, got {size}")
    return tuple(checked)


def checked_tool_choice(value: object, tools: Sequence[Mapping[str, Any]] | None) -> str | Mapping[str, Any]:
    """``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function":
    {"name": <one of tools>}}`` (a frozen copy); None means ``"auto"``."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        _require(
            value in ("auto", "none", "required"),
            f"tool_choice must be 'auto', 'none', 'required' or a function, got {_show(value)}",
        )
        _require(value != "required" or bool(tools), "tool_choice 'required' needs tools to call")
        return str.__getitem__(value, slice(None))
    _require(
        isinstance(value, Mapping)
        and value.get("type") == "function"
        and isinstance(value.get("function"), Mapping),
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
    )
    assert isinstance(value, Mapping)
    name = _checked_name("tool_choice's function name", value["function"].get("name"))
    _require(
        any(tool["function"]["name"] == name for tool in tools or ()),
        f"tool_choice names {name!r}, which is not one of the chat's tools",
    )
    return MappingProxyType({"type": "function", "function": MappingProxyType({"name": name})})


def checked_tool_calls(value: object, where: str) -> tuple[Mapping[str, Any], ...]:
    """An assistant message's ``tool_calls``, OpenAI-shaped, as frozen copies whose
    ``arguments`` are JSON text of an object (a dict given is written as JSON)."""
    _require(
        isinstance(value, Sequence) and not isinstance(value, str | bytes),
        f"{where}'s tool_calls must be a list of calls",
    )
    assert isinstance(value, Sequence)
    calls = tuple(value)
    _require(len(calls) <= MAX_TOOL_CALLS, f"{where} carries more than {MAX_TOOL_CALLS} tool calls")
    checked = []
    for i, call in enumerate(calls):
        here = f"{where}'s tool_calls[{i}]"
        _require(isinstance(call, Mapping), f"{here} must be an object")
        assert isinstance(call, Mapping)
        function = call.get("function")
        _require(isinstance(function, Mapping), f"{here} needs a 'function' object with a name and arguments")
        assert isinstance(function, Mapping)
        _require(call.get("type", "function") == "function", f"{here} must have type 'function'")
        name = _checked_name(f"{here}.function.name", function.get("name"))
        call_id = call.get("id")
        if call_id is not None:
            call_id = checked_text(f"{here}.id", call_id, 256)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            text = checked_text(f"{here}.function.arguments", arguments, MAX_PROMPT_CHARS)
            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError):
                parsed = None
            _require(
                isinstance(parsed, dict), f"{here}.function.arguments must be the JSON text of an object"
            )
        else:
            _require(
                isinstance(arguments, Mapping), f"{here}.function.arguments must be JSON text or an object"
            )
            try:
                text = json.dumps(_plain(arguments), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError):
                text = ""
            _require(text != "", f"{here}.function.arguments must be a JSON object")
        entry = {"type": "function", "function": MappingProxyType({"name": name, "arguments": text})}
        if call_id is not None:
            entry["id"] = call_id
        checked.append(MappingProxyType(entry))
    return tuple(checked)


def checked_chat(messages: object) -> tuple[Mapping[str, Any], ...]:
    """Frozen copies of a chat's messages: ``role`` and ``content`` (text), and the
    tool-call fields OpenAI defines: an assistant's ``tool_calls`` (its ``content`` may
    then be None, kept as "") and ``reasoning_content``, a tool result's
    ``tool_call_id``, and any message's ``name``. Other keys are dropped."""
    _require(
        isinstance(messages, Sequence) and not isinstance(messages, str | bytes),
        "messages must be a list of {'role': ..., 'content': ...} dicts",
    )
    assert isinstance(messages, Sequence)
    _require(len(messages) > 0, "messages must not be empty")
    _require(len(messages) <= MAX_CHAT_MESSAGES, f"a chat may have at most {MAX_CHAT_MESSAGES} messages")
    checked = []
    total = 0
    for i, message in enumerate(tuple(messages)):
        _require(isinstance(message, Mapping), f"a chat message must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        _require(
            isinstance(role, str) and role in ROLES,
            f"unknown role {_show(role)}; expected one of {sorted(ROLES)}",
        )
        assert isinstance(role, str)
        entry: dict[str, Any] = {"role": str.__getitem__(role, slice(None))}
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None and not (isinstance(calls, list | tuple) and len(calls) == 0):
            entry["tool_calls"] = checked_tool_calls(calls, f"messages[{i}]")
        if content is None and "tool_calls" in entry:
            content = ""
        _require(isinstance(content, str), f"a {role} message needs a str content")
        text = checked_text(f"a {role} message's content", content, MAX_PROMPT_CHARS)
        entry["content"] = text
        total += len(text)
        if role == "assistant" and message.get("reasoning_content") is not None:
            reasoning = checked_text("reasoning_content", message["reasoning_content"], MAX_PROMPT_CHARS)
            entry["reasoning_content"] = reasoning
            total += len(reasoning)
        if role == "tool":
            call_id = message.get("tool_call_id")
            _require(
                isinstance(call_id, str) and call_id != "",
                f"messages[{i}] is a tool result: it needs the tool_call_id of the call it answers",
            )
            entry["tool_call_id"] = checked_text("tool_call_id", call_id, MAX_ID_LENGTH)
        if message.get("name") is not None:
            entry["name"] = checked_text("a message's name", message["name"], MAX_ID_LENGTH)
        _require(
            total <= MAX_PROMPT_CHARS, f"a chat's contents may have at most {MAX_PROMPT_CHARS} characters"
        )
        checked.append(MappingProxyType(entry))
    return tuple(checked)
