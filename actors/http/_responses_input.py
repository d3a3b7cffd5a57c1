"""OpenAI's Responses API, its request: ``instructions`` and ``input`` (a string, or
items: messages, ``function_call``, ``function_call_output``, ``reasoning``), function
``tools``, ``tool_choice``, ``text.format`` and the sampling fields, as the OpenAI chat
body the chat core parses (:func:`openai_body`). Pure functions of the JSON body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.http._chat_params import text_content
from actors.http._errors import HttpError

__all__ = ["openai_body"]


def _fail(message: str) -> HttpError:
    return HttpError(400, message)


def _item_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses ``input`` items as OpenAI chat messages: consecutive function calls
    join one assistant message, as a turn that called several tools."""
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _fail(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _fail(f"input[{i}]: role {str(role)[:40]!r} is not supported")
            content = item.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, Mapping) and part.get("type") in ("input_image", "input_file"):
                        raise _fail(f"{part['type']} is not supported by this server (text only)")
            entry: dict[str, Any] = {"role": role, "content": text_content(content)}
            if role == "assistant" and reasoning:
                entry["reasoning_content"], reasoning = reasoning, ""
            out.append(entry)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                entry = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    entry["reasoning_content"], reasoning = reasoning, ""
                out.append(entry)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = text_content(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if isinstance(parts, list):
                reasoning += "".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
        else:
            raise _fail(f"input items of type {str(kind)[:40]!r} are not supported")
    return out


def openai_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request as an OpenAI chat body (messages included)."""
    if body.get("previous_response_id") is not None:
        raise _fail(
            "'previous_response_id' is not supported: this server stores no responses; send the input"
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": text_content(instructions)})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += _item_messages(given)
    else:
        raise _fail("'input' must be a string or a list of input items")
    oai: dict[str, Any] = {"messages": messages}
    for name in ("temperature", "top_p", "model", "parallel_tool_calls", "stream", "truncate"):
        if body.get(name) is not None:
            oai[name] = body[name]
    if body.get("max_output_tokens") is not None:
        oai["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _fail("'tools' must be a list")
        converted = []
        for tool in tools:
            if not isinstance(tool, Mapping) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
                raise _fail(f"tools of type {str(kind)[:40]!r} are not supported (function tools only)")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            converted.append({"type": "function", "function": function})
        if converted:
            oai["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        oai["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        oai["tool_choice"] = choice
    text = body.get("text")
    if isinstance(text, Mapping) and isinstance(text.get("format"), Mapping):
        fmt = text["format"]
        if fmt.get("type") == "json_schema":
            oai["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        elif fmt.get("type") == "json_object":
            oai["response_format"] = {"type": "json_object"}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") == "none":
        oai["chat_template_kwargs"] = {"enable_thinking": False}
    for name in ("timings_per_token", "return_progress"):
        if body.get(name) is not None:
            oai[name] = body[name]
    return oai
