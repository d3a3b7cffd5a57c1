"""OpenAI's Responses API: ``POST /v1/responses`` (and ``/responses``).

An adapter over the chat core, as the Anthropic one: ``instructions`` and ``input``
(a string, or items: messages, ``function_call``, ``function_call_output``,
``reasoning``), function ``tools``, ``tool_choice``, ``text.format`` and the sampling
fields become an OpenAI chat body for the same parser; the completion is rendered as a
``response`` object whose ``output`` holds a ``reasoning`` item, a ``message`` item and
``function_call`` items, and a stream as the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ...,
``response.completed``), each with its ``sequence_number``. Stateless: a
``previous_response_id`` is refused (the server stores no responses).
``POST /v1/responses/input_tokens`` counts the prompt such a request would have.

Handlers run on the event loop; the engine is reached only through the public helpers.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import Completion, Done, Progress, Token
from actors.http._chat_params import chat_messages
from actors.http._errors import HttpError
from actors.http._generation import (
    Opened,
    complete,
    dumps,
    error_event,
    open_stream,
    progress_json,
    progress_timings,
    timings,
)
from actors.http._native import json_response
from actors.http._openai import chat_options, count_chat_tokens
from actors.http._params import echoed_model, stream_options
from actors.http._responses_input import openai_body
from actors.http._service import Service, request_client, routed
from actors.http._stream import EventStream

__all__ = ["input_tokens", "responses"]


def _fail(message: str) -> HttpError:
    return HttpError(400, message)


def _usage(done: Completion) -> dict[str, Any]:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.prefix_cache_tokens},
        "output_tokens": done.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.generated_tokens,
    }


@dataclass(slots=True)
class _Ids:
    response: str = field(default_factory=lambda: f"resp_{secrets.token_hex(24)}")
    message: str = field(default_factory=lambda: f"msg_{secrets.token_hex(24)}")
    reasoning: str = field(default_factory=lambda: f"rs_{secrets.token_hex(24)}")


def _output(done: Completion, ids: _Ids) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if done.reasoning:
        items.append(_reasoning_item(ids.reasoning, done.reasoning))
    if done.text or not done.tool_calls:
        items.append(_message_item(ids.message, done.text, "completed"))
    for call in done.tool_calls:
        items.append(_call_item(call.id, call.name, call.arguments, "completed"))
    return items


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str, name: str | None, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _response(body: Mapping[str, Any], ids: _Ids, model: str, status: str, created: int) -> dict[str, Any]:
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "incomplete_details": None,
        "error": None,
        "usage": None,
    }


def _finished(response: dict[str, Any], done: Completion, ids: _Ids) -> dict[str, Any]:
    cut = done.stop_reason in ("max_tokens", "length")
    return {
        **response,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": _output(done, ids),
        "usage": _usage(done),
    }


def _parse(service: Service, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], bool]:
    oai = openai_body(body)
    messages = chat_messages(oai["messages"])
    streaming, per_token = stream_options(oai)
    return messages, {**chat_options(service, oai), **streaming}, per_token


async def responses(request: Request) -> Response | EventStream:
    """``POST /v1/responses``: OpenAI's Responses API over the chat core."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    messages, options, per_token = await service.parse(request_client(request), lambda: _parse(service, body))
    ids, model, created = _Ids(), echoed_model(body, service.model_ids[0]), int(time.time())
    response = _response(body, ids, model, "in_progress", created)
    if body.get("stream") is not True:
        options.pop("progress", None)
        done = (await complete(service, request, prompt=None, messages=messages, options=options))[0]
        return json_response(_finished(response, done, ids))
    opened = await open_stream(service, request, prompt=None, messages=messages, options=options)
    return EventStream(_Events(response, ids, per_token).run(opened))


