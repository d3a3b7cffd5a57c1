"""The worker side of the ``"ray"`` backend: ``ReplicaActor`` runs in a replica's Ray
worker process, a supervised ServerActor whose stream events and signals leave through
one outbox (see :mod:`actors.scale._ray`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

import ray

import telemetry
from actors.backend import Tokenizer
from actors.contract import (
    AskedMessage,
    Cancel,
    Done,
    Drain,
    EngineError,
    EngineStopped,
    Failed,
    GetInfo,
    GetTokenizer,
    Progress,
    StreamMessage,
    Token,
)

__all__ = ["ReplicaActor"]

_log = logging.getLogger("llama_cpp_actors.pool.ray")

_SIGNALS = (
    "tick", "request_start", "request_done", "request_exception",
    "kv_pressure", "ram_cache", "model_load", "server_restart",
)  # fmt: skip
_MAX_BATCH = 256  # events per streamed item
_TELEMETRY_BUFFER = 100_000  # payloads a replica holds for a slow driver, then drops


def _drain_into(first: Any, q: queue.Queue[Any]) -> list[Any]:
    batch = [first]
    while len(batch) < _MAX_BATCH:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
    return batch


class _Outbox:
    """The ``reply_to`` of every stream a replica runs (engine thread): into the outbox."""

    def __init__(self, q: queue.Queue[Any]) -> None:
        self._q = q

    def put(self, event: Progress | Token | Done | Failed) -> None:
        self._q.put(("event", event))


def _normal_priority(name: str) -> None:
    """Undo Ray's worker niceness (15 by default, ``RAY_worker_niceness``) for this thread
    and the threads it starts (the engine's, then llama.cpp's): at niceness 15 they yield
    the cores to every other process on the node, and each llama.cpp OpenMP barrier waits
    for the slowest thread. Lowering niceness needs privilege; without it, warn."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        _log.warning(
            "%s runs at niceness %d and may not lower it: start Ray with RAY_worker_niceness=0",
            name,
            os.getpriority(os.PRIO_PROCESS, 0),
        )


class ReplicaActor:
    """Runs in the replica's Ray worker process: a supervised ServerActor and its outbox.

    A crash of the engine inside a live process restarts it here (a ``Supervisor``, as
    the local backend does); a dead process is Ray's to restart.

    Ray calls its methods from its own thread pool (``max_concurrency``); ``outbox``
    holds one of those threads for the replica's life, each ``submit`` one while its
    request runs.
    """

    def __init__(self, name: str, options: dict[str, Any], max_restarts: int, max_seconds: float) -> None:
        from actors.actor import Supervisor

        self.name = name
        _normal_priority(name)
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._reply_to = _Outbox(self._outbox)
        self.dropped_signals = 0
        self._relays = telemetry.Subscription({getattr(telemetry, n): self._relay(n) for n in _SIGNALS})
        self.ref = Supervisor.start(max_restarts=max_restarts, max_seconds=max_seconds, name=name, **options)

    def _relay(self, signal_name: str) -> Callable[..., None]:
        def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
            if self._outbox.qsize() > _TELEMETRY_BUFFER:  # a stalled driver: drop signals, never events
                self.dropped_signals += 1
            else:
                self._outbox.put(("signal", signal_name, measurements, metadata))

        return receive

    def ready(self) -> tuple[str, str]:
        """``(node id, pid)`` once the engine is up (its model loaded)."""
        self.ref.ask(GetInfo())  # answered after on_start: the model is loaded
        return ray.get_runtime_context().get_node_id(), str(os.getpid())

    def _exit_if_given_up(self) -> None:
        """The supervisor here gave up on the engine: end this process, so Ray restarts
        the replica (within its ``max_restarts``) and the driver sees it die."""
        if self.ref.gave_up is not None:
            _log.error("%s: %s; exiting so that Ray restarts the replica", self.name, self.ref.gave_up)
            os._exit(70)

    def submit(self, message: AskedMessage) -> Any:
        """The Completion of a Generate/GenerateTokens/Chat, the Embeddings of an Embed
        (admission errors raise)."""
        try:
            return self.ref.ask(message).get()
        except EngineStopped:
            self._exit_if_given_up()
            raise

    def admit(self, message: StreamMessage) -> None:
        """Admit a stream; its events (an admission error too) go to the outbox."""
        try:
            self.ref.tell(dataclasses.replace(message, reply_to=self._reply_to))
        except Exception as e:  # the engine is gone (the supervisor gave up): say so
            error = e if isinstance(e, EngineError) else EngineStopped(f"{self.name}: {e!r}")
            self._reply_to.put(Failed(message.request_id, error))
            self._exit_if_given_up()

    def cancel(self, request_id: str) -> None:
        self.ref.tell(Cancel(request_id))

    def call(self, message: Any) -> Any:
        if isinstance(message, Drain):  # watches the engine: one that dies while draining ends it
            return self.ref.drain(message)
        return self.ref.ask(message)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._tokenizer().tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self._tokenizer().detokenize(ids)

    def _tokenizer(self) -> Tokenizer:
        tokenizer = self.ref.ask(GetTokenizer())
        assert isinstance(tokenizer, Tokenizer)
        return tokenizer

    def outbox(self) -> Iterator[list[Any]]:
        """Stream events and signals, in batches, for as long as the replica lives."""
        while True:
            yield _drain_into(self._outbox.get(), self._outbox)
