"""The ``"ray"`` backend of ``ServerPool``: each replica a Ray actor hosting a ServerActor.

Ray places each replica (``scheduling_strategy="SPREAD"`` by default) on a node of the
cluster this process is connected to, in its own worker process, so each replica's
llama.cpp threads are alone in their process. Ray restarts a replica whose process died
(``max_restarts``); calls are never retried (``max_task_retries=0``): a request in flight
on a dead replica fails, naming it.

Everything a replica sends back travels on one Ray streaming generator per replica, its
*outbox*: the stream events of every request it runs (its streams' ``reply_to`` puts
there) and the payload of every signal it emits, in batches of what queued up since the
last one (about one batch per tick under load, instead of one Ray object per token). One
driver thread per replica puts each event on its caller's ``reply_to`` and emits each
signal again here, where ``metadata["replica"]`` names the replica. When the outbox
breaks because the replica died, every stream it ran fails at once, naming it.

A replica is down from the moment a call finds it dead until a ``ready`` call returns
once Ray has restarted it and its model is loaded. Ray answers calls to an actor it is
still restarting with ``ActorUnavailableError``; the call is then repeated with growing
pauses (up to ``_MAX_RETRY_S``), for as long as Ray keeps restarting. ``ActorDiedError``
(out of restarts) leaves the replica down for good.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

import telemetry
from actors.contract import (
    AskedMessage,
    Done,
    EngineError,
    EngineStopped,
    Failed,
    GetTokenizer,
    Progress,
    QueueFull,
    RequestTimeout,
    StreamMessage,
    Token,
)
from actors.engine import courier
from actors.scale._ray_worker import ReplicaActor
from actors.scale._replica import Relay, ReplicaDown, Tracked

__all__ = ["start_ray_replicas"]

_log = logging.getLogger("llama_cpp_actors.pool.ray")

_STOP_WAIT_S = 10.0  # how long stop() waits for a replica's outbox reader to see it die
_MAX_RETRY_S = 2.0  # the longest pause between ``ready`` calls to a restarting replica


class _Unreachable:
    """The ``reply_to`` a stream carries over the wire; the replica puts its own."""

    def put(self, event: object) -> None:
        raise RuntimeError("a stream's reply_to does not cross processes")


class RemoteTokenizer:
    """A pool's tokenizer on Ray: each call is a round trip to a replica."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ray.get(self._actor.tokenize.remote(text, add_special, parse_special))  # type: ignore[no-any-return]

    def detokenize(self, ids: list[int]) -> str:
        return ray.get(self._actor.detokenize.remote(list(ids)))  # type: ignore[no-any-return]


