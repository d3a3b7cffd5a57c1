"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

An adapter over the chat core: a request's ``system``, content blocks (``text``,
``tool_use``, ``tool_result``, ``thinking``), ``tools``, ``tool_choice``, ``thinking``
and sampling fields become an OpenAI-shaped chat body, which the OpenAI parser turns
into the engine's messages and options (so both APIs check values the same way); the
engine's completion or stream is rendered back as Anthropic's message, or its
server-sent events (``message_start``, ``content_block_start``/``_delta``/``_stop``,
``message_delta``, ``message_stop``).

Handlers run on the event loop; the engine is reached only through the public helpers.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import Completion, Done, EngineError, Progress, Token
from actors.http._chat_params import chat_messages, text_content
from actors.http._errors import HttpError, from_engine_error
from actors.http._generation import Opened, complete, dumps, error_event, open_stream
from actors.http._native import json_response
from actors.http._openai import chat_options
from actors.http._params import echoed_model
from actors.http._service import Service, request_client, routed
from actors.http._stream import EventStream

__all__ = ["count_tokens", "messages"]


def _fail(message: str) -> HttpError:
    return HttpError(400, message)


def _blocks(content: object, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _fail(f"{where}: 'content' must be a string or a list of content blocks")
    for block in content:
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _fail(f"{where}: each content block must be an object with a 'type'")
    return content


def _result_text(block: Mapping[str, Any]) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image":
                raise _fail("image input is not supported by this server (a tool_result holds an image)")
        content = [p for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
    text = text_content(content, allow_none=True)
    return f"Error: {text}" if block.get("is_error") is True else text


def openai_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's ``system`` and ``messages`` as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = text_content(system)
        if text:
            out.append({"role": "system", "content": text})
    given = body.get("messages")
    if not isinstance(given, list):
        raise _fail("'messages' must be a list")
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise _fail(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _fail(f"{where}: role {str(role)[:40]!r} is not supported (user, assistant)")
        texts: list[str] = []
        if role == "assistant":
            calls, thinking = [], []
            for block in _blocks(message.get("content"), where):
                kind = block["type"]
                if kind == "text":
                    texts.append(str(block.get("text", "")))
                elif kind == "tool_use":
                    arguments = block.get("input", {})
                    if not isinstance(arguments, Mapping):
                        raise _fail(f"{where}: a tool_use block's 'input' must be an object")
                    calls.append(
                        {
                            "id": block.get("id"),
                            "type": "function",
                            "function": {"name": block.get("name"), "arguments": json.dumps(arguments)},
                        }
                    )
                elif kind == "thinking":
                    thinking.append(str(block.get("thinking", "")))
                elif kind != "redacted_thinking":
                    raise _fail(f"{where}: content blocks of type {kind[:40]!r} are not supported here")
            entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            if thinking:
                entry["reasoning_content"] = "".join(thinking)
            out.append(entry)
            continue
        for block in _blocks(message.get("content"), where):
            kind = block["type"]
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_result":
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _result_text(block)}
                )
            elif kind in ("image", "document"):
                raise _fail(f"{kind} input is not supported by this server (text only)")
            else:
                raise _fail(f"{where}: content blocks of type {kind[:40]!r} are not supported")
        if texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic's ``tools`` and ``tool_choice`` as OpenAI's."""
    oai: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _fail("'tools' must be a list")
        converted = []
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise _fail("each tool must be an object")
            if tool.get("type") not in (None, "custom"):
                raise _fail(
                    f"tools of type {str(tool.get('type'))[:40]!r} are not supported (client tools only)"
                )
            function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            converted.append({"type": "function", "function": function})
        if converted:
            oai["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, Mapping):
            raise _fail("'tool_choice' must be an object")
        kind = choice.get("type")
        mapping = {"auto": "auto", "any": "required", "none": "none"}
        if kind == "tool":
            oai["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in mapping:
            oai["tool_choice"] = mapping[kind]
        else:
            raise _fail("'tool_choice' type must be auto, any, tool or none")
        if choice.get("disable_parallel_tool_use") is True:
            oai["parallel_tool_calls"] = False
    return oai


def openai_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic request as an OpenAI chat body (messages included)."""
    if not isinstance(body, Mapping):
        raise _fail("the request body must be a JSON object")
    oai: dict[str, Any] = {"messages": openai_messages(body), **_tools(body)}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "stream", "model", "truncate"):
        if body.get(name) is not None:
            oai[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        oai["stop"] = stops
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, Mapping) or thinking.get("type") not in (
            "enabled",
            "disabled",
            "adaptive",
        ):
            raise _fail("'thinking' must be {'type': 'enabled' | 'disabled', ...}")
        oai["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
        if thinking["type"] == "enabled" and thinking.get("budget_tokens") is not None:
            oai["thinking_budget_tokens"] = thinking["budget_tokens"]
    return oai


_STOP_REASONS = {
    "eog": "end_turn",
    "tool_calls": "tool_use",
    "stop": "stop_sequence",
    "max_tokens": "max_tokens",
    "length": "max_tokens",
}


def _stop_reason(done: Completion) -> str:
    return _STOP_REASONS.get(done.stop_reason, "end_turn")


def _usage(done: Completion) -> dict[str, int]:
    return {
        "input_tokens": done.prompt_tokens - done.prefix_cache_tokens,
        "output_tokens": done.generated_tokens,
        "cache_read_input_tokens": done.prefix_cache_tokens,
        "cache_creation_input_tokens": 0,
    }


def content_blocks(done: Completion) -> list[dict[str, Any]]:
    """A completion's Anthropic content: thinking, text, then its tool calls."""
    blocks: list[dict[str, Any]] = []
    if done.reasoning:
        blocks.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    if done.text or not done.tool_calls:
        blocks.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
        )
    return blocks


