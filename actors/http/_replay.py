"""One resumable stream: the bytes it has sent, kept in a bounded ring of events, where
its generation is (``Phase``), and the readers that follow it.

Offsets are byte offsets into the stream's body, as llama-server's ``from``: byte N is
the N-th byte the stream sent, to whichever reader. The ring keeps whole events: when
a new event would take it past ``max_bytes`` or ``max_events``, the oldest events are
dropped and their offsets are lost (the newest event is always kept, even one larger
than ``max_bytes`` on its own). A reader that asks for a lost offset, or falls that far
behind, is told so and never given a torn event.

Any number of readers may follow one stream, each from its own offset (llama-server's
rule); each gets the same bytes from there on. The registry bounds how many.

Runs on the event loop, every method: no locks. Readers wait on an ``asyncio.Event``
that every change sets and replaces.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

__all__ = ["Phase", "Replay"]


class Phase(enum.Enum):
    """Where a resumable stream's generation is, in order; past ``STREAMING`` it has ended."""

    LOADING = 1
    """Router mode: its model is loading (a reader is told to retry)."""
    STARTING = 2
    """Read, queued or prefilling: nothing sent yet (a reader waits for the first bytes)."""
    STREAMING = 3
    """Sending: its first event has been kept."""
    DONE = 4
    """Ended: every byte it will send is in the ring (or was, before it was dropped)."""
    FAILED = 5
    """Ended before its first event, with an error response (``failure``)."""
    STOPPED = 6
    """Stopped by ``DELETE /v1/stream``, or replaced by a newer stream of the same id."""


class Replay:
    """A resumable stream's ring of sent events and its state (event loop).

    Args:
        conv_id: its ``X-Conversation-Id``.
        owner: whose it is: the API key's name (``key#<index>``), or "" without keys.
        client: who started it, for the per-client bound (the key, or the address).
        max_bytes: the ring's bytes (the newest event is kept even past it).
        max_events: the ring's events.
        on_idle: called when it has ended and its last reader has left (the registry
            starts its time to live then).
    """

    def __init__(
        self,
        conv_id: str,
        owner: str,
        client: str,
        *,
        max_bytes: int,
        max_events: int,
        on_idle: Callable[[Replay], None],
    ) -> None:
        self.conv_id = conv_id
        self.owner = owner
        self.client = client
        self.phase = Phase.STARTING
        self.failure: Response | None = None  # FAILED: the response its request got
        self.producer: asyncio.Task[None] | None = None  # the task that generates it
        self.headers: list[tuple[bytes, bytes]] = []  # its response's, for every reader
        self.readers = 0
        self.started_at = time.time()  # wall clock: POST /v1/streams/lookup reports it
        self.completed_at = 0.0
        self.t_idle = 0.0  # monotonic: when it became ended with no reader
        self._max_bytes = max_bytes
        self._max_events = max_events
        self._on_idle = on_idle
        self._events: deque[bytes] = deque()
        self._kept = 0  # bytes in _events
        self.first = 0  # offset of _events[0]
        self.end = 0  # bytes sent in all
        self._changed = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self.phase.value > Phase.STREAMING.value

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self) -> None:
        """Return at the next change: an event kept, a phase left."""
        await self._changed.wait()

    # -- the producer's side -------------------------------------------------------

    def enter(self, phase: Phase) -> None:
        """Move on to ``phase`` (``STREAMING`` once its first event is about to come)."""
        if self.ended:
            return
        self.phase = phase
        if self.ended:
            self.completed_at = time.time()
            if not self.readers:
                self.t_idle = time.monotonic()
                self._on_idle(self)
        self._notify()

    def fail(self, response: Response) -> None:
        """It ended before its first event: ``response`` is its request's answer."""
        if not self.ended:
            self.failure = response
            self.enter(Phase.FAILED)

    def append(self, event: bytes) -> None:
        """Keep an event it sent, dropping the oldest past the ring's bounds."""
        if self.ended or not event:
            return
        self._events.append(event)
        self._kept += len(event)
        self.end += len(event)
        while len(self._events) > 1 and (
            self._kept > self._max_bytes or len(self._events) > self._max_events
        ):
            dropped = self._events.popleft()
            self._kept -= len(dropped)
            self.first += len(dropped)
        self._notify()

    # -- readers -------------------------------------------------------------------

    def kept(self, offset: int) -> bytes:
        """The bytes kept from ``offset`` (``first <= offset <= end``) to the end."""
        # From the newest back: a live reader asks for the last few events, each token.
        parts = []
        at = self.end
        for event in reversed(self._events):
            if at <= offset:
                break
            at -= len(event)
            parts.append(event[offset - at :] if at < offset else event)
        parts.reverse()
        return b"".join(parts)

    async def follow(self, offset: int, lost: Callable[[int], bytes]) -> AsyncIterator[bytes]:
        """Every byte from ``offset`` on, as they are kept, until the stream ends (a
        failure's error as a last event); ``lost(offset)`` is the last event when the
        ring has dropped what this reader has yet to read."""
        self.readers += 1
        try:
            while True:
                if offset < self.first:
                    yield lost(offset)
                    return
                if offset < self.end:
                    chunk = self.kept(offset)
                    offset += len(chunk)
                    yield chunk
                    continue
                if self.ended:
                    if self.phase is Phase.FAILED and self.failure is not None:
                        yield b"data: " + bytes(self.failure.body) + b"\n\n"
                    return
                await self.changed()
        finally:
            self.readers -= 1
            if not self.readers and self.ended:
                self.t_idle = time.monotonic()
                self._on_idle(self)
