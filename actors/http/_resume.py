"""Resumable streams, as llama-server's: a streamed completion sent with an
``X-Conversation-Id`` header goes on generating when its client leaves, into a ring
(``_replay``) that it, or another reader, replays from a byte offset.

- ``start``: such a POST (any of ``RESUMABLE_PATHS`` with ``"stream": true``). Its
  handler runs in a task of its own, the producer, on a copy of the request that never
  hears the client leave; the producer keeps every event the handler's stream yields.
  The client's own response is the first reader, from offset 0: when the client leaves
  only that reader stops. An error before the first event (a 400, a full queue) is the
  client's answer, and nothing is kept.
- ``GET /v1/stream?conv_id=<id>&from=<N>`` (``resume``): the stream's bytes from byte N,
  then its live bytes until it ends. 404 for an id not kept (or another API key's), 400
  for an offset the ring no longer holds (llama-server's "Stream offset lost, please
  restart"), 503 while its model loads (router mode).
- ``DELETE /v1/stream?conv_id=<id>`` (``stop``): cancels the generation (its engine
  request) and drops the ring; 204 whether or not it was kept (llama-server's).
- ``POST /v1/streams/lookup`` (``lookup``): which of the ids given are kept, and how far
  each got (llama-server's web UI asks after a reload).

The producer counts as a request in flight, so a drain waits for it; it keeps a sleeping
server's model awake (``--sleep-idle-seconds``) and, in router mode, holds its model
until it ends. Runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from actors.http._errors import HttpError, answered, error_response
from actors.http._generation import dumps, error_event
from actors.http._replay import Phase, Replay
from actors.http._replays import MAX_ID_CHARS, Replays, check_conv_id
from actors.http._service import CLIENT, Service, request_client, routed
from actors.http._stream import EventStream, unless_disconnected

__all__ = ["RESUMABLE_PATHS", "conversation_id", "lookup", "resume", "start", "stop"]

_log = logging.getLogger("llama_cpp_actors.http")

RESUMABLE_PATHS = frozenset(
    {
        "/completion",
        "/completions",
        "/infill",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/responses",
    }
)
"""The endpoints whose streams may be resumable: llama-server's ``handle_completions_impl``."""

_MAX_LOOKUP = 256  # ids one lookup may ask about
_CANCELLED = (
    "request cancelled: its stream was stopped (DELETE /v1/stream) or replaced by a newer "
    "request with the same X-Conversation-Id before it began"
)
_SHUTDOWN = "the server is shutting down: the request was cancelled"

Handler = Callable[[Request], Awaitable[Any]]


def replays_of(request: Request) -> Replays:
    """The app's resumable streams."""
    replays: Replays = request.app.state.replays
    return replays


def conversation_id(request: Request) -> str | None:
    """The checked ``X-Conversation-Id`` of a request that asks for a resumable stream
    (its body streams), else None: without the header, or an empty one, nothing changes.

    Raises:
        HttpError: 400, the header is not a conversation id.
    """
    value = request.headers.get("x-conversation-id")
    body = getattr(request.state, "json", None)
    if not value or not isinstance(body, dict) or body.get("stream") is not True:
        return None
    return check_conv_id(value, "X-Conversation-Id")


def _owner(request: Request) -> str:
    """Whose streams a request sees: its API key's (``key#<index>``), or everyone's
    when the server has no keys."""
    state = request.scope.get("state")
    key = state.get(CLIENT) if isinstance(state, dict) else None
    return "" if key is None else str(key)


async def _never_disconnects() -> Message:
    await asyncio.get_running_loop().create_future()  # until the producer is cancelled
    raise AssertionError("unreachable")


async def start(request: Request, conv_id: str, handler: Handler) -> Response | EventStream:
    """Serve ``request`` (its body read) as the resumable stream ``conv_id``: the
    handler's answer when it fails before its first event, else a reader of the stream
    from its first byte.

    Raises:
        HttpError: 429 or 503, no room for another stream (``Replays.open``).
        ClientGone: the client left before the stream began (it goes on regardless).
    """
    replays = replays_of(request)
    replay = replays.open(_owner(request), conv_id, request_client(request))
    state = request.scope.get("state")
    scope = {**request.scope, "state": dict(state) if isinstance(state, dict) else {}}
    detached = Request(scope, _never_disconnects)
    replay.producer = asyncio.ensure_future(
        _produce(request.app.state.service, detached, replay, replays, handler)
    )
    await unless_disconnected(request, _begun(replay))
    if replay.phase is Phase.FAILED and replay.failure is not None:
        return replay.failure
    if replay.phase is Phase.STOPPED and not replay.end:
        raise HttpError(400, _CANCELLED)
    return _reader(replay, 0)


async def _begun(replay: Replay) -> None:
    while replay.phase.value < Phase.STREAMING.value:
        await replay.changed()


