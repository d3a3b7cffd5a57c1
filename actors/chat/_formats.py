"""Which format a chat template speaks, what it can render, and the history it gets.

:func:`detect` reads a template's source and probes it by rendering (once, when the
model loads): whether it renders a system message, the tools, an assistant's tool
calls (and whether their arguments as an object), a tool's result, and whether it has
an ``enable_thinking`` switch; the format itself comes from the markers in the source
(:mod:`actors.chat._families`). :func:`template_messages` then turns a checked chat
into the messages the template renders: arguments as the template wants them, and,
for what it cannot render, stand-ins: earlier calls written in the format's own syntax
(the generic format's JSON when it has none), results as JSON text, and the tools
described in the system message (with an example call in the format's syntax).

A template of a known family that neither describes tools nor writes calls was not
made for them: it gets the generic format, which any model can follow under its
grammar.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from actors.chat._families import FORMATS, syntax_of
from actors.chat._rules import plain
from actors.chat._syntax import Syntax
from actors.chat._write import write_calls

__all__ = ["FORMATS", "TemplateInfo", "detect", "template_messages", "tools_prompt"]


@dataclass(frozen=True, slots=True)
class TemplateInfo:
    """What a chat template speaks and renders (found once, by :func:`detect`)."""

    syntax: Syntax
    system: bool = True
    tools: bool = False
    tool_calls: bool = False
    object_arguments: bool = False
    tool_results: bool = False
    enable_thinking: bool = False


Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
"""Renders messages (with tools, or None) with the generation prompt; raises on refusal."""

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_q7",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "integer"}}},
    },
}


def _rendered(render: Render, messages: list[dict[str, Any]]) -> str:
    """The render of ``messages``: with the probe tool (tool-use templates iterate
    ``tools`` unconditionally), else without; "" when the template refuses both."""
    for tools in ([_PROBE_TOOL], None):
        try:
            return render(messages, tools)
        except Exception:  # the template refuses what it cannot render
            continue
    return ""


def detect(source: str, render: Render) -> TemplateInfo:
    """The format and abilities of the template whose text is ``source`` (any thread).

    ``render`` renders with the template (the probes use made-up names, so they find
    only what the template itself writes).
    """
    user = {"role": "user", "content": "probe_user_q7"}
    system = "probe_system_q7" in _rendered(render, [{"role": "system", "content": "probe_system_q7"}, user])
    tools = "probe_tool_q7" in _rendered(render, [user])

    def call(arguments: object) -> list[dict[str, Any]]:
        return [
            user,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call00001",
                        "type": "function",
                        "function": {"name": "probe_call_q7", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call00001", "content": "probe_result_q7"},
        ]

    as_object = _rendered(render, call({"probe_arg": 1}))
    as_text = _rendered(render, call('{"probe_arg": 1}'))
    tool_calls = "probe_call_q7" in as_object or "probe_call_q7" in as_text
    # As an object when the template writes it as JSON, or writes its parameters only
    # when given an object (GLM and Qwen3-Coder write each key in XML, and refuse text).
    object_arguments = "probe_call_q7" in as_object and (
        '"probe_arg": 1' in as_object or ("probe_arg" in as_object and "probe_arg" not in as_text)
    )
    tool_results = "probe_result_q7" in as_object or "probe_result_q7" in as_text
    syntax = syntax_of(source, as_object or as_text)
    if not (tool_calls or tools) and syntax.name != "generic":
        # Neither describes tools nor writes calls: it was not made for them.
        syntax = replace(FORMATS["generic"], think=syntax.think)
    return TemplateInfo(
        syntax=syntax,
        system=system,
        tools=tools,
        tool_calls=tool_calls,
        object_arguments=object_arguments,
        tool_results=tool_results,
        enable_thinking="enable_thinking" in source,
    )


def tools_prompt(tools: Sequence[Mapping[str, Any]], choice: object, syntax: Syntax | None = None) -> str:
    """The system text for a template that does not describe tools: the tools, and how
    to call them (the generic format's JSON, or an example in ``syntax``'s own)."""
    functions = [dict(plain(t)["function"]) for t in tools]
    listing = json.dumps(functions, ensure_ascii=False, indent=2)
    if syntax is not None and not syntax.json_reply and syntax.has_calls and functions:
        example = write_calls(syntax, [(functions[0]["name"], _example_arguments(functions[0]))])
        return f"You can call these tools:\n{listing}\n\nTo call a tool, write the call like this:\n{example}"
    how = (
        'Respond with one JSON object: {"tool_calls": [{"name": <a tool\'s name>, "arguments": <its '
        "arguments>}]} to call tools"
    )
    if choice == "auto":
        how += ', or {"response": <your answer>} to answer the user directly'
    return f"You can call these tools:\n{listing}\n\n{how}."


def _example_arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    properties = (function.get("parameters") or {}).get("properties") or {}
    return {name: "..." for name in properties}


def template_messages(
    messages: Sequence[Mapping[str, Any]],
    info: TemplateInfo,
    tools: Sequence[Mapping[str, Any]] | None,
    choice: object,
) -> list[dict[str, Any]]:
    """Plain messages for the template: tool calls and results as it renders them, or
    as the generic format's JSON text where it cannot; with ``tools`` and a template
    that cannot describe them, the tools prompt joins the system message."""
    out: list[dict[str, Any]] = []
    for message in messages:
        entry = plain(message)
        if info.syntax.body == "channels" and entry.get("reasoning_content"):
            # GPT-OSS's template reads thinking as "thinking", and a turn with calls
            # takes one analysis message: the thinking, not the content (as llama.cpp).
            entry["thinking"] = entry.pop("reasoning_content")
            if entry.get("tool_calls"):
                entry.pop("content", None)
        calls = entry.get("tool_calls")
        if calls:
            if info.tool_calls:
                for call in calls:
                    function = call["function"]
                    if info.object_arguments:
                        function["arguments"] = json.loads(function["arguments"])
                    call.setdefault("id", "")
            else:
                # Written as the model would have written them: in the format's own
                # syntax (the generic format's JSON when it has none).
                written = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
                text = write_calls(info.syntax, written)
                entry = {
                    "role": "assistant",
                    "content": ((entry.get("content") or "") + "\n" + text).lstrip("\n"),
                }
        if entry["role"] == "tool" and not info.tool_results:
            result = {
                "tool_response": {"tool_call_id": entry.get("tool_call_id"), "content": entry["content"]}
            }
            if entry.get("name"):
                result["tool_response"]["name"] = entry["name"]
            entry = {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
        out.append(entry)
    if tools and choice != "none" and not info.tools:
        prompt = tools_prompt(tools, choice, info.syntax)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    if not info.system and out and out[0]["role"] == "system":
        # As llama.cpp: a template without a system role gets it at the head of the next message.
        first = out.pop(0)
        if out:
            out[0] = {**out[0], "content": first["content"] + "\n" + out[0]["content"]}
    return out
