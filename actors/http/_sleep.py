"""``--sleep-idle-seconds``: the model is unloaded after that long without a request, and
loaded again by the next one, as llama-server's sleeping state.

The app's gate calls :meth:`Sleeper.enter` for every request that needs the model and
:meth:`Sleeper.leave` once its response has ended; a request that arrives while the
model sleeps waits for it to load again (the load is shared by every request waiting),
and fails only if that load fails. ``/health``, ``/props``, ``/models`` and
``/metrics`` neither need it nor wake it (:data:`PASSIVE`): they answer from what the
server read at the last load (the metrics' engine gauges from the stats of that
moment), and ``/props`` says ``is_sleeping``. Nor do the resumable streams'
``/v1/stream`` and ``/v1/streams/lookup``, which serve what was kept.

The watch runs on the event loop: every quarter of the idle time (at most 0.25 s) it
puts the engine to sleep once no request has needed it for ``seconds``. Going to sleep
stops the engine (the Supervisor, or the pool) in a worker thread, which frees the
model and its context; waking starts it again through the service's own ``load``.
One model only: a router unloads idle models by their keep-alive (``ModelManager``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from actors import GetStats
from actors.http._errors import HttpError

__all__ = ["PASSIVE", "Sleeper"]

_log = logging.getLogger("llama_cpp_actors.http")

PASSIVE = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics"})
"""Paths whose ``GET`` (and ``HEAD``) answers without the model and is no activity."""
_STREAMS = frozenset({"/v1/stream", "/v1/streams/lookup"})
"""Paths that read or stop resumable streams, with any method: what they serve is kept
(a live stream's producer holds the model awake itself), so they never wake it."""
_STOP_TIMEOUT_S = 30.0
_MAX_POLL_S = 0.25


class Loadable(Protocol):
    """What the sleeper needs of the service (``actors.http._service.Service``)."""

    engine: Any
    tokenizer: Any
    stats: dict[str, Any]
    load_error: BaseException | None

    def load(self) -> None:
        """Start the engine and read its metadata (a worker thread)."""
        ...


class Sleeper:
    """The model's sleeping state (event loop; see the module).

    Args:
        service: the service whose engine sleeps.
        seconds: how long without a request puts it to sleep.
    """

    def __init__(self, service: Loadable, seconds: float) -> None:
        self.service = service
        self.seconds = seconds
        self.sleeping = False
        self.n_sleeps = 0
        self._active = 0  # requests that need the model, in flight
        self._t_idle = time.monotonic()
        self._turn = asyncio.Lock()  # one going to sleep or waking at a time
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (once the model has loaded)."""
        self._t_idle = time.monotonic()
        self._watch = asyncio.create_task(self._run(), name="llama-cpp-actors-sleep")

    def stop(self) -> None:
        """Stop watching (the server shuts down)."""
        if self._watch is not None:
            self._watch.cancel()

    @staticmethod
    def wakes(method: str, path: str) -> bool:
        """Whether a request needs the model (and so counts as activity)."""
        return not ((method in ("GET", "HEAD") and path in PASSIVE) or path in _STREAMS)

    async def enter(self) -> None:
        """A request that needs the model begins: wake it first if it sleeps.

        Raises:
            HttpError: 503, the model failed to load again.
        """
        self._active += 1
        if not self.sleeping:
            return
        try:
            async with self._turn:
                if self.sleeping:
                    await self._wake()
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        """A request that needed the model has ended (its last byte sent)."""
        self._active -= 1
        self._t_idle = time.monotonic()

    async def _wake(self) -> None:
        service = self.service
        t0 = time.monotonic()
        service.load_error = None
        await asyncio.to_thread(service.load)
        if service.load_error is not None:
            error = service.load_error
            service.engine = None
            _log.error("the model failed to load again after sleeping: %s", error)
            raise HttpError(503, f"the model failed to load again after sleeping: {error}")
        self.sleeping = False
        self._t_idle = time.monotonic()
        _log.info("the model woke up (loaded in %.1f s)", time.monotonic() - t0)

    async def _run(self) -> None:
        period = min(self.seconds / 4, _MAX_POLL_S)
        while True:
            await asyncio.sleep(period)
            if self.sleeping or self._active or time.monotonic() - self._t_idle < self.seconds:
                continue
            async with self._turn:
                if self.sleeping or self._active or time.monotonic() - self._t_idle < self.seconds:
                    continue
                await self._sleep()

    async def _sleep(self) -> None:
        service = self.service
        self.sleeping = True  # from here /metrics and /health answer without the engine
        self.n_sleeps += 1
        engine, service.engine, service.tokenizer = service.engine, None, None
        try:  # what /metrics reports while the model sleeps
            service.stats = dict(await asyncio.to_thread(engine.ask, GetStats(), timeout=_STOP_TIMEOUT_S))
        except Exception as e:
            _log.warning("reading the engine's stats before it sleeps: %s", e)
        stop = getattr(engine, "stop", None)
        if stop is not None:
            try:
                await asyncio.to_thread(stop, timeout=_STOP_TIMEOUT_S)
            except Exception as e:  # it is dropped either way: a fresh one wakes
                _log.warning("stopping the engine to sleep: %s", e)
        _log.info("the model went to sleep after %g s without a request", self.seconds)
