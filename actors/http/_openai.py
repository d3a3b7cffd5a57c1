"""The OpenAI API: ``POST /v1/completions`` and ``/v1/chat/completions``, streamed as
server-sent events ending in ``data: [DONE]``, with llama-server's extensions
(``timings``, its native sampling fields).

Handlers run on the event loop; the engine is reached only through the public helpers.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

import actors
from actors import Completion, Done, EngineError, Progress, Token
from actors.http._chat_params import chat_messages, continuation, template_kwargs, tool_options, tools_option
from actors.http._errors import HttpError, from_engine_error
from actors.http._generation import (
    Opened,
    TextEvents,
    assistant_message,
    complete,
    error_event,
    finish_reason,
    logprobs_json,
    open_stream,
    progress_json,
    progress_timings,
    sse,
    timings,
    tool_call_deltas,
)
from actors.http._native import complete_all, final_json, json_response, prompts_of
from actors.http._params import (
    choices_count,
    echoed_model,
    max_tokens,
    probabilities,
    sampling_options,
    stream_options,
)
from actors.http._service import Service, request_client, routed
from actors.http._stream import EventStream

__all__ = ["chat_completions", "chat_options", "completions", "count_chat_tokens", "input_tokens"]

_FINGERPRINT = f"llama-cpp-actors-{actors.__version__}"
_DONE = b"data: [DONE]\n\n"


def _options(service: Service, body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    n = choices_count(body, service.limits, "n")
    # best_of > n would pick the likeliest of best_of completions, which this server
    # never does (llama-server refuses best_of outright); best_of = n picks nothing.
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != n):
        raise HttpError(400, "'best_of' is not supported by this server (only best_of equal to n)")
    if not chat and (body.get("tools") or body.get("functions")):
        raise HttpError(400, "'tools' are for chat completions (/v1/chat/completions), not text completions")
    if not chat and body.get("echo"):
        raise HttpError(400, "'echo' is not supported by this server")
    if not chat and body.get("suffix"):
        raise HttpError(400, "'suffix' is not supported by this server")
    options = sampling_options(body, service.tokenize)
    if n > 1:
        options["n"] = n
    requested = body.get("max_completion_tokens", body.get("max_tokens", body.get("n_predict")))
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise HttpError(400, "'max_tokens' must be an integer")
    options["max_tokens"] = max_tokens(requested, service.limits)
    logprobs = body.get("logprobs")
    if chat and logprobs is not None and not isinstance(logprobs, bool):
        raise HttpError(400, "'logprobs' must be true or false")
    if chat and logprobs is True:
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int):
            raise HttpError(400, "'top_logprobs' must be an integer")
        options["logprobs"] = top
    elif not chat and logprobs is not None and logprobs is not False:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise HttpError(400, "'logprobs' must be an integer")
        options["logprobs"] = logprobs
    response_format = body.get("response_format")
    if response_format is not None:
        options.update(_response_format(response_format))
    if chat:
        variables = template_kwargs(service.settings.chat_template_kwargs, body)
        if variables:
            options["template_kwargs"] = variables
        settings = service.settings
        options.update(
            tool_options(
                body, settings.reasoning_format, settings.reasoning_budget, settings.reasoning_budget_message
            )
        )
    user = body.get("user")
    if isinstance(user, str) and user and "cache_scope" not in options:
        options["cache_scope"] = f"user:{user}"
    return probabilities(options)


def chat_options(service: Service, body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat body's engine options (sampling, limits, tools, template variables): the
    one parser every chat API's adapter hands its request to, as an OpenAI body."""
    return _options(service, body, chat=True)


