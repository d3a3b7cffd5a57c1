"""``Supervisor``: keeps a ServerActor running, as an OTP supervisor keeps a GenServer.

pykka has no supervision. A Supervisor starts a ServerActor and watches it from one
monitor thread, which starts a new one when it dies without being asked to (a crash in
a tick, or while loading), with exponential backoff and at most ``max_restarts``
restarts within ``max_seconds`` (OTP's intensity and period). It is a stable handle:
``ask``, ``tell``, ``stop`` and every helper reach the current actor. Requests in flight
when the actor died fail at once with ``EngineStopped`` (the dying actor fails them);
requests sent during a restart wait for it, at most as long as the caller's timeout.

An actor stopped on purpose (``ref.stop()`` on it, or a ``Drain`` that completed) stops
the supervisor too: it is not restarted, and calls raise ``EngineStopped`` at once. A
``Drain`` sent through the supervisor is final even if the actor crashes while draining.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import pykka

import telemetry
from actors.actor._crashes import crash_reason, why_died
from actors.actor._options import ServerOptions
from actors.actor._server import ServerActor
from actors.contract import Cancel, CancelExact, ConfigError, Drain, EngineStopped, RequestTimeout

__all__ = ["Supervisor"]

_log = logging.getLogger("llama_cpp_actors.supervisor")

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
_RESTART_WAIT_S = 60.0
_POLL_S = 0.25  # how often a drain's wait checks that its actor is alive
_DRAIN_GRACE_S = 5.0  # past Drain.timeout: a stuck tick never checks the drain's deadline
# pykka sets actor_stopped before it calls on_failure, where the crash is recorded: an
# actor found stopped without a reason may still be a crash for this long.
_CRASH_REASON_GRACE_S = 0.5


class Supervisor:
    """A restarting handle around a ServerActor. Start it with :meth:`start`."""

    def __init__(self, max_restarts: int, max_seconds: float, options: ServerOptions) -> None:
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if not isinstance(max_seconds, int | float) or max_seconds <= 0:
            raise ConfigError(f"max_seconds must be > 0, got {max_seconds!r}")
        self.max_restarts = max_restarts
        self.max_seconds = float(max_seconds)
        self._options = options  # checked once: each restart starts from the same
        self._lock = threading.Condition()
        self._ref: pykka.ActorRef[Any] | None = None
        self._stopped: str | None = None  # why no actor will come: stop(), a drain, a purposeful stop
        self._draining = False
        self._gave_up: str | None = None
        self._restarts: collections.deque[float] = collections.deque()
        self._monitor_thread: threading.Thread | None = None
        self.restarts = 0
        self._last_crash: tuple[str, str] = ("", "")  # (actor URN, why it crashed)

    @classmethod
    def start(
        cls,
        options: ServerOptions | None = None,
        /,
        *,
        max_restarts: int = 3,
        max_seconds: float = 5.0,
        **changes: Any,
    ) -> Supervisor:
        """Start a supervised ServerActor; the options are ``ServerActor.start``'s, a
        :class:`ServerOptions` and changes by name (caller's thread).

        Bad options raise here, before anything starts, as they would from
        ``ServerActor.start``.
        """
        options = ServerOptions.given(options, changes)
        supervisor = cls(max_restarts, max_seconds, options)
        supervisor._ref = ServerActor.start(options)
        thread = threading.Thread(target=supervisor._monitor, name="llama-cpp-actors-supervisor", daemon=True)
        supervisor._monitor_thread = thread
        thread.start()
        return supervisor

    # -- the stable handle (any thread) ------------------------------------------------

    def ref(self, timeout: float | None = _RESTART_WAIT_S) -> pykka.ActorRef[Any]:
        """The current ServerActor's ref, waiting at most ``timeout`` s for a restart.

        Runs in the caller's thread. ``timeout=None`` waits as long as restarts go on.

        Raises:
            EngineStopped: the supervisor was stopped, gave up, or its actor was
                stopped on purpose (drained): no actor will come.
            RequestTimeout: a restart is under way and did not finish within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._gave_up is not None:
                    raise EngineStopped(self._gave_up)
                if self._stopped is not None:
                    raise EngineStopped(self._stopped)
                ref = self._ref
                if ref is not None and ref.is_alive():
                    return ref
                wait = _POLL_S  # is_alive() turns False without a notify: poll it
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RequestTimeout(f"the engine did not come back within {timeout:.3g} s")
                    wait = min(wait, remaining)
                self._lock.wait(timeout=wait)

    @property
    def actor_ref(self) -> pykka.ActorRef[Any]:
        """The current ServerActor's ref; waits up to 60 s while a restart is under way.

        Raises:
            EngineStopped: no actor will come, or none came within 60 s.
        """
        try:
            return self.ref(_RESTART_WAIT_S)
        except RequestTimeout as e:
            raise EngineStopped(str(e)) from None

    def current(self) -> pykka.ActorRef[Any] | None:
        """The current ServerActor's ref if it is up, else None; never waits (any thread)."""
        with self._lock:
            if self._stopped is not None or self._gave_up is not None:
                return None
            ref = self._ref
        return ref if ref is not None and ref.is_alive() else None

    @property
    def gave_up(self) -> str | None:
        """Why the supervisor gave up, or None while it still restarts its engine."""
        return self._gave_up

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """``ActorRef.ask`` on the current actor (caller's thread).

        ``timeout`` bounds the wait for a restart under way, then the answer. A cancel
        is not worth waiting for: during a restart there is nothing to cancel.

        Raises:
            EngineStopped: no actor will come (see :meth:`ref`), or it died meanwhile.
            RequestTimeout: a restart did not finish within ``timeout``.
        """
        if isinstance(message, Cancel | CancelExact):
            ref = self.current()
            if ref is None:
                return None if block else _resolved(None)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            ref = self.ref(_RESTART_WAIT_S if timeout is None else timeout)
            if deadline is not None:
                timeout = max(deadline - time.monotonic(), 0.0)
            if isinstance(message, Drain):
                with self._lock:
                    self._draining = True
        try:
            return ref.ask(message, block=block, timeout=timeout)
        except pykka.ActorDeadError as e:
            reason = self._why_died(ref)  # its own reason (a load that failed), not pykka's
            raise EngineStopped(f"the engine died while handling the message: {reason or e}") from None

    def tell(self, message: Any) -> None:
        """``ActorRef.tell`` to the current actor (caller's thread); a cancel never waits."""
        if isinstance(message, Cancel | CancelExact):
            ref = self.current()
            if ref is not None:
                ref.tell(message)  # a dead actor has nothing to cancel
            return
        ref = self.actor_ref
        if isinstance(message, Drain):
            with self._lock:
                self._draining = True
        try:
            ref.tell(message)
        except pykka.ActorDeadError as e:
            raise EngineStopped(f"the engine died: {self._why_died(ref) or e}") from None

    def drain(self, message: Drain, timeout: float | None = None) -> int:
        """Drain the current actor, wait until it stopped, and return the unfinished count.

        Runs in the caller's thread. The wait watches the actor, so an actor stopped or
        crashed while draining ends it, and is bounded by ``timeout`` (when given) and
        by ``message.timeout`` plus a grace (a stuck tick never checks the drain's
        deadline). Once it returns, the supervisor counts as stopped.

        Raises:
            EngineStopped: no actor to drain, or it died without answering the drain.
            RequestTimeout: the drain did not end in time (the actor keeps draining).
        """
        bounds = [timeout, None if message.timeout is None else message.timeout + _DRAIN_GRACE_S]
        bound = min((b for b in bounds if b is not None), default=None)
        deadline = None if bound is None else time.monotonic() + bound
        with self._lock:
            self._draining = True
        ref = self.ref(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        answer = self._await_drain(ref, ref.ask(message, block=False), deadline, bound)
        # The actor stops right after it answers; wait for that and the monitor's verdict,
        # so that a caller sees the supervisor stopped once this returns.
        with self._lock:
            self._lock.wait_for(lambda: self._stopped is not None or self._gave_up is not None, _POLL_S * 4)
        return answer

    def _await_drain(
        self, ref: pykka.ActorRef[Any], future: Any, deadline: float | None, bound: float | None
    ) -> int:
        """Wait for the drain's answer while the actor lives, until ``deadline`` (caller's thread)."""
        while True:
            wait = _POLL_S if deadline is None else max(min(_POLL_S, deadline - time.monotonic()), 0.0)
            try:
                answer = future.get(timeout=wait)
            except pykka.Timeout:
                pass
            except pykka.ActorDeadError:
                raise EngineStopped("the engine stopped before it answered the drain") from None
            else:
                if not isinstance(answer, pykka.Future):
                    return int(answer)
                future = answer  # the ask's answer is the drain's own future
                continue
            if not ref.is_alive():
                try:  # it may have resolved the drain as it stopped
                    answer = future.get(timeout=_POLL_S)
                except (pykka.Timeout, pykka.ActorDeadError):
                    raise EngineStopped("the engine stopped while draining") from None
                if not isinstance(answer, pykka.Future):
                    return int(answer)
                future = answer
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeout(f"the drain did not end within {bound} s")

    def is_alive(self) -> bool:
        """True unless stopped, drained or given up (a restart in progress counts as alive)."""
        return self._stopped is None and self._gave_up is None

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the actor for good; no restart follows (caller's thread).

        With ``block``, returns once no actor of this supervisor is left running: a
        restart under way is abandoned, or the actor it started is stopped as well.
        """
        with self._lock:
            if self._stopped is None:
                self._stopped = "the supervisor was stopped"
            ref = self._ref
            self._lock.notify_all()  # wakes a monitor in its backoff
        if ref is not None:
            ref.stop(block=block, timeout=timeout)
        thread = self._monitor_thread
        if block and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- the monitor (its own thread) --------------------------------------------------

    def _monitor(self) -> None:
        """Wait for each actor to stop and restart it after a crash (monitor thread).

        Every decision is made under the lock against ``_stopped``, so a ``stop()`` at
        any point either finds the new actor in ``_ref`` and stops it, or is seen here
        before the new actor is kept.
        """
        assert self._ref is not None
        ref = self._ref
        while True:
            ref.actor_stopped.wait()
            reason = self._crash_reason(ref)
            backoff = self._decide(reason)
            if backoff is None:
                return
            _log.warning("engine crashed (%s); restarting in %.0f ms", reason, backoff * 1000)
            with self._lock:
                # Not time.sleep: stop() wakes this wait, and no restart follows.
                self._lock.wait_for(lambda: self._stopped is not None, timeout=backoff)
                if self._stopped is not None:
                    return
            try:
                new = ServerActor.start(self._options)
            except Exception as e:  # the options were fine once: the model went away
                with self._lock:
                    self._gave_up = f"the engine could not be restarted: {e!r}"
                    self._lock.notify_all()
                return
            with self._lock:
                stopped = self._stopped is not None
                if not stopped:
                    self._ref = new
                    self.restarts += 1
                    self._lock.notify_all()
            if stopped:  # stop() came while the new actor started: it must not outlive it
                new.stop(block=True)
                return
            if telemetry.server_restart.receivers:
                name = self._options.checked.name
                telemetry.emit(
                    telemetry.server_restart,
                    self,
                    {"restarts": self.restarts, "backoff_ms": backoff * 1000},
                    {"reason": reason} if name is None else {"reason": reason, "replica": name},
                )
            ref = new

    def _crash_reason(self, ref: pykka.ActorRef[Any]) -> str | None:
        """Why the stopped actor crashed, or None if it was stopped on purpose (monitor thread)."""
        reason = self._take_reason(ref)
        t_give_up = time.monotonic() + _CRASH_REASON_GRACE_S
        # A drain ends in a stop, or is ended by a crash: either way it is final.
        while reason is None and not self._draining and self._stopped is None:
            if time.monotonic() >= t_give_up:
                return None
            time.sleep(0.01)
            reason = self._take_reason(ref)
        return reason

    def _take_reason(self, ref: pykka.ActorRef[Any]) -> str | None:
        """The actor's crash record, kept here before it is taken: an ``ask`` that found
        the actor dead names the reason whichever thread reads it first."""
        reason = why_died(ref.actor_urn)
        if reason is not None:
            self._last_crash = (ref.actor_urn, reason)
            crash_reason(ref.actor_urn)
        return reason

    def _why_died(self, ref: pykka.ActorRef[Any]) -> str | None:
        """Why ``ref``'s actor died, if it said (any thread)."""
        urn, reason = self._last_crash
        return why_died(ref.actor_urn) or (reason if urn == ref.actor_urn else None)

    def _decide(self, reason: str | None) -> float | None:
        """After the actor stopped: the backoff before a restart, or None for none (monitor thread)."""
        with self._lock:
            if self._stopped is not None:
                return None
            if reason is None or self._draining:
                # Stopped on purpose (a drain that completed, ref.stop()), or crashed while
                # draining: nobody wants it back.
                self._stopped = ("the engine was drained" if self._draining else "the engine was stopped") + (
                    f" (it crashed while draining: {reason})" if reason is not None else ""
                )
                self._lock.notify_all()
                return None
            if reason.startswith("loading"):
                # The model (or its draft) could not load: it would fail again. The
                # reason goes to whoever asks next, said once, not logged here too.
                self._gave_up = f"the engine could not load its model, so it is not restarted ({reason})"
                self._lock.notify_all()
                return None
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
                return None
            self._restarts.append(now)
            return min(_FIRST_BACKOFF_S * 2.0 ** (len(self._restarts) - 1), _MAX_BACKOFF_S)


def _resolved(value: Any) -> pykka.ThreadingFuture[Any]:
    future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
    future.set(value)
    return future