async def _produce(
    root: Service, request: Request, replay: Replay, replays: Replays, handler: Handler
) -> None:
    """Run the handler and keep its stream's events, whoever reads them (a task)."""

    sleeper = root.sleeper
    holds: list[bool] = []  # whether it holds the model awake (--sleep-idle-seconds)

    async def work() -> Any:
        if sleeper is not None:  # the client's request holds it awake until it leaves
            await sleeper.enter()
            holds.append(True)
        if root.views is not None:  # router mode: readers are told to retry while it loads
            replay.enter(Phase.LOADING)
            await routed(request)
        replay.enter(Phase.STARTING)
        return await handler(request)

    task = asyncio.current_task()
    root.in_flight += 1
    if task is not None:
        root.tasks.add(task)
    events: Any = None
    try:
        reply = await answered(request, work)
        if not isinstance(reply, EventStream):
            replay.fail(reply)
            replays.forget(replay)
            return
        replay.headers = reply.headers
        replay.enter(Phase.STREAMING)
        events = reply.events
        try:
            async for event in events:
                replay.append(event)
        except Exception:  # a renderer's bug: the stream ends as a failure mid-stream does
            _log.exception("%s %s failed mid-stream", request.method, request.url.path)
            replay.append(error_event(HttpError(500, "internal server error")))
        replay.enter(Phase.DONE)
    except asyncio.CancelledError:
        if not replay.ended:  # not a stop: the drain's time is up
            if replay.end:
                replay.append(error_event(HttpError(503, _SHUTDOWN)))
                replay.enter(Phase.DONE)
            else:
                replay.fail(error_response(HttpError(503, _SHUTDOWN)))
                replays.forget(replay)
        raise
    finally:
        if events is not None:
            with contextlib.suppress(Exception):
                await events.aclose()  # cancels the engine request if it has not finished
        root.in_flight -= 1
        if task is not None:
            root.tasks.discard(task)
        if root.views is not None:
            root.views.release(request.scope)
        if holds and sleeper is not None:
            sleeper.leave()


def _lost(replay: Replay, offset: int, request: Request) -> str:
    bounds = replays_of(request).bounds
    return (
        f"Stream offset lost, please restart: byte {offset} is no longer kept; the stream keeps "
        f"bytes {replay.first} to {replay.end}, its newest events up to {bounds.max_bytes} bytes "
        f"and {bounds.max_events} events"
    )


def _reader(replay: Replay, offset: int) -> EventStream:
    def lost(at: int) -> bytes:
        message = f"this reader fell behind: byte {at} is no longer kept (from byte {replay.first})"
        return error_event(HttpError(400, f"Stream offset lost, please restart: {message}"))

    stream = EventStream(replay.follow(offset, lost))
    stream.headers = list(replay.headers) or stream.headers
    return stream


def _query_id(request: Request) -> str:
    value = request.query_params.get("conv_id")
    if not value:
        raise HttpError(400, "Missing conversation id in path: give ?conv_id=<its X-Conversation-Id>")
    return check_conv_id(value, "conv_id")


def _offset(text: str | None) -> int:
    if text is None or text == "":
        return 0
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise HttpError(400, "Invalid 'from' offset: a byte offset, a whole number from 0")
    return int(text)


async def resume(request: Request) -> Response | EventStream:
    """``GET /v1/stream?conv_id=<id>&from=<N>``: the stream's bytes from byte N on."""
    conv_id = _query_id(request)
    offset = _offset(request.query_params.get("from"))
    replays = replays_of(request)
    replay = replays.get(_owner(request), conv_id)
    if replay is None:
        raise HttpError(
            404,
            "Stream not found or expired: no stream with this conv_id is kept for you (an ended "
            f"stream is kept {replays.bounds.ttl_s:g} s after it ended and its last reader left)",
        )
    if replay.phase is Phase.LOADING:
        raise HttpError(503, "Stream owner model is loading, retry later")
    if offset < replay.first:
        raise HttpError(400, _lost(replay, offset, request))
    if offset > replay.end:
        raise HttpError(
            400, f"Invalid 'from' offset: byte {offset} is past the {replay.end} bytes sent so far"
        )
    if replay.readers >= replays.bounds.max_readers:
        raise HttpError(
            429,
            f"this stream has {replay.readers} readers, its limit of {replays.bounds.max_readers}",
            kind="rate_limit_error",
        )
    return _reader(replay, offset)


async def stop(request: Request) -> Response:
    """``DELETE /v1/stream?conv_id=<id>``: stop the generation and drop what was kept."""
    replays = replays_of(request)
    replay = replays.get(_owner(request), _query_id(request))
    if replay is not None:
        replays.stop(replay)
    return Response(status_code=204)


async def lookup(request: Request) -> Response:
    """``POST /v1/streams/lookup`` ``{"conversation_ids": [...]}``: the kept streams of
    those ids (and of ``<id>::<model>``), never any other: ids cannot be listed."""
    body = request.state.json
    ids = body.get("conversation_ids", []) if isinstance(body, dict) else None
    if not isinstance(ids, list) or len(ids) > _MAX_LOOKUP:
        raise HttpError(400, f"'conversation_ids' must be a list of at most {_MAX_LOOKUP} ids")
    for value in ids:
        if not isinstance(value, str):
            raise HttpError(
                400, f"each of 'conversation_ids' must be a string of 1 to {MAX_ID_CHARS} characters"
            )
        check_conv_id(value, "each of 'conversation_ids'")
    found = [
        {
            "conversation_id": replay.conv_id,
            "is_done": replay.ended,
            "total_bytes": replay.end,
            "started_at": int(replay.started_at),
            "completed_at": int(replay.completed_at),
        }
        for replay in replays_of(request).owned(_owner(request), ids)
    ]
    return Response(dumps(found), media_type="application/json; charset=utf-8")
