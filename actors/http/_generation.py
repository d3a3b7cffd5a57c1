"""Running one generation for a handler: awaited whole, or opened as a stream whose
first event has arrived (so admission errors still get their status code), and the
pieces both APIs report (timings, stop types, log-probabilities).

Runs on the event loop, through the public asyncio helpers of ``actors``.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from json.encoder import encode_basestring as _encode_string
from typing import Any

from actors import (
    Completion,
    Done,
    EngineError,
    Progress,
    Token,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    achat,
    agenerate,
    astream_events,
)
from actors.http._access import Access, access_of
from actors.http._errors import UTF8_JSON, HttpError, error_body, from_engine_error
from actors.http._service import Service
from actors.http._stream import unless_disconnected

__all__ = [
    "Opened",
    "TextEvents",
    "assistant_message",
    "complete",
    "dumps",
    "finish_reason",
    "logprobs_json",
    "open_stream",
    "progress_json",
    "progress_timings",
    "sse",
    "stop_type",
    "timings",
    "tool_call_deltas",
    "tool_calls_json",
]

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_MARK = "\x00"  # JSON escapes it, so its encoding appears only where it was put
_MARK_JSON = _ENCODER.encode(_MARK).encode()


def dumps(value: Any) -> bytes:
    """Compact JSON, UTF-8 (as llama-server sends it); a lone surrogate from a client's
    string goes out as its JSON escape (``\\ud83d``), never as an error."""
    return _ENCODER.encode(value).encode(*UTF8_JSON)


def sse(value: Any) -> bytes:
    """One server-sent event carrying ``value`` as JSON."""
    return b"data: " + dumps(value) + b"\n\n"


class TextEvents:
    """The server-sent events of a stream's tokens: one JSON shape per choice that
    differs only in its text, encoded once and filled in for each token (the same
    bytes ``sse`` gives, at a fraction of the cost: every token of every stream
    pays it on the event loop).

    ``make(text, index)`` returns the event's value for choice ``index``.
    """

    def __init__(self, make: Callable[[str, int], Any]) -> None:
        self._make = make
        self._parts: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, text: str, index: int) -> bytes:
        """The event of ``text`` for choice ``index``."""
        try:
            parts = self._parts[index]
        except KeyError:
            head, *rest = sse(self._make(_MARK, index)).split(_MARK_JSON)
            # A marker elsewhere in the shape (a model alias holding it, say): no template.
            parts = self._parts[index] = (head, rest[0]) if len(rest) == 1 else None
        if parts is None:
            return sse(self._make(text, index))
        return parts[0] + _encode_string(text).encode(*UTF8_JSON) + parts[1]


def _engine(service: Service) -> Any:
    if service.engine is None or not service.ready:
        raise HttpError(503, "Loading model")
    return service.engine


def _named(options: dict[str, Any], access: Access | None) -> dict[str, Any]:
    """``options`` with the HTTP request's id as the engine request's (see ``_access``)."""
    if access is None or "request_id" in options:
        return options
    return {**options, "request_id": access.engine_id()}


async def complete(
    service: Service,
    request: Any,
    *,
    prompt: Prompt | None,
    messages: Messages | None,
    options: dict[str, Any],
    access: Access | None = None,
) -> list[Completion]:
    """Every choice's whole ``Completion``, in choice order: one, or ``options["n"]``;
    the request is cancelled if the client leaves first (``request`` None: the caller
    watches for that, and gives the request's ``access``)."""
    access = access or access_of(request)
    options = _named(options, access)
    engine = _engine(service)
    if messages is not None:
        work = achat(engine, messages, **options)
    else:
        assert prompt is not None
        work = agenerate(engine, prompt, **options)
    try:
        result = await (work if request is None else unless_disconnected(request, work))
    except EngineError as e:
        raise from_engine_error(e) from None
    completions = list(result) if isinstance(result, tuple) else [result]
    if access is not None:
        for completion in completions:
            access.count(completion)
    return completions


Event = Progress | Token | Done


class Opened:
    """A stream whose first event has arrived: iterate ``events`` for all of them (with
    ``n`` choices, their ``Token`` events interleaved and one ``Done`` each)."""

    def __init__(self, first: Event, rest: AsyncIterator[Event], access: Access | None = None) -> None:
        self._first: Event | None = first
        self._rest = rest
        self._access = access

    async def events(self) -> AsyncIterator[Event]:
        """Every event, the first included; a failure mid-stream raises ``HttpError``."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._count(first)
                yield first
            # Past a Done the helper's stream ends by itself: after the n-th terminal event.
            async for event in self._rest:
                self._count(event)
                yield event
        except EngineError as e:
            raise from_engine_error(e) from None
        finally:
            await self.aclose()

    def _count(self, event: Event) -> None:
        if self._access is not None and isinstance(event, Done):
            self._access.count(event.completion)

    async def aclose(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        close: Callable[[], Any] | None = getattr(self._rest, "aclose", None)
        if close is not None:
            await close()


async def open_stream(
    service: Service,
    request: Any,
    *,
    prompt: Prompt | None,
    messages: Messages | None,
    options: dict[str, Any],
) -> Opened:
    """Start a streamed request and wait for its first event (or its error)."""
    access = access_of(request)
    engine = _engine(service)
    events = astream_events(engine, prompt, messages=messages, **_named(options, access))
    try:
        first = await unless_disconnected(request, events.__anext__())
    except EngineError as e:
        await events.aclose()  # type: ignore[attr-defined]
        raise from_engine_error(e) from None
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return Opened(first, events, access)


def error_event(error: HttpError) -> bytes:
    """An error after the stream began: an event with llama-server's error body."""
    return b"data: " + error_body(error.status, error.message, error.kind, error.extra) + b"\n\n"


def stop_type(completion: Completion) -> str:
    """llama-server's ``stop_type``: ``eos``, ``word``, ``limit`` or ``none``."""
    return {"eog": "eos", "stop": "word", "max_tokens": "limit", "length": "limit"}.get(
        completion.stop_reason, "none"
    )


def finish_reason(completion: Completion) -> str:
    """OpenAI's ``finish_reason``: ``tool_calls`` when the turn ended to call tools,
    ``stop`` for an end token or a stop string, else ``length``."""
    if completion.stop_reason == "tool_calls":
        return "tool_calls"
    return "stop" if completion.stop_reason in ("eog", "stop") else "length"


def tool_calls_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` of a message."""
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def assistant_message(completion: Completion) -> dict[str, Any]:
    """OpenAI's assistant ``message``: its content (None when it only called tools), its
    ``tool_calls`` and llama-server's ``reasoning_content``, when it has them."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.text}
    if completion.tool_calls:
        message["tool_calls"] = tool_calls_json(completion.tool_calls)
        if not completion.text:
            message["content"] = None
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    return message


def tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's streamed ``tool_calls`` deltas: a call's first carries its id and name."""
    out = []
    for delta in deltas:
        entry: dict[str, Any] = {"index": delta.index}
        function: dict[str, Any] = {"arguments": delta.arguments}
        if delta.id is not None:
            entry["id"], entry["type"] = delta.id, "function"
            function["name"] = delta.name
        entry["function"] = function
        out.append(entry)
    return out


def timings(completion: Completion) -> dict[str, float | int]:
    """llama-server's ``timings``: prompt from admission to the first token, then decoding."""
    cache_n = completion.prefix_cache_tokens
    prompt_n = completion.prompt_tokens - cache_n
    prompt_ms = completion.ttft_ms
    predicted_n = completion.generated_tokens
    predicted_ms = max(completion.duration_ms - completion.ttft_ms, 0.0)
    drafts = (
        {"draft_n": completion.draft_tokens, "draft_n_accepted": completion.draft_accepted}
        if completion.draft_tokens
        else {}
    )  # as llama-server: only when speculation drafted
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        # llama-server's rule: the first token came with the prompt's logits, so the
        # rate is over the decode steps after it (as the engine's generation_rate).
        "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
        "predicted_per_second": (
            1000.0 * (predicted_n - 1) / predicted_ms if predicted_n > 1 and predicted_ms > 0 else 0.0
        ),
        **drafts,
    }


def progress_json(progress: Progress) -> dict[str, int]:
    """llama-server's ``prompt_progress``: the prompt's tokens, those cached, those
    processed (cached included), and the milliseconds since prompt processing began."""
    return {
        "total": progress.total,
        "cache": progress.cached,
        "processed": progress.processed,
        "time_ms": int(progress.prefill_ms),
    }


def progress_timings(progress: Progress) -> dict[str, float | int]:
    """llama-server's ``timings`` during prompt processing (``timings_per_token``): the
    prompt's so far, nothing predicted yet."""
    prompt_n = progress.processed - progress.cached
    prompt_ms = progress.prefill_ms
    return {
        "cache_n": progress.cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": 0,
        "predicted_ms": 0.0,
        "predicted_per_token_ms": 0.0,
        "predicted_per_second": 0.0,
    }


def _probability(token_id: int, text: str, logprob: float, post: bool) -> dict[str, Any]:
    value = {"prob": math.exp(logprob)} if post else {"logprob": logprob}
    return {"id": token_id, "token": text, "bytes": list(text.encode()), **value}


def logprobs_json(logprobs: Sequence[TokenLogprob], post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama-server's list of per-token probabilities (``n_probs``, ``logprobs``): log-
    probabilities, or with ``post_sampling_probs`` the probabilities after sampling
    (``prob`` and ``top_probs``)."""
    top = "top_probs" if post_sampling else "top_logprobs"
    return [
        {
            **_probability(p.token_id, p.text, p.logprob, post_sampling),
            top: [_probability(t.token_id, t.text, t.logprob, post_sampling) for t in p.top],
        }
        for p in logprobs
    ]
