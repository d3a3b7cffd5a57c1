"""Delivering stream events without ever blocking the sender: the courier.

The engine thread (and a pool's relay threads) hand every stream event to
:data:`courier`, which puts it on the stream's ``reply_to`` at once with ``put_nowait``.
A full bounded queue (``queue.Full``) means "not now": the event, and every later event
for the same ``reply_to``, waits in the courier, whose own thread retries them in order
every few milliseconds. So the sender never waits on a consumer, and a terminal
``Done``/``Failed`` always arrives once the consumer reads again.

Held events that do not move for ``stall_s`` make the courier call the stream's
``on_stall`` once (the engine then cancels the request, so an unread stream stops
costing a slot); events still held ``give_up_s`` after they were first held are
dropped with a warning: that consumer is gone for good. Any other exception from
``put`` means the consumer is gone now: :meth:`Courier.send` returns False.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.contract import ReplyTo, put_nowait

__all__ = ["Courier", "courier", "settle"]

_log = logging.getLogger("llama_cpp_actors.delivery")


@dataclass(slots=True, eq=False)
class _Held:
    """The events of one ``reply_to`` that wait for room, oldest first."""

    reply_to: ReplyTo
    events: deque[object]
    on_stall: Callable[[], None] | None
    t_held: float = field(default_factory=time.monotonic)
    t_moved: float = field(default_factory=time.monotonic)
    stalled: bool = False


class Courier:
    """Holds and retries the events that found their queue full (thread-safe).

    Args:
        stall_s: held events that have not moved for this long call ``on_stall``.
        give_up_s: held events are dropped this long after they were first held.
        poll_s: how often the courier's thread retries.
    """

    def __init__(self, stall_s: float = 30.0, give_up_s: float = 300.0, poll_s: float = 0.005) -> None:
        self.stall_s = stall_s
        self.give_up_s = give_up_s
        self.poll_s = poll_s
        self._lock = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._thread: threading.Thread | None = None

    def send(self, reply_to: ReplyTo, event: object, on_stall: Callable[[], None] | None = None) -> bool:
        """Put ``event`` on ``reply_to`` now, or hold it behind the events already held.

        Runs in the sender's thread and never waits on the consumer. Returns False when
        the consumer is gone (its ``put`` raised anything but ``queue.Full``); the event
        is then dropped.
        """
        key = id(reply_to)
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.reply_to is reply_to:
                held.events.append(event)
                if on_stall is not None:
                    held.on_stall = on_stall
                return True
        # One sender per reply_to: nobody can hold an event for it between here and the put.
        try:
            put_nowait(reply_to, event)
        except queue.Full:
            with self._lock:
                held = self._held.get(key)
                if held is not None and held.reply_to is reply_to:  # another sender held one meanwhile
                    held.events.append(event)
                else:
                    self._held[key] = _Held(reply_to, deque([event]), on_stall)
                self._start()
                self._lock.notify()
            return True
        except BaseException as e:  # a consumer's put must never take the sender down
            _log.warning("a stream consumer's put raised %r; it is treated as gone", e)
            return False
        return True

    def held(self) -> int:
        """How many events wait in the courier now (any thread)."""
        with self._lock:
            return sum(len(h.events) for h in self._held.values())

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="llama-cpp-actors-courier", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._held:
                    self._lock.wait()
                entries = list(self._held.items())
            for key, held in entries:
                self._retry(key, held)
            time.sleep(self.poll_s)

    def _retry(self, key: int, held: _Held) -> None:
        """Deliver what ``held`` can take now, in order (courier thread)."""
        gone = False
        while True:
            with self._lock:
                if not held.events:
                    del self._held[key]
                    return
                event = held.events[0]
            try:
                put_nowait(held.reply_to, event)
            except queue.Full:
                break
            except BaseException as e:
                _log.warning("a stream consumer's put raised %r; its held events are dropped", e)
                gone = True
                break
            with self._lock:
                held.events.popleft()
                held.t_moved = time.monotonic()
        now = time.monotonic()
        if gone or now - held.t_held > self.give_up_s:
            with self._lock:
                dropped = len(held.events)
                del self._held[key]
            if not gone:
                _log.warning("dropped %d events nobody read for %.0f s", dropped, now - held.t_held)
            self._call(getattr(held.reply_to, "on_abandon", None))
            self._call(held.on_stall)
        elif not held.stalled and now - held.t_moved > self.stall_s:
            held.stalled = True
            self._call(held.on_stall)

    @staticmethod
    def _call(callback: object) -> None:
        if callable(callback):
            try:
                callback()
            except BaseException:
                _log.exception("a courier callback raised")


courier = Courier()
"""The process's courier: every engine and relay delivers through it."""


def settle(future: Any, value: object = None, error: BaseException | None = None) -> bool:
    """Resolve a future with ``value`` or ``error`` without ever raising (any thread).

    A pykka future raises ``queue.Full`` when it is resolved twice; a caller holding the
    future may have resolved it already, and the engine thread must go on regardless.
    Returns False when the future refused.
    """
    try:
        if error is None:
            future.set(value)
        else:
            future.set_exception(exc_info=(type(error), error, None))
    except BaseException as e:
        _log.warning("a future refused its result (%r); the caller resolved it already?", e)
        return False
    return True


"""The process's courier: every engine and relay delivers through it."""
