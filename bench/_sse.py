"""A lean HTTP/1.1 client for server-sent events, for the load generators.

On 2 cores every CPU second the load generator spends is taken from the server it
measures: httpx (its pools, its line decoder, anyio) cost about 4% of one core at
concurrency 8, enough to show as a few percent of any server's throughput. This client
does the least a correct client must: one keep-alive connection, a JSON POST, the
status line and headers, a ``Content-Length`` or chunked body, and SSE events split on
blank lines. Every server gets the same client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["HttpError", "SseConnection"]

_MAX_HEADER_BYTES = 64 * 1024


class HttpError(RuntimeError):
    """A response that is not 200, or a malformed one."""


class SseConnection:
    """One keep-alive connection to ``127.0.0.1:port`` (one request at a time)."""

    def __init__(self, port: int, timeout_s: float = 300.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        """POST ``body`` as JSON to ``path``; yield each SSE event's ``data:`` payload."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async for payload in self._events(path, body):
                    yield payload
        except BaseException:
            await self.close()  # the rest of the response is unread: the connection is spent
            raise

    async def _send(self, path: str, data: bytes) -> tuple[asyncio.StreamReader, int, dict[str, str]]:
        """Send the request and read the response head; a kept-alive connection the server
        closed meanwhile (nothing came back) is opened again, once, as httpx does."""
        reused = self._writer is not None
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAccept: text/event-stream\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        try:
            status, headers = await _head(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if not reused or (isinstance(e, asyncio.IncompleteReadError) and e.partial):
                raise
            await self.close()
            return await self._send(path, data)
        return reader, status, headers

    async def _events(self, path: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        reader, status, headers = await self._send(path, json.dumps(body).encode())
        chunked = headers.get("transfer-encoding") == "chunked"
        chunks = _chunked(reader) if chunked else _sized(reader, headers)
        if status != 200:
            text = b"".join([chunk async for chunk in chunks])
            raise HttpError(f"{path}: HTTP {status}: {text[:300]!r}")
        pending = b""
        async for chunk in chunks:
            pending += chunk.replace(b"\r\n", b"\n")
            *complete, pending = pending.split(b"\n\n")
            for event in complete:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].strip()
        if headers.get("connection") == "close":
            await self.close()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    if len(raw) > _MAX_HEADER_BYTES:
        raise HttpError("response headers too long")
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise HttpError(f"bad status line {status_line!r}")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    return int(parts[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                pass
            return
        chunk = await reader.readexactly(size + 2)
        yield chunk[:-2]


async def _sized(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "content-length" not in headers:
        raise HttpError("a response with neither Content-Length nor chunked encoding")
    size = int(headers["content-length"])
    if size:
        yield await reader.readexactly(size)
