"""Errors as llama-server and the OpenAI API send them: ``{"error": {"code", "message",
"type"}}`` with the matching status, never a traceback.

Runs on the event loop. Every engine error maps to one status here, so a handler only
raises (``HttpError`` or an ``EngineError``) and ``answered`` turns it into a response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from actors import (
    ConfigError,
    EngineError,
    EngineStopped,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelLoadError,
    PromptTooLong,
    QueueFull,
    RequestTimeout,
)
from actors.http._stream import ClientGone

__all__ = ["UTF8_JSON", "HttpError", "answered", "error_body", "error_response", "from_engine_error"]

_log = logging.getLogger("llama_cpp_actors.http")

UTF8_JSON = ("utf-8", "backslashreplace")
"""How JSON text becomes bytes: UTF-8, and a lone surrogate (``json.loads`` makes one from a
client's ``"\\ud83d"``) as its JSON escape again, where ``encode()`` would raise."""

# llama-server's error types (server-common.h, format_error_response).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
# How long a client should wait before retrying a 503 (queue full, loading, draining).
RETRY_AFTER_S = 1


class HttpError(Exception):
    """An error with its HTTP status, raised by handlers and turned into a response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        kind: str | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})
        self.kind = kind
        self.extra = dict(extra or {})


def error_body(
    status: int, message: str, kind: str | None = None, extra: Mapping[str, object] | None = None
) -> bytes:
    """The JSON body llama-server sends for an error (``kind``: its ``type``, by default
    the status's; ``extra``: more fields beside ``message``)."""
    error = {"code": status, "message": message, "type": kind or _TYPES.get(status, "server_error")}
    payload = {"error": {**error, **(extra or {})}}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode(*UTF8_JSON)


def error_response(error: HttpError) -> Response:
    """The response for ``error``; a 503 says when to retry."""
    response = Response(
        error_body(error.status, error.message, error.kind, error.extra),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json; charset=utf-8",
    )
    if error.status == 503 and "retry-after" not in response.headers:
        response.raw_headers.append((b"Retry-After", str(RETRY_AFTER_S).encode()))
    return response


def from_engine_error(error: EngineError) -> HttpError:
    """The HTTP face of an engine error: 400 for a bad request, 503 while the engine
    cannot take it (full queue, stopped, draining, no answer in time, a model that cannot
    load now: the memory budget, ``--models-max``, a file that failed), 500 for a failure
    of the engine itself."""
    if isinstance(error, PromptTooLong):  # llama-server's own type, with the numbers
        numbers = {"n_prompt_tokens": error.n_prompt_tokens, "n_ctx": error.n_ctx}
        message = str(error)
        if error.truncatable:  # the hint in this interface's words: a body field, flags
            message = (
                f"the request exceeds the available context size: its prompt is "
                f"{error.n_prompt_tokens} tokens and a slot holds {error.n_ctx}; send "
                '"truncate": true to keep its start and end, or start the server with a larger '
                "-c (or fewer slots, -np)"
            )
        return HttpError(400, message, kind="exceed_context_size_error", extra=numbers)
    if isinstance(error, InvalidRequest | ConfigError):
        return HttpError(400, str(error))
    if isinstance(error, MemoryBudgetExceeded):
        numbers = {"needed_mb": round(error.needed_mb), "budget_mb": round(error.budget_mb)}
        return HttpError(503, str(error), extra=numbers)
    if isinstance(error, QueueFull | EngineStopped | RequestTimeout | ModelLoadError):
        return HttpError(503, str(error))
    return HttpError(500, f"the engine failed: {error}")


async def answered(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
    """What ``work()`` returns, or the error response for what it raised: an
    ``HttpError`` or ``EngineError`` as its status, a client gone as 499, anything
    unexpected as a 500 without a traceback (which is logged)."""
    try:
        return await work()
    except HttpError as e:
        return error_response(e)
    except EngineError as e:
        return error_response(from_engine_error(e))
    except (ClientGone, ClientDisconnect):
        return Response(status_code=499)  # nobody is there to read it
    except RecursionError:  # a value nested past what some check can walk
        return error_response(HttpError(400, "the request nests too deeply"))
    except Exception:
        _log.exception("%s %s failed", request.method, request.url.path)
        return error_response(HttpError(500, "internal server error"))
