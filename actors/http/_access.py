"""The access log, and the request id that finds a request in all three places.

Every HTTP request gets an id when it arrives (the gate makes it). The same id is:

- the ``X-Request-Id`` header of its response;
- the ``request_id`` of the engine request it makes, so the telemetry signals carry it
  (a second engine request of the same HTTP request is ``id-1``, and so on);
- the ``id=`` field of its access line.

The access line is written when the response is done: one line per request, at INFO,
or at WARNING with the error's message for a 4xx or 5xx. ``serve`` sends these lines,
and its banner, to stderr or ``--log-file``, as text or JSON (``--log-format``).
Everything here runs in the event loop's thread.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from actors import Completion

__all__ = ["ACCESS", "Access", "JsonFormatter", "access_of", "log_access"]

ACCESS = "llama_cpp_actors.access"
"""Where a request's :class:`Access` lives in its ASGI scope's ``state``."""

_log = logging.getLogger("llama_cpp_actors.http.access")

_MAX_ERROR_BODY = 4096  # an error body read for its message; JSON errors are far smaller


@dataclass(slots=True)
class Access:
    """One HTTP request as its access line tells it."""

    request_id: str
    method: str
    path: str
    client: str
    t_started: float
    status: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    error: str | None = None
    _issued: int = 0
    _body: bytes = b""

    @classmethod
    def start(cls, scope: MutableMapping[str, Any]) -> Access:
        client = scope.get("client") or ("-", 0)
        path = _printable(str(scope["path"])[:200])  # a client's path never forges a log line
        return cls(uuid.uuid4().hex, str(scope["method"]), path, str(client[0]), time.monotonic())

    def engine_id(self) -> str:
        """The ``request_id`` of the next engine request this HTTP request makes."""
        n, self._issued = self._issued, self._issued + 1
        return self.request_id if n == 0 else f"{self.request_id}-{n}"

    def count(self, completion: Completion) -> None:
        """Add a finished choice's tokens to the line."""
        self.prompt_tokens = max(self.prompt_tokens, completion.prompt_tokens)  # n choices share it
        self.generated_tokens += completion.generated_tokens

    def see(self, message: MutableMapping[str, Any]) -> None:
        """Note what the response says of itself: its status, and an error's body."""
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif (
            message["type"] == "http.response.body"
            and self.status >= 400
            and len(self._body) < _MAX_ERROR_BODY
        ):
            self._body += bytes(message.get("body", b""))[:_MAX_ERROR_BODY]

    def fields(self) -> dict[str, Any]:
        """The line's fields, as the JSON format writes them."""
        fields: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_ms": round((time.monotonic() - self.t_started) * 1000.0, 1),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "request_id": self.request_id,
            "client": self.client,
        }
        error = self.error or _error_message(self._body)
        if error is not None:
            fields["error"] = error
        return fields


def access_of(scope: Any) -> Access | None:
    """The :class:`Access` of a request (an ASGI scope or a Starlette request), if the
    gate made one."""
    scope = scope if isinstance(scope, MutableMapping) else getattr(scope, "scope", {})
    state = scope.get("state")
    access = state.get(ACCESS) if isinstance(state, dict) else None
    return access if isinstance(access, Access) else None


def log_access(access: Access) -> None:
    """Write the request's access line."""
    fields = access.fields()
    level = logging.WARNING if access.status >= 400 or access.status == 0 else logging.INFO
    if not _log.isEnabledFor(level):
        return
    text = (
        f"{fields['method']} {fields['path']} {fields['status']} {fields['duration_ms'] / 1000:.3f}s "
        f"prompt={fields['prompt_tokens']} gen={fields['generated_tokens']} id={fields['request_id']} "
        f"client={fields['client']}"
    )
    if "error" in fields:
        text += f" error={fields['error']!r}"
    _log.log(level, text, extra={"access": fields})


def _printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``...)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _error_message(body: bytes) -> str | None:
    if not body:
        return None
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else error
        return str(message)[:500]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: the time, the level, the logger, the message, and an
    access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            line.update(access)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)