def _response_format(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise HttpError(400, "'response_format' must be an object")
    kind = value.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        schema = value.get("schema") or {"type": "object"}
    elif kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if schema is None:
            schema = value.get("schema")
        if schema is None:
            raise HttpError(400, "response_format json_schema needs a 'json_schema.schema'")
    else:
        raise HttpError(400, f"response_format type {str(kind)[:40]!r} is not supported")
    if not isinstance(schema, Mapping):
        raise HttpError(400, "the response_format schema must be an object")
    return {"json_schema": schema}


def _usage(groups: Sequence[Sequence[Completion]]) -> dict[str, Any]:
    """OpenAI's ``usage`` of each prompt's choices: a prompt is counted once (its first
    choice's, which prefilled it), the completions of every choice."""
    prompt = sum(choices[0].prompt_tokens for choices in groups)
    cached = sum(choices[0].prefix_cache_tokens for choices in groups)
    generated = sum(c.generated_tokens for choices in groups for c in choices)
    return {
        "completion_tokens": generated,
        "prompt_tokens": prompt,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _envelope(kind: str, cmpl_id: str, model: str) -> dict[str, Any]:
    return {
        "id": cmpl_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": _FINGERPRINT,
    }


def _include_usage(body: Mapping[str, Any]) -> bool:
    stream_options = body.get("stream_options")
    return isinstance(stream_options, Mapping) and stream_options.get("include_usage") is True


async def completions(request: Request) -> Response | EventStream:
    """``POST /v1/completions``: OpenAI's (legacy) text completion."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    if "prompt" not in body:
        raise HttpError(400, "'prompt' is required")
    # Off the event loop: a prompt's text pieces are tokenized, its ids checked.
    prompts, options = await service.parse(
        request_client(request),
        lambda: (prompts_of(body["prompt"], service.tokenize), _options(service, body, chat=False)),
    )
    post = bool(options.get("post_sampling_probs"))
    streaming, per_token = stream_options(body)
    cmpl_id, model = f"cmpl-{secrets.token_hex(12)}", echoed_model(body, service.model_ids[0])
    if body.get("stream") is not True:
        groups = await complete_all(service, request, prompts, options)
        # llama-server's order: each prompt's n choices in turn, indexed across them all.
        dones = [done for choices in groups for done in choices]
        choices = [
            {
                "text": done.text,
                "index": i,
                "logprobs": {"content": logprobs_json(done.logprobs, post)} if done.logprobs else None,
                "finish_reason": finish_reason(done),
            }
            for i, done in enumerate(dones)
        ]
        return json_response(
            {
                **_envelope("text_completion", cmpl_id, model),
                "choices": choices,
                "usage": _usage(groups),
                "timings": timings(dones[0]),
            }
        )
    if len(prompts) > 1:
        raise HttpError(400, "streaming several prompts in one request is not supported; send one each")
    opened = await open_stream(
        service, request, prompt=prompts[0], messages=None, options={**options, **streaming}
    )
    stream = _Choices(options.get("n", 1), _include_usage(body), per_token, post)
    return EventStream(_completion_events(opened, _envelope("text_completion", cmpl_id, model), stream))


def _progress(chunk: dict[str, Any], event: Progress, per_token: bool) -> dict[str, Any]:
    """``chunk`` with llama-server's ``prompt_progress`` (and ``timings``, when asked)."""
    chunk["prompt_progress"] = progress_json(event)
    if per_token:
        chunk["timings"] = progress_timings(event)
    return chunk


@dataclass(slots=True)
class _Choices:
    """A stream's settings and its choices' progress: which have finished, and how."""

    n: int
    usage: bool
    """Whether the stream ends with ``usage`` (``stream_options.include_usage``)."""
    per_token: bool
    post: bool
    dones: list[Completion] = field(default_factory=list)
    """The choices finished so far, in the order they finished."""

    def finish(self, done: Completion) -> bool:
        """Count ``done`` in; whether it was the last choice to finish."""
        self.dones.append(done)
        return len(self.dones) == self.n

    def usage_json(self) -> dict[str, Any]:
        return _usage([sorted(self.dones, key=lambda c: c.index)])


async def _completion_events(
    opened: Opened, envelope: dict[str, Any], stream: _Choices
) -> AsyncIterator[bytes]:
    def chunk(text: str, index: int, probs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"text": text, "index": index, "logprobs": probs, "finish_reason": None}
        return {**envelope, "choices": [choice]}

    text_event = TextEvents(chunk)
    try:
        async for event in opened.events():
            if isinstance(event, Progress):
                yield sse(_progress(chunk("", 0), event, stream.per_token))
            elif isinstance(event, Token):
                if event.logprob:
                    probs = {"content": logprobs_json([event.logprob], stream.post)}
                    yield sse(chunk(event.text, event.index, probs))
                else:
                    yield text_event(event.text, event.index)
            elif isinstance(event, Done):
                done = event.completion
                reason = finish_reason(done)
                last = {"text": "", "index": event.index, "logprobs": None, "finish_reason": reason}
                final: dict[str, Any] = {**envelope, "choices": [last], "timings": timings(done)}
                if stream.finish(done) and stream.usage:  # once, with the last choice's final chunk
                    final["usage"] = stream.usage_json()
                yield sse(final)
    except HttpError as e:
        yield error_event(e)
    yield _DONE


def _chat_request(
    service: Service, body: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """A chat body's messages, its continuation and its engine options (a work thread)."""
    messages = chat_messages(body.get("messages"))
    turn = continuation(body, messages)
    return messages, turn, {**_options(service, body, chat=True), **turn}


async def chat_completions(request: Request) -> Response | EventStream:
    """``POST /v1/chat/completions``: OpenAI's chat completion, rendered with the model's template."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    client = request_client(request)
    messages, turn, options = await service.parse(client, lambda: _chat_request(service, body))
    post = bool(options.get("post_sampling_probs"))
    streaming, per_token = stream_options(body)
    cmpl_id, model = f"chatcmpl-{secrets.token_hex(12)}", echoed_model(body, service.model_ids[0])
    if body.get("stream") is not True:
        dones = await complete(service, request, prompt=None, messages=messages, options=options)
        choices: list[dict[str, Any]] = []
        for i, done in enumerate(dones):
            choice: dict[str, Any] = {
                "finish_reason": finish_reason(done),
                "index": i,
                "message": assistant_message(done),
            }
            if done.logprobs:
                choice["logprobs"] = {"content": logprobs_json(done.logprobs, post)}
            choices.append(choice)
        done = dones[0]
        reply = {
            **_envelope("chat.completion", cmpl_id, model),
            "choices": choices,
            "usage": _usage([dones]),
            "timings": timings(done),
        }
        verbose = body.get("verbose")
        if verbose is True or (verbose is None and service.settings.verbose):  # llama-server's debug view
            prompt = await service.run(
                functools.partial(
                    service.need_tokenizer().apply_chat_template,
                    messages,
                    options.get("template_kwargs"),
                    **turn,
                )
            )
            reply["__verbose"] = {
                **final_json(service, done, options, stream=False, tokens=False),
                "prompt": prompt,
            }
        return json_response(reply)
    opened = await open_stream(
        service, request, prompt=None, messages=messages, options={**options, **streaming}
    )
    stream = _Choices(options.get("n", 1), _include_usage(body), per_token, post)
    return EventStream(_chat_events(opened, _envelope("chat.completion.chunk", cmpl_id, model), stream))


async def input_tokens(request: Request) -> Response:
    """``POST /v1/chat/completions/input_tokens``: how many tokens the chat's prompt has."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return json_response({"input_tokens": await count_chat_tokens(service, body)})


async def count_chat_tokens(service: Service, body: Mapping[str, Any]) -> int:
    """How many tokens the prompt of the chat ``body`` (an OpenAI chat body) has."""
    messages = chat_messages(body.get("messages"))
    render = {**continuation(body, messages), **tools_option(body)}
    variables = template_kwargs(service.settings.chat_template_kwargs, body) or None
    tokenizer = service.need_tokenizer()

    def count() -> int:
        prompt = tokenizer.apply_chat_template(messages, variables, **render)
        return len(tokenizer.tokenize(prompt, add_special=True, parse_special=True))

    try:
        return await service.run(count)
    except EngineError as e:
        raise from_engine_error(e) from None


async def _chat_events(opened: Opened, envelope: dict[str, Any], stream: _Choices) -> AsyncIterator[bytes]:
    def choices(delta: dict[str, Any], index: int = 0, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"finish_reason": None, "index": index, "delta": delta, **(extra or {})}
        return {**envelope, "choices": [choice]}

    role = {"role": "assistant", "content": None}
    text_event = TextEvents(lambda text, index: choices({"content": text}, index))
    reasoning_event = TextEvents(lambda text, index: choices({"reasoning_content": text}, index))
    for index in range(stream.n):  # each choice opens with its role, as OpenAI's do
        yield sse(choices(role, index))
    try:
        async for event in opened.events():
            if isinstance(event, Progress):  # llama-server's: the role delta, with the progress
                yield sse(_progress(choices(role), event, stream.per_token))
            elif isinstance(event, Token):
                if event.reasoning:
                    yield reasoning_event(event.reasoning, event.index)
                if event.logprob:
                    probs = {"content": logprobs_json([event.logprob], stream.post)}
                    yield sse(choices({"content": event.text}, event.index, {"logprobs": probs}))
                elif event.text:
                    yield text_event(event.text, event.index)
                if event.tool_calls:
                    yield sse(choices({"tool_calls": tool_call_deltas(event.tool_calls)}, event.index))
            elif isinstance(event, Done):
                done = event.completion
                final: dict[str, Any] = {
                    **envelope,
                    "choices": [{"finish_reason": finish_reason(done), "index": event.index, "delta": {}}],
                }
                # A choice's timings ride on its last chunk: the usage chunk, after the last to finish.
                if stream.finish(done) and stream.usage:
                    yield sse(final)
                    final = {**envelope, "choices": [], "usage": stream.usage_json()}
                final["timings"] = timings(done)
                yield sse(final)
    except HttpError as e:
        yield error_event(e)
    yield _DONE
