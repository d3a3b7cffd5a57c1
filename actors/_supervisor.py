"""``Supervisor``: keeps a ServerActor running, as an OTP supervisor keeps a GenServer.

pykka has no supervision. A Supervisor starts a ServerActor, waits on its
``actor_stopped`` event in a monitor thread, and starts a new one when it dies without
being asked to (a crash in a tick, or while loading), with exponential backoff and at
most ``max_restarts`` restarts within ``max_seconds`` (OTP's intensity and period). It is
a stable handle: ``ask``, ``tell``, ``stop`` and every helper reach the current actor.
Requests in flight when the actor died fail at once with ``EngineStopped`` (the dying
actor fails them); requests sent during a restart wait for it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import pykka

import telemetry
from actors._errors import ConfigError, EngineStopped
from actors._server import ServerActor, crash_reason

__all__ = ["Supervisor"]

_log = logging.getLogger("llama_cpp_actors.supervisor")

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
_RESTART_WAIT_S = 60.0


class Supervisor:
    """A restarting handle around a ServerActor. Start it with :meth:`start`."""

    def __init__(self, max_restarts: int, max_seconds: float, server_options: dict[str, Any]) -> None:
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if not isinstance(max_seconds, int | float) or max_seconds <= 0:
            raise ConfigError(f"max_seconds must be > 0, got {max_seconds!r}")
        self.max_restarts = max_restarts
        self.max_seconds = float(max_seconds)
        self._options = server_options
        self._lock = threading.Condition()
        self._ref: pykka.ActorRef[Any] | None = None
        self._stopping = False
        self._gave_up: str | None = None
        self._restarts: collections.deque[float] = collections.deque()
        self.restarts = 0

    @classmethod
    def start(cls, *, max_restarts: int = 3, max_seconds: float = 5.0, **server_options: Any) -> Supervisor:
        """Start a supervised ServerActor; options are ``ServerActor.start``'s.

        Bad options raise here, from the first start, as they would from ``ServerActor.start``.
        """
        supervisor = cls(max_restarts, max_seconds, server_options)
        supervisor._ref = ServerActor.start(**server_options)
        supervisor._watch(supervisor._ref)
        return supervisor

    # -- the stable handle (any thread) ------------------------------------------------

    @property
    def actor_ref(self) -> pykka.ActorRef[Any]:
        """The current ServerActor's ref; waits while a restart is under way."""
        deadline = time.monotonic() + _RESTART_WAIT_S
        with self._lock:
            while True:
                if self._gave_up is not None:
                    raise EngineStopped(self._gave_up)
                if self._stopping:
                    raise EngineStopped("the supervisor was stopped")
                ref = self._ref
                if ref is not None and ref.is_alive():
                    return ref
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineStopped("the engine did not come back in time")
                self._lock.wait(timeout=min(remaining, 0.1))

    def current(self) -> pykka.ActorRef[Any] | None:
        """The current ServerActor's ref if it is up, else None; never waits."""
        with self._lock:
            if self._stopping or self._gave_up is not None:
                return None
            ref = self._ref
        return ref if ref is not None and ref.is_alive() else None

    @property
    def gave_up(self) -> str | None:
        """Why the supervisor gave up, or None while it still restarts its engine."""
        return self._gave_up

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """``ActorRef.ask`` on the current actor."""
        try:
            return self.actor_ref.ask(message, block=block, timeout=timeout)
        except pykka.ActorDeadError as e:
            raise EngineStopped(f"the engine died while handling the message: {e}") from None

    def tell(self, message: Any) -> None:
        """``ActorRef.tell`` to the current actor."""
        try:
            self.actor_ref.tell(message)
        except pykka.ActorDeadError as e:
            raise EngineStopped(f"the engine died: {e}") from None

    def is_alive(self) -> bool:
        """True unless stopped or given up (a restart in progress counts as alive)."""
        return not self._stopping and self._gave_up is None

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the actor for good; no restart follows."""
        with self._lock:
            self._stopping = True
            ref = self._ref
            self._lock.notify_all()
        if ref is not None:
            ref.stop(block=block, timeout=timeout)

    # -- the monitor (its own thread) --------------------------------------------------

    def _watch(self, ref: pykka.ActorRef[Any]) -> None:
        thread = threading.Thread(
            target=self._monitor, args=(ref,), name="llama-cpp-actors-supervisor", daemon=True
        )
        thread.start()

    def _monitor(self, ref: pykka.ActorRef[Any]) -> None:
        ref.actor_stopped.wait()
        reason = crash_reason(ref.actor_urn)
        with self._lock:
            if self._stopping or reason is None:  # stopped on purpose
                return
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.max_seconds:
                self._restarts.popleft()
            if len(self._restarts) >= self.max_restarts:
                self._gave_up = (
                    f"the engine crashed {len(self._restarts) + 1} times within {self.max_seconds} s; "
                    f"the supervisor gave up (last: {reason})"
                )
                _log.error(self._gave_up)
                self._lock.notify_all()
                return
            self._restarts.append(now)
            backoff = min(_FIRST_BACKOFF_S * 2 ** (len(self._restarts) - 1), _MAX_BACKOFF_S)
        _log.warning("engine crashed (%s); restarting in %.0f ms", reason, backoff * 1000)
        time.sleep(backoff)
        try:
            new = ServerActor.start(**self._options)
        except Exception as e:  # the options were fine once: the model went away
            with self._lock:
                self._gave_up = f"the engine could not be restarted: {e!r}"
                self._lock.notify_all()
            return
        with self._lock:
            self._ref = new
            self.restarts += 1
            self._lock.notify_all()
        if telemetry.server_restart.receivers:
            name = self._options.get("name")
            telemetry.emit(
                telemetry.server_restart,
                self,
                {"restarts": self.restarts, "backoff_ms": backoff * 1000},
                {"reason": reason} if name is None else {"reason": reason, "replica": name},
            )
        self._watch(new)
