"""What a ``ServerPool`` needs of a replica, and the local kind.

A replica is one engine of a pool, wherever it runs. The pool hands each request a
``Tracked`` future or a ``Relay`` reply path, through which the replica (its engine
thread, or a Ray replica's outbox reader) tells the pool when the request ends.
``LocalReplica`` is a ``Supervisor`` around a ServerActor in this process; the Ray
kind lives in :mod:`actors.scale._ray`.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable
from typing import Any, Protocol

import pykka

from actors.actor import ServerOptions, Supervisor
from actors.contract import (
    AskedMessage,
    Cancel,
    CancelExact,
    Done,
    Drain,
    Failed,
    Progress,
    QueueFull,
    ReplyTo,
    RequestTimeout,
    StreamMessage,
    Submit,
    Token,
    put_nowait,
)

__all__ = ["LocalReplica", "Relay", "Replica", "ReplicaDown", "Tracked", "forwarding"]


class ReplicaDown(Exception):
    """Internal: the replica cannot take the request; the pool tries another."""


class Replica(Protocol):
    """One engine of a pool, whatever hosts it. Methods run in callers' threads."""

    name: str
    on_down: Callable[[str], None] | None
    """Called with the name when the replica is found dead (its KV is gone)."""

    def up(self) -> bool:
        """True when it can take requests now (never waits)."""

    def gave_up(self) -> str | None:
        """Why it will never take requests again (its restarts ran out), or None."""

    def submit(self, message: AskedMessage, future: Tracked, timeout: float | None) -> None:
        """Admit ``message``; ``future`` gets its Completion or error. ReplicaDown if down.

        Waits at most ``timeout`` for the admission; then cancels it and raises
        ``RequestTimeout``.
        """

    def send(self, message: StreamMessage) -> None:
        """Admit a stream whose ``reply_to`` is a ``Relay``. ReplicaDown if down."""

    def cancel(self, request_id: str, message: object | None = None) -> None:
        """Cancel a request it runs (only the one admitted from ``message``, if given); never raises."""

    def call(self, message: Any, timeout: float | None) -> Any:
        """GetStats, GetInfo, GetTokenizer or Drain, answered (waits at most ``timeout``).

        Raises:
            ReplicaDown: it is down.
            EngineStopped: it stopped while draining, without answering the drain.
            RequestTimeout: a Drain did not end within ``timeout``.
        """

    def stop(self) -> None:
        """Stop for good; requests in flight fail with EngineStopped."""


class Tracked(pykka.ThreadingFuture[Any]):
    """The future a pool hands out for a Generate; it tells the pool when it settles.

    ``set``/``set_exception`` run in the thread that ends the request.
    """

    def __init__(self, on_settle: Callable[[], None]) -> None:
        super().__init__()
        self._on_settle = on_settle
        self.on_full: Callable[[], bool] | None = None
        """Called when a replica refuses with QueueFull after ``submit`` returned (Ray):
        True when the request went to another replica, so this error is not delivered."""

    def set(self, value: Any | None = None) -> None:
        super().set(value)
        self._on_settle()

    def set_exception(self, exc_info: Any = None) -> None:
        super().set_exception(exc_info)
        self._on_settle()


class Relay:
    """The ``reply_to`` a pool gives a replica: forwards every event to the caller's,
    and tells the pool when the last ``Done`` or ``Failed`` passes (one per choice of
    ``n``). ``put`` runs in the thread that produces events (the engine, or a replica's
    outbox thread)."""

    def __init__(self, reply_to: ReplyTo, on_settle: Callable[[], None], n: int = 1) -> None:
        self.reply_to = reply_to
        self._on_settle = on_settle
        self.n = n
        self._ends = 0
        self.ends_seen = 0
        """Terminal events a Ray replica's outbox thread has seen (it counts them)."""
        self.on_full: Callable[[], bool] | None = None
        """Called when the replica refuses the stream with QueueFull: True when the request
        went to another replica (whose events come here too), so the Failed is dropped."""

    def put(self, event: Progress | Token | Done | Failed) -> None:
        full = isinstance(event, Failed) and isinstance(event.error, QueueFull)
        if full and self.on_full is not None:
            on_full, self.on_full = self.on_full, None  # once: a held Failed comes back here
            if on_full():
                return
        # As the engine does: never block on a bounded queue. queue.Full is "not now":
        # the sender's courier holds the event and retries, so nothing is settled yet.
        # Any other refusal ends the request (the engine, or the Ray relay, cancels it).
        try:
            put_nowait(self.reply_to, event)
        except queue.Full:
            raise
        except BaseException:
            self._on_settle()
            raise
        if isinstance(event, Done | Failed):
            self._ends += 1
            if self._ends == self.n:
                self._on_settle()

    def on_abandon(self) -> None:
        """The courier gave up on events nobody read: the request counts as settled."""
        self._on_settle()


class LocalReplica:
    """A Supervisor around a ServerActor in this process."""

    def __init__(self, name: str, max_restarts: int, max_seconds: float, options: ServerOptions) -> None:
        self.name = name
        self.on_down: Callable[[str], None] | None = None  # a restarted engine has no KV
        self.supervisor = Supervisor.start(
            options, max_restarts=max_restarts, max_seconds=max_seconds, name=name
        )

    def _ref(self) -> pykka.ActorRef[Any]:
        ref = self.supervisor.current()
        if ref is None:
            raise ReplicaDown(self.name)
        return ref

    def up(self) -> bool:
        return self.supervisor.current() is not None

    def gave_up(self) -> str | None:
        return self.supervisor.gave_up

    def submit(self, message: AskedMessage, future: Tracked, timeout: float | None) -> None:
        ref = self._ref()
        # Not a blocking ask: an engine in a long (or stuck) tick answers only after it.
        admitted = ref.ask(Submit(message, future), block=False)
        try:
            admitted.get(timeout=timeout)
        except pykka.ActorDeadError:
            raise ReplicaDown(self.name) from None
        except pykka.Timeout:
            # It may be admitted later: this cancel follows it in the same inbox.
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(CancelExact(message.request_id, message))
            raise RequestTimeout(f"{self.name} did not admit the request within {timeout} s") from None

    def send(self, message: StreamMessage) -> None:
        try:
            self._ref().tell(message)
        except pykka.ActorDeadError:
            raise ReplicaDown(self.name) from None

    def cancel(self, request_id: str, message: object | None = None) -> None:
        ref = self.supervisor.current()
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(Cancel(request_id) if message is None else CancelExact(request_id, message))

    def call(self, message: Any, timeout: float | None) -> Any:
        if isinstance(message, Drain):
            if not self.up():
                raise ReplicaDown(self.name)
            # Watches the actor: one stopped or crashed while draining ends the wait.
            return self.supervisor.drain(message, timeout)
        try:
            return self._ref().ask(message, timeout=timeout)
        except pykka.ActorDeadError:
            raise ReplicaDown(self.name) from None

    def stop(self) -> None:
        self.supervisor.stop()


def forwarding(
    settled: Callable[[], None], source: Callable[[], Tracked], outer: pykka.ThreadingFuture[Any]
) -> Callable[[], None]:
    """``settled``, then ``source()``'s outcome copied into ``outer`` (the thread that
    settles ``source()``, which is set by then)."""

    def settle() -> None:
        settled()
        try:
            value = source().get(timeout=0)
        except BaseException as error:
            with contextlib.suppress(Exception):
                outer.set_exception(exc_info=(type(error), error, error.__traceback__))
        else:
            with contextlib.suppress(Exception):
                outer.set(value)

    return settle
