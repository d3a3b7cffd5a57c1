"""The resumable streams the server keeps, by owner and conversation id, within
``ResumeBounds``: how many in all and per client, and for how long once ended.

A conversation id is caller input: 1 to ``MAX_ID_CHARS`` visible ASCII characters
(``check_conv_id``). Streams are kept per owner: with API keys, each key's streams are
its own, and another key's id is unknown to it (404), never readable; without keys the
server is open to all, and so is every id, as on llama-server (the id is then the only
secret). One (owner, id) holds one stream: a new request with the same id replaces the
old stream and cancels its generation (llama-server's ``create_or_replace``).

Eviction never touches a stream that is generating or being read. A client at its
bound evicts its own oldest ended stream; a full server evicts the oldest ended stream
of the client that keeps the most, and only of one that keeps at least as many as the
newcomer would: one tenant cannot evict everyone's. An ended stream is dropped
``ttl_s`` after it ended and its last reader left (a timer, and a check at every look).

Runs on the event loop, every method.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from actors.http._errors import HttpError
from actors.http._replay import Phase, Replay
from actors.http._settings import ResumeBounds

__all__ = ["MAX_ID_CHARS", "Replays", "check_conv_id"]

MAX_ID_CHARS = 256
"""The longest conversation id (llama-server's web UI sends a UUID and a model name)."""


def check_conv_id(value: str, where: str) -> str:
    """``value`` if it is a conversation id, else a 400 naming ``where`` it came from."""
    rule = f"{where} must be 1 to {MAX_ID_CHARS} visible ASCII characters (no spaces or control characters)"
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise HttpError(400, f"{rule}; it has {len(value)}")
    bad = next((i for i, c in enumerate(value) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise HttpError(400, f"{rule}; its character {bad} is not one (U+{ord(value[bad]):04X})")
    return value


class Replays:
    """Every resumable stream the server keeps (event loop)."""

    def __init__(self, bounds: ResumeBounds) -> None:
        self.bounds = bounds
        self._streams: dict[tuple[str, str], Replay] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, owner: str, conv_id: str, client: str) -> Replay:
        """A new stream for (``owner``, ``conv_id``), replacing (and stopping) the one it
        had, after making room for it (a client replacing its own stream needs none).

        Raises:
            HttpError: 429, ``client`` keeps its bound of streams and none has ended;
                503, the server keeps its bound and none can be evicted.
        """
        previous = self._streams.get((owner, conv_id))
        if previous is None or previous.client != client:
            self._make_room(client)  # before the stop: a refused request stops nothing
        if previous is not None:
            self.stop(previous)
        replay = Replay(
            conv_id,
            owner,
            client,
            max_bytes=self.bounds.max_bytes,
            max_events=self.bounds.max_events,
            on_idle=self._schedule,
        )
        self._streams[(owner, conv_id)] = replay
        return replay

    def get(self, owner: str, conv_id: str) -> Replay | None:
        """The stream of (``owner``, ``conv_id``), if it is kept and has not expired."""
        replay = self._streams.get((owner, conv_id))
        if replay is not None and self._expired(replay):
            self._drop(replay)
            return None
        return replay

    def owned(self, owner: str, conv_ids: Iterable[str]) -> list[Replay]:
        """``owner``'s streams whose id is one of ``conv_ids``, or one of them followed
        by ``::`` (llama-server's per-model ids, ``<id>::<model>``)."""
        wanted = set(conv_ids)
        prefixes = tuple(f"{conv_id}::" for conv_id in wanted)
        found = []
        for (whose, conv_id), replay in list(self._streams.items()):
            named = conv_id in wanted or conv_id.startswith(prefixes)
            if whose == owner and named and self.get(whose, conv_id) is not None:
                found.append(replay)
        return found

    def forget(self, replay: Replay) -> None:
        """Drop ``replay`` (it failed before its first event: nothing to resume)."""
        if self._streams.get((replay.owner, replay.conv_id)) is replay:
            self._drop(replay)

    def stop(self, replay: Replay) -> None:
        """Stop ``replay``'s generation (its engine request is cancelled) and drop it;
        its readers end."""
        self.forget(replay)
        replay.enter(Phase.STOPPED)
        if replay.producer is not None:
            replay.producer.cancel()

    def close(self) -> None:
        """Stop every stream (shutdown)."""
        for replay in list(self._streams.values()):
            self.stop(replay)

    # -- bounds --------------------------------------------------------------------

    def _evictable(self, replay: Replay) -> bool:
        return replay.ended and not replay.readers

    def _make_room(self, client: str) -> None:
        bounds = self.bounds
        mine = [r for r in self._streams.values() if r.client == client]
        if len(mine) >= bounds.max_streams_per_client:
            ended = [r for r in mine if self._evictable(r)]
            if not ended:
                raise HttpError(
                    429,
                    f"this client keeps {len(mine)} resumable streams (X-Conversation-Id), its "
                    f"limit of {bounds.max_streams_per_client}, and none of them has ended: stop "
                    "one (DELETE /v1/stream?conv_id=...) or wait for one to end",
                    kind="rate_limit_error",
                )
            victim = min(ended, key=lambda r: r.completed_at)
            self._drop(victim)
            mine.remove(victim)
        if len(self._streams) < bounds.max_streams:
            return
        counts: dict[str, int] = {}
        for replay in self._streams.values():
            counts[replay.client] = counts.get(replay.client, 0) + 1
        newcomer = len(mine) + 1
        candidates = [
            r for r in self._streams.values() if self._evictable(r) and counts[r.client] >= newcomer
        ]
        if not candidates:
            raise HttpError(
                503,
                f"the server keeps {len(self._streams)} resumable streams (X-Conversation-Id), its "
                f"limit of {bounds.max_streams}, and none it may evict for this client has ended: "
                "retry later",
            )
        self._drop(min(candidates, key=lambda r: (-counts[r.client], r.completed_at)))

    def _expired(self, replay: Replay) -> bool:
        return replay.ended and not replay.readers and time.monotonic() - replay.t_idle >= self.bounds.ttl_s

    def _schedule(self, replay: Replay) -> None:
        """``replay`` has ended and nobody reads it: drop it ``ttl_s`` from now, unless
        a reader comes meanwhile (then again when the last one leaves)."""
        if self._streams.get((replay.owner, replay.conv_id)) is not replay:
            return
        self._arm(replay, self.bounds.ttl_s)

    def _arm(self, replay: Replay, delay_s: float) -> None:
        timer = self._timers.pop(id(replay), None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[id(replay)] = loop.call_later(delay_s, self._expire, replay)

    def _expire(self, replay: Replay) -> None:
        self._timers.pop(id(replay), None)
        if self._streams.get((replay.owner, replay.conv_id)) is not replay:
            return
        if self._expired(replay):
            self._drop(replay)
        elif replay.ended and not replay.readers:  # the timer ran a hair early
            self._arm(replay, self.bounds.ttl_s - (time.monotonic() - replay.t_idle))

    def _drop(self, replay: Replay) -> None:
        self._streams.pop((replay.owner, replay.conv_id), None)
        timer = self._timers.pop(id(replay), None)
        if timer is not None:
            timer.cancel()
