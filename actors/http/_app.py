"""The ASGI app: routes at llama-server's paths, and one gate in front of them that
answers CORS preflights, refuses requests while loading or draining (503), checks the
API key in constant time (401), wakes a sleeping model for a request that needs it
(``--sleep-idle-seconds``, :mod:`actors.http._sleep`), and counts requests in flight.

Runs on the event loop. Handlers raise ``HttpError`` or an ``EngineError``; the route
wrapper turns each into llama-server's error body, and anything unexpected into a 500
without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors.http import (
    _anthropic,
    _decisions,
    _embeddings,
    _infill,
    _info,
    _lora,
    _models,
    _native,
    _openai,
    _responses,
    _resume,
    _slot_actions,
)
from actors.http._access import ACCESS, Access, log_access
from actors.http._errors import RETRY_AFTER_S, HttpError, answered, error_body, error_response
from actors.http._generation import error_event
from actors.http._replays import Replays
from actors.http._service import CLIENT, Service
from actors.http._settings import HttpSettings
from actors.http._stream import EventStream

__all__ = ["create_app"]

_log = logging.getLogger("llama_cpp_actors.http")

# llama-server's public paths: no API key needed.
_PUBLIC = frozenset({"/health", "/v1/health"})
# JSON bodies larger than this are parsed in a worker thread, off the event loop.
_PARSE_INLINE_BYTES = 256 * 1024
_BODY_TIMEOUT_S = 60.0
_SHUTDOWN = "the server is shutting down: the request was cancelled"

Handler = Callable[[Request], Awaitable[Response | EventStream]]


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _loads(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_no_constants)


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise HttpError(413, f"the request body is larger than {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(_BODY_TIMEOUT_S):  # a slow body holds only its own coroutine, not forever
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"the request body is larger than {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {_BODY_TIMEOUT_S:.0f} s") from None
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return _loads(raw) if size <= _PARSE_INLINE_BYTES else await asyncio.to_thread(_loads, raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting a JSON bomb deep
        raise HttpError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def _endpoint(
    handler: Handler, *, body: bool, resumable: bool = False
) -> Callable[[Request], Awaitable[Any]]:
    """``handler`` with its JSON body read, and every failure as an error response;
    ``resumable``: a stream sent with ``X-Conversation-Id`` is served by ``_resume``."""

    async def work(request: Request) -> Any:
        if body:
            service: Service = request.app.state.service
            request.state.json = await _read_json(request, service.settings.max_body_bytes)
        conv_id = _resume.conversation_id(request) if resumable else None
        if conv_id is not None:
            return await _resume.start(request, conv_id, handler)
        return await handler(request)

    async def endpoint(request: Request) -> Any:
        return await answered(request, lambda: work(request))

    return endpoint


def _routes() -> list[Route]:
    get: dict[str, Handler] = {
        "/health": _info.health,
        "/v1/health": _info.health,
        "/models": _info.models,
        "/v1/models": _info.models,
        "/props": _info.props,
        "/slots": _info.slots,
        "/metrics": _info.metrics,
        "/lora-adapters": _lora.get_adapters,
    }
    post: dict[str, Handler] = {
        "/completion": _native.completion,
        "/completions": _native.completion,
        "/infill": _infill.infill,
        "/v1/completions": _openai.completions,
        "/chat/completions": _openai.chat_completions,
        "/v1/chat/completions": _openai.chat_completions,
        "/chat/completions/input_tokens": _openai.input_tokens,
        "/v1/chat/completions/input_tokens": _openai.input_tokens,
        "/v1/messages": _anthropic.messages,
        "/v1/responses": _responses.responses,
        "/responses": _responses.responses,
        "/v1/responses/input_tokens": _responses.input_tokens,
        "/responses/input_tokens": _responses.input_tokens,
        "/v1/messages/count_tokens": _anthropic.count_tokens,
        "/tokenize": _native.tokenize,
        "/detokenize": _native.detokenize,
        "/apply-template": _native.apply_template,
        "/embedding": _embeddings.embeddings,
        "/embeddings": _embeddings.embeddings,
        "/v1/embeddings": _embeddings.embeddings_oai,
        "/v1/systemone": _decisions.systemone,
        "/v1/decisions": _decisions.decisions,
        "/models/load": _models.load,  # router mode (404 with one model, as llama-server)
        "/models/unload": _models.unload,
        "/lora-adapters": _lora.set_adapters,
        "/slots/{id_slot}": _slot_actions.slot_action,
    }
    # Resumable streams (llama-server's): replay one from an offset, look ids up, stop one.
    get["/v1/stream"] = _resume.resume
    post["/v1/streams/lookup"] = _resume.lookup
    resumable = _resume.RESUMABLE_PATHS
    return [
        *(Route(path, _endpoint(h, body=False), methods=["GET"]) for path, h in get.items()),
        *(
            Route(path, _endpoint(h, body=True, resumable=path in resumable), methods=["POST"])
            for path, h in post.items()
        ),
        Route("/v1/stream", _endpoint(_resume.stop, body=False), methods=["DELETE"]),
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = _not_found(request) if status == 404 else str(getattr(exc, "detail", "")) or "error"
    headers = getattr(exc, "headers", None) or {}
    return error_response(HttpError(status, message, headers=headers))


def _not_found(request: Request) -> str:
    """A 404 that names the path asked for, the endpoint it was likely meant for, and
    what this server serves (llama-server says only "File Not Found")."""
    served: dict[str, list[str]] = {"POST": [], "GET": [], "DELETE": []}
    for route in request.app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method in served:
                served[method].append(route.path)
    path = request.url.path[:200]
    guess = difflib.get_close_matches(path, served["POST"] + served["GET"], n=1)
    hint = f"; did you mean {guess[0]}?" if guess else "."
    listing = "; ".join(f"{method} {', '.join(paths)}" for method, paths in served.items() if paths)
    return (
        f"File Not Found: {request.method} {path} is not an endpoint of this server{hint} "
        f"It serves {listing} (see docs/guides/http.md)"
    )


def _is_localhost(origin: str) -> bool:
    try:
        return urlsplit(origin).hostname in ("localhost", "127.0.0.1", "::1")
    except ValueError:
        return False


class _Gate:
    """What llama-server's pre-routing handler does, as ASGI middleware (event loop)."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service
        self.keys = [key.encode() for key in service.settings.api_keys]
        self.per_key: dict[bytes, int] = {}  # requests in flight by API key

    def _allow_origin(self, headers: Mapping[bytes, bytes]) -> bytes | None:
        settings = self.service.settings
        origin = headers.get(b"origin", b"")
        if settings.cors_origins == "*" and settings.cors_credentials:
            return origin or None  # llama-server echoes any Origin
        if settings.cors_origins == "localhost":
            return origin if origin and _is_localhost(origin.decode("latin-1")) else None
        allowed = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
        if len(allowed) == 1:
            return allowed[0].encode("latin-1")  # as llama-server sends it
        # A header may name one origin: the request's, when it is on the list.
        return origin if origin and origin.decode("latin-1") in allowed else None

    def _key_of(self, headers: Mapping[bytes, bytes]) -> bytes | None:
        """The API key the request gives, if it is one of ours."""
        given = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        if given.startswith(b"Bearer "):
            given = given[len(b"Bearer ") :]
        # Every key is compared, each in constant time: no timing tells which one nearly matched.
        matches = [key for key in self.keys if hmac.compare_digest(given, key)]
        return matches[0] if matches else None

    async def _reply(self, send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]]) -> None:
        body = error_body(status, message)
        headers = [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            *extra,
        ]
        if status == 503:
            headers.append((b"Retry-After", str(RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The request's id: its X-Request-Id, its engine request's id, its access line.
        access = Access.start(scope)
        state = scope.setdefault("state", {})
        if isinstance(state, dict):
            state[ACCESS] = access
        named = (b"X-Request-Id", access.request_id.encode())

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), named]}
            access.see(message)
            await send(message)

        try:
            await self._serve(scope, receive, send_named)
        finally:
            log_access(access)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        origin = self._allow_origin(headers)
        # llama-server's capitalisation: some clients (its own test suite) compare names exactly.
        cors = [(b"Access-Control-Allow-Origin", origin)] if origin is not None else []
        settings, service = self.service.settings, self.service
        if scope["method"] == "OPTIONS":
            preflight = [
                *cors,
                (b"Access-Control-Allow-Credentials", b"true" if settings.cors_credentials else b"false"),
                (b"Access-Control-Allow-Methods", settings.cors_methods.encode("latin-1")),
                (b"Access-Control-Allow-Headers", settings.cors_headers.encode("latin-1")),
                (b"Content-Type", b"text/html"),
                (b"Content-Length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": preflight})
            await send({"type": "http.response.body", "body": b""})
            return
        if not service.ready:
            await self._reply(send, 503, "Loading model", cors)
            return
        key = None
        if self.keys and scope["path"] not in _PUBLIC:
            key = self._key_of(headers)
            if key is None:
                await self._reply(send, 401, "Invalid API Key", cors)
                return
            state = scope.get("state")
            if isinstance(state, dict):  # the key, not its text, names the client (request_client)
                state[CLIENT] = f"key#{self.keys.index(key)}"
            most = settings.max_connections_per_client
            if most and self.per_key.get(key, 0) >= most:
                await self._reply(send, 503, f"this API key has {most} requests in flight, its limit", cors)
                return
        if service.draining:
            await self._reply(send, 503, "the server is shutting down", cors)
            return
        sleeper = service.sleeper
        if sleeper is not None and not sleeper.wakes(scope["method"], scope["path"]):
            sleeper = None  # /health, /props...: answered asleep, and no activity
        if sleeper is not None:
            try:
                await sleeper.enter()  # a sleeping model loads again first
            except HttpError as e:
                await self._reply(send, e.status, e.message, cors)
                return

        started: list[bool] = []  # [is an event stream], once the response has begun

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(any(v.startswith(b"text/event-stream") for _, v in message.get("headers", ())))
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        task = asyncio.current_task()
        service.in_flight += 1
        if key is not None:
            self.per_key[key] = self.per_key.get(key, 0) + 1
        if task is not None:
            service.tasks.add(task)
        try:
            await self.app(scope, receive, send_with_cors)
        except asyncio.CancelledError:
            if not service.drain_expired or task is None:
                raise
            # The drain's time is up: the request was cancelled (its engine request
            # with it); the client gets a clean ending, never a cut-off body.
            task.uncancel()
            with contextlib.suppress(OSError, RuntimeError):
                if not started:
                    await self._reply(
                        send, 503, "the server is shutting down: the request was cancelled", cors
                    )
                elif started[0]:
                    ending = error_event(HttpError(503, _SHUTDOWN))
                    await send({"type": "http.response.body", "body": ending})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if sleeper is not None:
                sleeper.leave()
            service.in_flight -= 1
            if key is not None:
                self.per_key[key] -= 1
                if not self.per_key[key]:
                    del self.per_key[key]
            if task is not None:
                service.tasks.discard(task)
            if service.views is not None:  # router mode: the model this request held is free
                service.views.release(scope)


def create_app(settings: HttpSettings, start_engine: Callable[[], Any]) -> ASGIApp:
    """The HTTP face of an engine, as an ASGI app (run it with uvicorn, or ``serve``).

    ``start_engine`` is called once at startup, in a worker thread, and returns the
    engine handle: a ``ServerActor`` ref, a ``Supervisor`` or a ``ServerPool``; it is
    stopped at shutdown. Until it has loaded, every request gets 503.
    """
    service = Service(settings, start_engine)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        # Serve at once (503 while loading, as llama-server does); load beside it.
        loading = asyncio.create_task(service.start())
        try:
            yield
        finally:
            loading.cancel()
            if service.sleeper is not None:
                service.sleeper.stop()
            app.state.replays.close()
            await asyncio.to_thread(service.close)

    app = Starlette(
        routes=_routes(),
        lifespan=lifespan,
        exception_handlers={404: _http_error, 405: _http_error},
    )
    app.state.service = service
    app.state.replays = Replays(settings.resumable)
    gate = _Gate(app, service)
    gate.service = service
    return gate