class RayReplica:
    """The driver's handle on one Ray replica (callers' threads and relay threads)."""

    def __init__(self, name: str, actor: Any, node_id: str) -> None:
        self.name = name
        self.actor = actor
        self.node_id = node_id
        self.on_down: Callable[[str], None] | None = None
        self._lock = threading.RLock()  # _open_outbox runs under it and _spawn takes it
        self._down: str | None = None
        self._stopped = False
        self._streams: dict[str, Relay] = {}
        self._threads: list[threading.Thread] = []
        self._open_outbox()

    # -- health ----------------------------------------------------------------------

    def up(self) -> bool:
        return self._down is None and not self._stopped

    def gave_up(self) -> str | None:
        # Ray restarts a dead replica's process itself: only a stop is final.
        return "the pool was stopped" if self._stopped else None

    def _died(self, error: BaseException) -> None:
        """The outbox broke: the replica died. Only the outbox reader calls this (a call's
        own Ray error may be transient), so one reader at a time ever runs. Marks the
        replica down and fails every stream it ran, in one step under the lock, so a
        stream is either failed here or refused by ``send``; then waits for Ray's restart.
        """
        reason = f"replica {self.name!r} died: {type(error).__name__}: {error}"
        with self._lock:
            stopped = self._stopped
            self._down = "the pool was stopped" if stopped else reason
            streams, self._streams = self._streams, {}
        failure = EngineStopped("the pool was stopped" if stopped else reason)
        for request_id, relay in streams.items():
            with contextlib.suppress(Exception):  # its consumer is gone too
                courier.send(relay, Failed(request_id, failure))
        if stopped:
            return
        _log.warning("%s", reason)
        if self.on_down is not None:
            self.on_down(self.name)
        self._spawn(self._await_restart, "restart")

    def _await_restart(self) -> None:
        pause = 0.1
        while not self._stopped:
            try:
                self.node_id, _pid = ray.get(self.actor.ready.remote())
                break
            except ActorUnavailableError:  # still restarting (e.g. waiting for a node)
                time.sleep(pause)
                pause = min(pause * 2, _MAX_RETRY_S)
            except Exception as e:  # out of restarts, or the cluster is gone
                if not self._stopped:
                    _log.error("replica %s is gone for good: %r", self.name, e)
                return
        with self._lock:
            if self._stopped:
                return
            self._down = None
            self._open_outbox()  # under the lock: stop() joins it
        _log.info("replica %s is back on node %s", self.name, self.node_id)

    # -- requests --------------------------------------------------------------------

    def _engine_error(self, error: BaseException) -> EngineError:
        """What a caller sees of a failed Ray call: the engine's own error when the replica
        raised one, else ``EngineStopped`` naming the replica. A dead actor is only
        reported here; the outbox reader is the one that marks the replica down."""
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, EngineError):
            return cause
        if isinstance(error, RayActorError):
            return EngineStopped(f"replica {self.name!r} died: {type(error).__name__}: {error}")
        return EngineStopped(f"replica {self.name!r} failed: {error!r}")

    def submit(self, message: AskedMessage, future: Tracked, timeout: float | None) -> None:
        # Admission is a Ray call answered later (``settle``): nothing here waits, and the
        # caller's wait on ``future`` is bounded by the caller.
        if not self.up():
            raise ReplicaDown(self.name)
        result: concurrent.futures.Future[Any] = self.actor.submit.remote(message).future()

        def settle(done: concurrent.futures.Future[Any]) -> None:
            error = done.exception()
            if error is None:
                future.set(done.result())
            else:
                cause = self._engine_error(error)
                if isinstance(cause, QueueFull) and future.on_full is not None and future.on_full():
                    return  # another replica took it
                future.set_exception(exc_info=(type(cause), cause, None))

        result.add_done_callback(settle)

    def send(self, message: StreamMessage) -> None:
        relay = message.reply_to
        assert isinstance(relay, Relay)
        request_id = message.request_id
        with self._lock:  # checked and registered together: _died cannot slip in between
            if self._down is not None or self._stopped:
                raise ReplicaDown(self.name)
            self._streams[request_id] = relay  # before admission: no event can miss it
        admitted = self.actor.admit.remote(dataclasses.replace(message, reply_to=_Unreachable()))

        def check(done: concurrent.futures.Future[Any]) -> None:
            # The admit call itself failed (the actor died under it, or raised): its
            # events will never come, so fail it here unless the outbox did already.
            error = done.exception()
            if error is not None:
                self._deliver(Failed(request_id, self._engine_error(error)))

        admitted.future().add_done_callback(check)

    def cancel(self, request_id: str, message: object | None = None) -> None:
        # The replica admits a copy of the message, never the same object: the pool
        # checked ``message`` against what it tracks, and a plain Cancel goes.
        if self.up():
            self.actor.cancel.remote(request_id)

    def call(self, message: Any, timeout: float | None) -> Any:
        if not self.up():
            raise ReplicaDown(self.name)
        if isinstance(message, GetTokenizer):
            return RemoteTokenizer(self.actor)
        try:
            return ray.get(self.actor.call.remote(message), timeout=timeout)
        except RayActorError:  # the outbox reader marks it down
            raise ReplicaDown(self.name) from None
        except RayTaskError as e:
            raise self._engine_error(e) from None
        except GetTimeoutError:
            raise RequestTimeout(f"replica {self.name!r} did not answer within {timeout} s") from None

    def stop(self) -> None:
        """Kill the replica for good and wait for this handle's threads: a Ray call made
        after the caller's ``ray.shutdown()`` would start Ray again in this process."""
        with self._lock:
            self._stopped = True
        ray.kill(self.actor, no_restart=True)  # the outbox reader then fails what ran there
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=_STOP_WAIT_S)

    # -- the outbox (one thread per replica) --------------------------------------------

    def _open_outbox(self) -> None:
        generator = self.actor.outbox.options(num_returns="streaming").remote()
        self._spawn(lambda: self._read_outbox(generator), "outbox")

    def _spawn(self, target: Callable[[], None], role: str) -> None:
        thread = threading.Thread(target=target, name=f"{self.name}-{role}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _read_outbox(self, generator: Any) -> None:
        try:
            for item in generator:
                for entry in ray.get(item):
                    if entry[0] == "event":
                        self._deliver(entry[1])
                    else:
                        _, signal_name, measurements, metadata = entry
                        signal = getattr(telemetry, signal_name)
                        if signal.receivers:
                            telemetry.emit(signal, self, measurements, metadata)
        except Exception as e:  # the replica died (RayActorError), or the cluster went away
            self._died(e)
            return
        self._died(EngineStopped("the outbox ended"))  # a generator that ends: the actor is gone

    def _deliver(self, event: Progress | Token | Done | Failed) -> None:
        with self._lock:
            relay = self._streams.get(event.request_id)
            if relay is not None and isinstance(event, Done | Failed):
                relay.ends_seen += 1
                if relay.ends_seen == relay.n:  # each of its n choices has ended
                    del self._streams[event.request_id]
        if relay is None:  # abandoned (its consumer failed) or from before a restart
            return
        # Through the courier, as the engine delivers: a full queue holds the event (this
        # thread serves every stream of the replica and must never wait on one consumer).
        if not courier.send(relay, event, functools.partial(self.cancel, event.request_id)):
            _log.warning("stream %s on %s: its consumer is gone; cancelling", event.request_id, self.name)
            with self._lock:
                self._streams.pop(event.request_id, None)
            self.cancel(event.request_id)


def start_ray_replicas(
    names: list[str],
    max_restarts: int,
    max_seconds: float,
    actor_options: dict[str, Any] | None,
    server_options: dict[str, Any],
) -> list[RayReplica]:
    """Start one Ray actor per name and wait until each engine is up.

    ``server_options`` are checked here first (a ServerActor's checks run in
    ``__init__``, before any model loads), so a bad option raises in the caller.
    """
    from actors.actor import ServerActor

    ServerActor(**server_options)  # checks only: nothing loads until on_start
    if not ray.is_initialized():
        ray.init()
    options: dict[str, Any] = {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_concurrency": 1024}
    options.update(actor_options or {})
    options["max_restarts"] = max_restarts
    options["max_task_retries"] = 0
    cls = ray.remote(ReplicaActor)
    actors: list[Any] = [
        cls.options(**options).remote(name, server_options, max_restarts, max_seconds) for name in names
    ]
    try:
        placed = ray.get([a.ready.remote() for a in actors])
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return [
        RayReplica(name, actor, node) for name, actor, (node, _pid) in zip(names, actors, placed, strict=True)
    ]