async def input_tokens(request: Request) -> Response:
    """``POST /v1/responses/input_tokens``: how many tokens the response's prompt has
    (its instructions, input items and tools rendered as the chat it becomes)."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return json_response({"input_tokens": await count_chat_tokens(service, openai_body(body))})


@dataclass(slots=True)
class _Events:
    """A Responses stream: the output items as they open, fill and close."""

    response: dict[str, Any]
    ids: _Ids
    per_token: bool
    sequence: int = 0
    item: dict[str, Any] | None = None  # the open output item
    index: int = -1
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # call index -> its item
    t_open: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    n_tokens: int = 0
    prompt: dict[str, Any] = field(default_factory=dict)

    def _sse(self, kind: str, value: dict[str, Any]) -> bytes:
        self.sequence += 1
        return (
            b"event: "
            + kind.encode()
            + b"\ndata: "
            + dumps({"type": kind, "sequence_number": self.sequence, **value})
            + b"\n\n"
        )

    def _close(self) -> list[bytes]:
        item = self.item
        if item is None:
            return []
        self.item = None
        text = "".join(self.text)
        self.text = []
        out = []
        where = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self._sse("response.output_text.done", {**where, "content_index": 0, "text": text}))
            out.append(self._sse("response.content_part.done", {**where, "content_index": 0, "part": part}))
            item = _message_item(item["id"], text, "completed")
        elif item["type"] == "reasoning":
            out.append(self._sse("response.reasoning_text.done", {**where, "content_index": 0, "text": text}))
            item = _reasoning_item(item["id"], text)
        else:
            out.append(self._sse("response.function_call_arguments.done", {**where, "arguments": text}))
            item = {**item, "arguments": text, "status": "completed"}
        out.append(self._sse("response.output_item.done", {"output_index": self.index, "item": item}))
        return out

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.item = item
        out.append(self._sse("response.output_item.added", {"output_index": self.index, "item": item}))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
            out.append(self._sse("response.content_part.added", {**where, "part": part}))
        return out

    def _timings(self) -> dict[str, Any]:
        now = time.monotonic()
        first = self.t_first or now
        prompt_ms = (first - self.t_open) * 1000.0
        predicted_ms = (now - first) * 1000.0
        n = self.n_tokens
        return {
            **self.prompt,
            "prompt_ms": prompt_ms,
            "predicted_n": n,
            "predicted_ms": predicted_ms,
            "predicted_per_second": 1000.0 * (n - 1) / predicted_ms if n > 1 and predicted_ms > 0 else 0.0,
        }

    def _delta(self, kind: str, delta: str) -> bytes:
        assert self.item is not None
        value: dict[str, Any] = {"item_id": self.item["id"], "output_index": self.index, "delta": delta}
        if kind != "response.function_call_arguments.delta":
            value["content_index"] = 0
        if self.per_token:
            value["timings"] = self._timings()
        self.text.append(delta)
        return self._sse(kind, value)

    def _token(self, event: Token) -> list[bytes]:
        out: list[bytes] = []
        self.n_tokens += 1
        if self.t_first is None:
            self.t_first = time.monotonic()
        if event.reasoning:
            if self.item is None or self.item["type"] != "reasoning":
                out += self._open(
                    {"type": "reasoning", "id": self.ids.reasoning, "summary": [], "content": []}
                )
            out.append(self._delta("response.reasoning_text.delta", event.reasoning))
        if event.text:
            if self.item is None or self.item["type"] != "message":
                out += self._open(_message_item(self.ids.message, None, "in_progress"))
            out.append(self._delta("response.output_text.delta", event.text))
        for call in event.tool_calls:
            if call.id is not None:
                out += self._open(_call_item(call.id, call.name, "", "in_progress"))
            if call.arguments:
                out.append(self._delta("response.function_call_arguments.delta", call.arguments))
        return out

    async def run(self, opened: Opened) -> AsyncIterator[bytes]:
        """The stream's events, from ``response.created`` to ``response.completed``."""
        yield self._sse("response.created", {"response": self.response})
        yield self._sse("response.in_progress", {"response": self.response})
        try:
            async for event in opened.events():
                if isinstance(event, Progress):
                    prompt_n = event.processed - event.cached
                    self.prompt = {
                        "cache_n": event.cached,
                        "prompt_n": prompt_n,
                        "prompt_per_second": (
                            1000.0 * prompt_n / event.prefill_ms if event.prefill_ms > 0 else 0.0
                        ),
                    }
                    value: dict[str, Any] = {
                        "response": self.response,
                        "prompt_progress": progress_json(event),
                    }
                    if self.per_token:
                        value["timings"] = progress_timings(event)
                    yield self._sse("response.in_progress", value)
                elif isinstance(event, Token):
                    for chunk in self._token(event):
                        yield chunk
                elif isinstance(event, Done):
                    done = event.completion
                    if self.index < 0 and not done.tool_calls:
                        for chunk in self._open(_message_item(self.ids.message, None, "in_progress")):
                            yield chunk
                    for chunk in self._close():
                        yield chunk
                    # llama-server's (and the openai SDK's final-response) event, even when
                    # the response is cut short: its status then says "incomplete".
                    final = {"response": _finished(self.response, done, self.ids), "timings": timings(done)}
                    yield self._sse("response.completed", final)
        except HttpError as e:
            yield error_event(e)
