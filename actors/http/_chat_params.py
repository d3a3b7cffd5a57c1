"""From a chat request's JSON to the engine's chat options: messages in OpenAI's shape,
the template's variables, tools and the reasoning options, with llama-server's meaning
(the chat core of :mod:`actors.http._openai`, and of the Anthropic and Responses
adapters). Runs on the event loop; pure functions of the JSON body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.http._errors import HttpError
from actors.http._params import _bool, _int, _show

__all__ = [
    "chat_messages",
    "continuation",
    "template_kwargs",
    "text_content",
    "tool_options",
    "tools_option",
]


def _fail(message: str) -> HttpError:
    return HttpError(400, message)


def continuation(body: Mapping[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's ``add_generation_prompt`` and ``continue_final_message`` (vLLM's):
    a final assistant message is always continued (a prefill); otherwise the assistant's
    turn is opened unless ``add_generation_prompt`` is false. The engine's option, if any."""
    add = _bool(body, "add_generation_prompt")
    cont = _bool(body, "continue_final_message")
    if add and cont:
        raise _fail("add_generation_prompt and continue_final_message cannot both be true")
    prefill = len(messages) > 1 and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    if cont and not prefill:
        raise _fail("continue_final_message needs a final assistant message to continue")
    return {"add_generation_prompt": False} if add is False and not prefill else {}


def tools_option(body: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's ``tools`` for a template's render (``/apply-template``, the input token
    count): llama-server passes a non-empty list to the template, as is. Only the type is
    checked here; the tokenizer checks size and depth."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return {}
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise _fail("'tools' must be a list of objects")
    return {"tools": tools}


def template_kwargs(defaults: tuple[tuple[str, Any], ...], body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's variables: the server's (``--reasoning``,
    ``--chat-template-kwargs``) under the request's ``chat_template_kwargs``; the
    engine checks names, types and sizes."""
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, Mapping):
        raise _fail("'chat_template_kwargs' must be an object")
    return {**dict(defaults), **(given or {})}


def chat_messages(value: object) -> list[dict[str, Any]]:
    """OpenAI ``messages`` as the engine's dicts: text parts are joined, ``developer`` is
    a system message; an assistant's ``tool_calls`` and ``reasoning_content`` and a tool
    result's ``tool_call_id`` and ``name`` pass on (the engine checks them); images and
    audio are refused."""
    if not isinstance(value, list) or not value:
        raise _fail("'messages' must be a non-empty list")
    messages = []
    for message in value:
        if not isinstance(message, Mapping):
            raise _fail("each message must be an object with 'role' and 'content'")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise _fail(f"message role {str(role)[:40]!r} is not supported (system, user, assistant, tool)")
        content = text_content(message.get("content"), allow_none=role == "assistant")
        entry: dict[str, Any] = {"role": role, "content": content}
        for name in ("tool_calls", "reasoning_content") if role == "assistant" else ("tool_call_id", "name"):
            if message.get(name) is not None:
                entry[name] = message[name]
        if role == "assistant" and message.get("function_call") is not None:
            raise _fail("'function_call' (OpenAI's deprecated functions) is not supported; use tool_calls")
        messages.append(entry)
    if len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
        raise _fail("a chat cannot end with two assistant messages")
    return messages


def text_content(content: object, *, allow_none: bool = False) -> str:
    """A message's content as text: a string, or text parts joined by a blank line (as
    llama-server joins them); None is "" where ``allow_none``."""
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _fail(f"content parts of type {str(kind)[:40]!r} are not supported (text only)")
            text = part.get("text")
            if not isinstance(text, str):
                raise _fail("a text content part needs a string 'text'")
            texts.append(text)
        return "\n\n".join(texts)  # llama-server joins a message's text parts so
    if not isinstance(content, str):
        raise _fail("a message's 'content' must be a string or a list of text parts")
    return content


_REASONING_FORMATS = ("auto", "none", "deepseek")


def tool_options(
    body: Mapping[str, Any],
    reasoning_default: str | None,
    budget_default: int | None = None,
    budget_message: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and llama-server's
    ``reasoning_format`` and thinking budget (``reasoning_budget_tokens`` or
    ``thinking_budget_tokens``, -1 the server's; ``reasoning_budget_message``), as engine
    options (the engine checks the tools themselves)."""
    options: dict[str, Any] = {}
    budget = _int(body, "reasoning_budget_tokens")
    if budget is None:
        budget = _int(body, "thinking_budget_tokens")
    reasoning = body.get("reasoning_format", reasoning_default)
    if budget is None or budget == -1:
        budget = budget_default if reasoning != "none" else None
    if budget is not None:
        options["reasoning_budget"] = budget
        message = body.get("reasoning_budget_message", budget_message)
        if message is not None:
            options["reasoning_budget_message"] = message
    tools = body.get("tools")
    if tools is not None and tools != []:
        if not isinstance(tools, list):
            raise _fail("'tools' must be a list of function tools")
        options["tools"] = tools
    if body.get("functions"):
        raise _fail("'functions' (OpenAI's deprecated form of tools) is not supported; use 'tools'")
    choice = body.get("tool_choice")
    if choice is not None:
        options["tool_choice"] = choice
    parallel = _bool(body, "parallel_tool_calls")
    if parallel is not None:
        options["parallel_tool_calls"] = parallel
    if reasoning is not None:
        if reasoning not in _REASONING_FORMATS:
            raise _fail(
                f"'reasoning_format' must be one of {', '.join(_REASONING_FORMATS)}, got {_show(reasoning)}"
            )
        options["reasoning_format"] = reasoning
    return options
