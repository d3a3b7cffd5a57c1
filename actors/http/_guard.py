"""Connection hygiene: uvicorn's h11 protocol with the bounds a server facing a network
needs, so that no client can hold the others out with connections alone.

- A connection has ``header_timeout_s`` to send a whole request head, from when it opens
  and again after each response (a silent or half-sent request is closed; uvicorn alone
  waits forever). The body has its own bound (``_app``: 408 after 60 s); a connection
  whose client still sends a body its response did not wait for is closed with the
  response (it would otherwise trickle it forever, out of every timer's reach).
- An idle keep-alive connection closes after ``keep_alive_s`` (uvicorn's own timer).
- Past ``max_connections`` in all, or ``max_connections_per_client`` from one address
  (an IPv6 client's /64), a connection's requests get a JSON 503 with ``Retry-After`` and
  ``Connection: close`` (uvicorn's ``limit_concurrency`` sends plain text), and its head
  timer is 1 s; connections refused for their address do not count in the total, so one
  address cannot push the others past it.

Runs in the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from actors.http._errors import RETRY_AFTER_S, error_body
from actors.http._service import client_key
from actors.http._settings import HttpSettings

__all__ = ["guarded_protocol"]

_OVER_LIMIT_HEADER_TIMEOUT_S = 1.0  # a refused connection's time to send the request it is refused


def _refusal(message: str) -> Any:
    """An ASGI app that answers every request with a JSON 503 and closes the connection."""
    body = error_body(503, message)

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def guarded_protocol(settings: HttpSettings) -> type[H11Protocol]:
    """The h11 protocol class for uvicorn's ``http`` option, bounded by ``settings``
    (``header_timeout_s``, ``max_connections``, ``max_connections_per_client``)."""
    per_client: Counter[str] = Counter()
    refused_here: set[H11Protocol] = set()  # refused for their address: not in the total
    total = settings.max_connections
    most = settings.max_connections_per_client
    too_many = _refusal(f"the server has {total} connections open, its limit: retry later")
    too_many_here = _refusal(f"this address has {most} connections open, the limit per client: retry later")

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _address: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = client_key(self.client[0]) if self.client else None
            timeout = settings.header_timeout_s
            if self._address is not None:
                per_client[self._address] += 1
                if most and per_client[self._address] > most:
                    self.app, timeout = too_many_here, _OVER_LIMIT_HEADER_TIMEOUT_S
                    refused_here.add(self)
            if self not in refused_here and len(self.connections) - len(refused_here) > total:
                self.app, timeout = too_many, _OVER_LIMIT_HEADER_TIMEOUT_S
            self._arm(timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            refused_here.discard(self)
            if self._address is not None:
                per_client[self._address] -= 1
                if per_client[self._address] <= 0:
                    del per_client[self._address]
                self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the request's head is in

        def on_response_complete(self) -> None:
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                self.transport.close()  # answered before its body came (404, 413, 408...): no more
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(settings.header_timeout_s)  # the next request's head, within the bound too

        def _arm(self, timeout: float) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # no request began in time (or only part of its head)

    return GuardedH11Protocol
