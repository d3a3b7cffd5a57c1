"""The ``"ray"`` backend of ``ServerPool``: each replica a Ray actor hosting a ServerActor.

Ray places each replica (``scheduling_strategy="SPREAD"`` by default) on a node of the
cluster this process is connected to, in its own worker process, so each replica's
llama.cpp threads are alone in their process. Ray restarts a replica whose process died
(``max_restarts``); calls are never retried (``max_task_retries=0``): a request in flight
on a dead replica fails, naming it.

Streams use Ray's streaming generators: the replica yields batches of events as they
come (every event queued since the last batch), and one driver thread per stream puts
them on the caller's ``reply_to``. Telemetry travels the same way: each replica
subscribes to every signal and streams the payloads; a driver thread per replica emits
them again here, where ``metadata["replica"]`` names the replica.

A replica is down from the moment a call finds it dead until a ``ready`` call returns
(Ray holds calls to a restarting actor until it is back, so this is one wait, not a
poll).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

import telemetry
from actors._errors import EngineError, EngineStopped
from actors._messages import Cancel, Drain, GetTokenizer
from actors._pool import Relay, ReplicaDown, StreamMessage, SubmitMessage, Tracked
from actors._results import Done, Failed, Token
from actors._tokenizer import Tokenizer

__all__ = ["start_ray_replicas"]

_log = logging.getLogger("llama_cpp_actors.pool.ray")

_SIGNALS = (
    "tick", "request_start", "request_done", "request_exception",
    "kv_pressure", "ram_cache", "model_load", "server_restart",
)  # fmt: skip
_MAX_BATCH = 256  # events per streamed item
_TELEMETRY_BUFFER = 100_000  # payloads a replica holds for a slow driver, then drops


class _Unreachable:
    """The ``reply_to`` a stream carries over the wire; the replica puts its own."""

    def put(self, event: object) -> None:
        raise RuntimeError("a stream's reply_to does not cross processes")


def _drain_into(first: Any, q: queue.Queue[Any]) -> list[Any]:
    batch = [first]
    while len(batch) < _MAX_BATCH:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
    return batch


class ReplicaActor:
    """Runs in the replica's Ray worker process: a ServerActor and a telemetry relay.

    Ray calls its methods from its own thread pool (``max_concurrency``); each stream
    holds one of those threads while it runs.
    """

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        from actors._server import ServerActor

        self.name = name
        self.telemetry: queue.Queue[tuple[str, dict[str, Any], dict[str, Any]]] = queue.Queue(
            _TELEMETRY_BUFFER
        )
        self.dropped = 0
        self._receivers = []
        for signal_name in _SIGNALS:
            receiver = self._relay(signal_name)
            getattr(telemetry, signal_name).connect(receiver, weak=False)
            self._receivers.append(receiver)
        self.ref = ServerActor.start(name=name, **options)

    def _relay(self, signal_name: str) -> Callable[..., None]:
        def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
            try:
                self.telemetry.put_nowait((signal_name, measurements, metadata))
            except queue.Full:
                self.dropped += 1

        return receive

    def ready(self) -> tuple[str, str]:
        """``(node id, pid)`` once the engine is up."""
        import os

        return ray.get_runtime_context().get_node_id(), str(os.getpid())

    def submit(self, message: SubmitMessage) -> Any:
        """The Completion of a Generate/GenerateTokens/Chat (admission errors raise)."""
        return self.ref.ask(message).get()

    def stream(self, message: StreamMessage) -> Iterator[list[Token | Done | Failed]]:
        """Admit a stream here and yield its events in batches until Done or Failed."""
        events: queue.Queue[Token | Done | Failed] = queue.Queue()
        self.ref.tell(dataclasses.replace(message, reply_to=events))
        while True:
            batch = _drain_into(events.get(), events)
            yield batch
            if not isinstance(batch[-1], Token):
                return

    def cancel(self, request_id: str) -> None:
        self.ref.tell(Cancel(request_id))

    def call(self, message: Any) -> Any:
        answer = self.ref.ask(message)
        return answer.get() if isinstance(message, Drain) else answer

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tokenizer = self._tokenizer()
        return tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer().detokenize(ids)

    def _tokenizer(self) -> Tokenizer:
        tokenizer = self.ref.ask(GetTokenizer())
        assert isinstance(tokenizer, Tokenizer)
        return tokenizer

    def telemetry_stream(self) -> Iterator[list[tuple[str, dict[str, Any], dict[str, Any]]]]:
        """Every signal this replica emits, in batches, for as long as it lives."""
        while True:
            yield _drain_into(self.telemetry.get(), self.telemetry)


class RemoteTokenizer:
    """A pool's tokenizer on Ray: each call is a round trip to a replica."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ray.get(self._actor.tokenize.remote(text, add_special, parse_special))  # type: ignore[no-any-return]

    def detokenize(self, ids: list[int]) -> str:
        return ray.get(self._actor.detokenize.remote(list(ids)))  # type: ignore[no-any-return]