def _parse(service: Service, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    oai = openai_body(body)
    messages = chat_messages(oai["messages"])
    return messages, chat_options(service, oai)


async def messages(request: Request) -> Response | EventStream:
    """``POST /v1/messages``: Anthropic's Messages API over the chat core."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    chat, options = await service.parse(request_client(request), lambda: _parse(service, body))
    msg_id, model = f"msg_{secrets.token_hex(12)}", echoed_model(body, service.model_ids[0])
    if body.get("stream") is not True:
        done = (await complete(service, request, prompt=None, messages=chat, options=options))[0]
        return json_response(
            {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content_blocks(done),
                "stop_reason": _stop_reason(done),
                "stop_sequence": done.stop_string,
                "usage": _usage(done),
            }
        )
    opened = await open_stream(
        service, request, prompt=None, messages=chat, options={**options, "progress": True}
    )
    return EventStream(_events(opened, msg_id, model))


def _sse(kind: str, value: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **value}) + b"\n\n"


@dataclass(slots=True)
class _Blocks:
    """The stream's content blocks: which one is open, and the next index."""

    open: str | None = None
    index: int = -1
    out: list[bytes] = field(default_factory=list)

    def start(self, kind: str, block: dict[str, Any]) -> None:
        self.stop()
        self.index += 1
        self.open = kind
        self.out.append(_sse("content_block_start", {"index": self.index, "content_block": block}))

    def stop(self) -> None:
        if self.open == "thinking":  # Anthropic's clients expect a signature before the stop
            self.delta({"type": "signature_delta", "signature": ""})
        if self.open is not None:
            self.out.append(_sse("content_block_stop", {"index": self.index}))
            self.open = None

    def delta(self, delta: dict[str, Any]) -> None:
        self.out.append(_sse("content_block_delta", {"index": self.index, "delta": delta}))

    def take(self) -> list[bytes]:
        out, self.out = self.out, []
        return out


def _render(event: Token, blocks: _Blocks) -> None:
    if event.reasoning:
        if blocks.open != "thinking":
            blocks.start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        blocks.delta({"type": "thinking_delta", "thinking": event.reasoning})
    if event.text:
        if blocks.open != "text":
            blocks.start("text", {"type": "text", "text": ""})
        blocks.delta({"type": "text_delta", "text": event.text})
    for call in event.tool_calls:
        if call.id is not None:
            blocks.start("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        if call.arguments:
            blocks.delta({"type": "input_json_delta", "partial_json": call.arguments})


async def _events(opened: Opened, msg_id: str, model: str) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    started = False
    try:
        async for event in opened.events():
            if not started:
                total = event.total if isinstance(event, Progress) else 0
                message: dict[str, Any] = {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": total, "output_tokens": 0},
                }
                yield _sse("message_start", {"message": message})
                started = True
            if isinstance(event, Token):
                _render(event, blocks)
                for chunk in blocks.take():
                    yield chunk
            elif isinstance(event, Done):
                done = event.completion
                if blocks.index < 0:  # an empty reply still has its (empty) text block
                    blocks.start("text", {"type": "text", "text": ""})
                blocks.stop()
                for chunk in blocks.take():
                    yield chunk
                delta = {"stop_reason": _stop_reason(done), "stop_sequence": done.stop_string}
                yield _sse("message_delta", {"delta": delta, "usage": _usage(done)})
                yield _sse("message_stop", {})
    except HttpError as e:
        yield error_event(e)


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, tools and system included."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    oai = openai_body(body)
    chat = chat_messages(oai["messages"])
    tools = oai.get("tools")
    variables = oai.get("chat_template_kwargs")
    tokenizer = service.need_tokenizer()

    def count() -> int:
        prompt = tokenizer.apply_chat_template(chat, variables, tools=tools)
        return len(tokenizer.tokenize(prompt, add_special=True, parse_special=True))

    try:
        return json_response({"input_tokens": await service.run(count)})
    except EngineError as e:
        raise from_engine_error(e) from None
