"""Responses that watch the client: a server-sent event stream, and a plain answer that
is abandoned (and its request cancelled) when the client goes away first.

Runs on the event loop. Both listen for ``http.disconnect`` the whole time, whatever
the ASGI spec version, so a client that hangs up while its request is still queued or
prefilling frees its place at once, not at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

__all__ = ["ClientGone", "EventStream", "unless_disconnected"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(receive: Receive) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Awaitable[T], receive: Receive) -> T:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        # Let the work finish cancelling (an async generator's step, say) before the
        # caller closes what it was using.
        with contextlib.suppress(BaseException):
            await task
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()  # the request's helper cancels it in the engine
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, or cancel it and raise ``ClientGone`` when the client leaves first."""
    return await _race(work, request.receive)


class EventStream:
    """An ASGI ``text/event-stream`` response of the chunks ``events`` yields.

    When the client disconnects, ``events`` is closed (its ``finally`` runs, which
    cancels the engine request) and nothing more is sent.
    """

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> None:
        self.events = events
        self.headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        with contextlib.suppress(ClientGone, OSError):
            await _race(self._pump(send), receive)

    async def _pump(self, send: Send) -> None:
        events: Any = self.events
        try:
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()