def _cause(error: BaseException) -> BaseException:
    """The engine's own error inside a Ray task error."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error


class RayReplica:
    """The driver's handle on one Ray replica (callers' threads and relay threads)."""

    def __init__(self, name: str, actor: Any, node_id: str) -> None:
        self.name = name
        self.actor = actor
        self.node_id = node_id
        self.on_down: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._down: str | None = None
        self._stopped = False
        self._relay_telemetry()

    # -- health ----------------------------------------------------------------------

    def up(self) -> bool:
        return self._down is None and not self._stopped

    def _died(self, error: BaseException) -> EngineStopped:
        """Mark down (once), wait for Ray's restart in a thread; the error to report."""
        reason = f"replica {self.name!r} died: {type(error).__name__}: {error}"
        with self._lock:
            first = self._down is None and not self._stopped
            if first:
                self._down = reason
        if first:
            _log.warning("%s", reason)
            if self.on_down is not None:
                self.on_down(self.name)
            threading.Thread(target=self._await_restart, name=f"{self.name}-restart", daemon=True).start()
        return EngineStopped(reason)

    def _await_restart(self) -> None:
        try:
            self.node_id, _pid = ray.get(self.actor.ready.remote())
        except Exception as e:  # out of restarts, or the cluster is gone
            if not self._stopped:
                _log.error("replica %s is gone for good: %r", self.name, e)
            return
        with self._lock:
            self._down = None
        _log.info("replica %s is back on node %s", self.name, self.node_id)
        self._relay_telemetry()

    # -- requests --------------------------------------------------------------------

    def submit(self, message: SubmitMessage, future: Tracked) -> None:
        if not self.up():
            raise ReplicaDown(self.name)
        result: concurrent.futures.Future[Any] = self.actor.submit.remote(message).future()

        def settle(done: concurrent.futures.Future[Any]) -> None:
            error = done.exception()
            if error is None:
                future.set(done.result())
            else:
                cause = _cause(error)
                if isinstance(error, RayActorError):
                    cause = self._died(error)
                elif not isinstance(cause, EngineError):
                    cause = EngineStopped(f"replica {self.name!r} failed: {error!r}")
                future.set_exception(exc_info=(type(cause), cause, None))

        result.add_done_callback(settle)

    def send(self, message: StreamMessage) -> None:
        if not self.up():
            raise ReplicaDown(self.name)
        relay = message.reply_to
        assert isinstance(relay, Relay)
        wire = dataclasses.replace(message, reply_to=_Unreachable())
        generator = self.actor.stream.options(num_returns="streaming").remote(wire)
        threading.Thread(
            target=self._pump,
            args=(generator, relay, message.request_id),
            name=f"{self.name}-stream",
            daemon=True,
        ).start()

    def _pump(self, generator: Any, relay: Relay, request_id: str) -> None:
        finished = False
        try:
            for item in generator:
                for event in ray.get(item):
                    relay.put(event)
                    finished = not isinstance(event, Token)
        except RayActorError as e:
            relay.put(Failed(request_id, self._died(e)))
            return
        except Exception as e:  # the consumer's reply_to raised, or Ray failed the call
            _log.warning("stream %s on %s ended: %r", request_id, self.name, e)
            if finished:
                return
            with_cause = _cause(e)
            error = with_cause if isinstance(with_cause, EngineError) else EngineStopped(repr(e))
            try:
                relay.put(Failed(request_id, error))
            except Exception:
                self.cancel(request_id)
            return
        if not finished:  # the generator ended without an outcome: never leave a caller waiting
            relay.put(Failed(request_id, EngineStopped(f"replica {self.name!r} ended the stream early")))

    def cancel(self, request_id: str) -> None:
        if self.up():
            self.actor.cancel.remote(request_id)

    def call(self, message: Any, timeout: float | None) -> Any:
        if not self.up():
            raise ReplicaDown(self.name)
        if isinstance(message, GetTokenizer):
            return RemoteTokenizer(self.actor)
        try:
            return ray.get(self.actor.call.remote(message), timeout=timeout)
        except RayActorError as e:
            self._died(e)
            raise ReplicaDown(self.name) from None
        except RayTaskError as e:
            raise _cause(e) from None

    def stop(self) -> None:
        self._stopped = True
        ray.kill(self.actor, no_restart=True)

    # -- telemetry -------------------------------------------------------------------

    def _relay_telemetry(self) -> None:
        generator = self.actor.telemetry_stream.options(num_returns="streaming").remote()
        threading.Thread(
            target=self._emit_telemetry, args=(generator,), name=f"{self.name}-telemetry", daemon=True
        ).start()

    def _emit_telemetry(self, generator: Any) -> None:
        try:
            for item in generator:
                for signal_name, measurements, metadata in ray.get(item):
                    signal = getattr(telemetry, signal_name)
                    if signal.receivers:
                        telemetry.emit(signal, self, measurements, metadata)
        except RayActorError as e:
            if not self._stopped:
                self._died(e)
        except Exception:
            if not self._stopped:
                _log.exception("telemetry relay of %s failed", self.name)


def start_ray_replicas(
    names: list[str],
    max_restarts: int,
    actor_options: dict[str, Any] | None,
    server_options: dict[str, Any],
) -> list[RayReplica]:
    """Start one Ray actor per name and wait until each engine is up.

    ``server_options`` are checked here first (a ServerActor's checks run in
    ``__init__``, before any model loads), so a bad option raises in the caller.
    """
    from actors._server import ServerActor

    ServerActor(**server_options)  # checks only: nothing loads until on_start
    if not ray.is_initialized():
        ray.init()
    options: dict[str, Any] = {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_concurrency": 1024}
    options.update(actor_options or {})
    options["max_restarts"] = max_restarts
    options["max_task_retries"] = 0
    cls = ray.remote(ReplicaActor)
    actors: list[Any] = [cls.options(**options).remote(name, server_options) for name in names]
    try:
        placed = ray.get([a.ready.remote() for a in actors])
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return [
        RayReplica(name, actor, node) for name, actor, (node, _pid) in zip(names, actors, placed, strict=True)
    ]
