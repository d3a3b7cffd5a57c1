"""``ServerPool``: N engines behind one handle, routed by prefix affinity then load.

The pool answers the messages a ServerActor answers and works with every helper
(``generate(pool, ...)``, ``astream(pool, ...)``). Each request goes to one replica,
chosen by :class:`actors.scale._router.Router`; the pool tracks each request until it ends,
so it knows every replica's load and where to send a ``Cancel``.

Backends:

- ``"local"``: each replica is a ``Supervisor`` around a ServerActor in this process
  (its own thread and model). Mostly for tests, and for several small models on a big
  machine; llama.cpp's OpenMP threads of several engines in one process compete (see
  docs/benchmarks/index.md), so ``n_threads=1`` suits it.
- ``"ray"``: each replica is a Ray actor hosting a ServerActor in its own process, on
  any node of the Ray cluster (see :mod:`actors.scale._ray`).

Every method runs in the caller's thread. Requests end in replica threads (the engine
thread, or a Ray replica's outbox reader), which tell the router through ``Tracked``/``Relay``
(:mod:`actors.scale._replica`).

A stream reaches its replica as a copy of the caller's message (its ``reply_to`` a
``Relay``), so the pool remembers, per request in flight, the caller's message and the
one it sent: a ``CancelExact`` naming the caller's message becomes one naming the
message the replica admitted, and a late one for an older request that reused the id
cancels nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pykka

from actors.actor import ServerOptions
from actors.contract import (
    STREAMING,
    AdmittedMessage,
    AskedMessage,
    Cancel,
    CancelExact,
    ConfigError,
    Drain,
    EngineStopped,
    EraseSlot,
    GetInfo,
    GetLora,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    QueueFull,
    RestoreSlot,
    SaveSlot,
    SetLora,
    StreamMessage,
    Submit,
)
from actors.scale._checks import replica_names
from actors.scale._pool_queries import drain_replicas, pool_stats
from actors.scale._replica import LocalReplica, Relay, Replica, ReplicaDown, Tracked, forwarding
from actors.scale._router import Router

__all__ = ["ServerPool"]

_log = logging.getLogger("llama_cpp_actors.pool")


@dataclasses.dataclass(slots=True, eq=False)
class _Sent:
    """A request in flight: the caller's message, and the one a replica admits."""

    message: AdmittedMessage
    sent: AdmittedMessage


class ServerPool:
    """N engines with the same options behind one handle. Start it with :meth:`start`."""

    def __init__(self, replicas: list[Replica], router: Router) -> None:
        self._replicas = {r.name: r for r in replicas}
        self.router = router
        self._stopped = False
        self._lock = threading.Lock()
        self._sent: dict[str, _Sent] = {}  # by request_id, while in flight

    @classmethod
    def start(
        cls,
        replicas: int = 2,
        backend: str = "local",
        *,
        max_restarts: int = 3,
        max_seconds: float = 5.0,
        ray_actor_options: dict[str, Any] | None = None,
        affinity_min_blocks: int = 8,
        affinity_slack: int | None = None,
        name: str | None = None,
        **server_options: Any,
    ) -> ServerPool:
        """Start ``replicas`` engines with ``server_options`` (``ServerActor.start``'s).

        Args:
            replicas: how many engines.
            backend: ``"local"`` (ServerActors in this process) or ``"ray"`` (Ray actors
                in their own processes, on the Ray cluster this process is connected to;
                ``ray.init()`` is called if it was not).
            max_restarts: a replica's engine that crashes is restarted at most this many
                times within ``max_seconds`` (a Supervisor, in its process); on Ray, a
                replica whose process died is restarted by Ray, at most this many times
                in all.
            max_seconds: the window, in seconds, in which a Supervisor counts ``max_restarts``.
            ray_actor_options: passed to Ray's ``.options()`` for each replica
                (default ``{"num_cpus": 1}``, spread over the nodes).
            affinity_min_blocks: the shortest shared prefix that routes by affinity, in
                blocks of 16 characters (4 tokens for token prompts): 128 characters.
            affinity_slack: how many more requests than the least loaded replica an
                affine replica may carry; ``max(1, n_parallel // 2)`` by default.
            name: the pool's name (a ``ModelManager`` gives its model's): its replicas are
                ``name`` (one replica) or ``name-0``, ``name-1``, ... in telemetry's
                ``metadata["replica"]``; ``replica-0``, ``replica-1``, ... without one.

        Raises:
            ConfigError: bad pool or server options (checked before anything starts).
        """
        names = replica_names(replicas, max_restarts, name)
        options = ServerOptions.of(**server_options)  # every option checked before anything starts
        router = Router(
            names,
            capacity=options.n_parallel,
            min_blocks=affinity_min_blocks,
            slack=affinity_slack,
        )
        started: list[Replica] = []
        try:
            if backend == "local":
                for name in names:
                    started.append(LocalReplica(name, max_restarts, max_seconds, options))
            elif backend == "ray":
                try:
                    from actors.scale._ray import start_ray_replicas
                except ImportError as e:
                    raise ConfigError(
                        f"backend='ray' needs Ray: pip install 'llama-cpp-actors[ray]' ({e})"
                    ) from None

                started.extend(
                    start_ray_replicas(names, max_restarts, max_seconds, ray_actor_options, server_options)
                )
            else:
                raise ConfigError(f"backend must be 'local' or 'ray', got {backend!r}")
        except BaseException:
            for replica in started:
                replica.stop()
            raise
        for replica in started:
            replica.on_down = router.forget
        return cls(started, router)

    # -- the ActorRef-like surface (callers' threads) ------------------------------------

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas' names (what ``metadata["replica"]`` says)."""
        return tuple(self._replicas)

    def up(self) -> tuple[str, ...]:
        """The replicas that take requests now."""
        return tuple(name for name, r in self._replicas.items() if r.up())

    def gave_up(self) -> str | None:
        """Why no replica will take requests again (their restarts ran out), or None
        while one still does or may."""
        reasons = [replica.gave_up() for replica in self._replicas.values()]
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"{name}: {reason}" for name, reason in zip(self._replicas, reasons, strict=True))

    def is_alive(self) -> bool:
        """True until :meth:`stop`: each request in flight gets an outcome even if its replica dies."""
        return not self._stopped

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """As ``ActorRef.ask``: ``Generate``, ``GenerateTokens`` and ``Chat`` give a future of
        the Completion; ``GetStats`` a dict with ``replicas`` (each replica's stats) and the
        sums; ``Drain`` drains every replica and gives the unfinished count; ``GetInfo``,
        ``GetLora`` and ``GetTokenizer`` are answered by a replica that is up; ``SetLora``
        is sent to every replica that is up (one that restarts later has its start
        options' scales); ``SaveSlot``, ``RestoreSlot`` and ``EraseSlot`` go to the one
        replica of a pool of one (each replica has slots of its own: a pool of more
        refuses them).

        With ``block=False`` the answer comes wrapped in a resolved future, as pykka does.
        ``timeout`` bounds the wait in either case: a request's admission (then
        ``RequestTimeout``, the request cancelled), or the question's answer.
        """
        self._check_running()
        if isinstance(message, AskedMessage):
            answer: Any = self._submit(message, timeout)
        elif isinstance(message, Submit):  # the caller's own future gets the outcome
            self._submit(message.message, timeout, message.future)
            answer = None
        elif isinstance(message, (*STREAMING, Cancel, CancelExact)):
            self.tell(message)
            answer = None
        elif isinstance(message, GetStats):
            answer = self._stats(timeout)
        elif isinstance(message, Drain):
            answer = self._drain(message, timeout)
        elif isinstance(message, GetInfo | GetTokenizer | GetLora):
            answer = self._any_replica(lambda r: r.call(message, timeout))
        elif isinstance(message, SaveSlot | RestoreSlot | EraseSlot):
            if len(self._replicas) != 1:
                raise InvalidRequest(
                    f"slot files name one engine's slots, and this pool has {len(self._replicas)} "
                    "replicas, each with slots of its own: use a pool of one"
                )
            answer = self._any_replica(lambda r: r.call(message, timeout))
        elif isinstance(message, SetLora):  # every replica serves with the same scales
            answers = [r.call(message, timeout) for name, r in self._replicas.items() if name in self.up()]
            if not answers:
                raise EngineStopped("no replica of the pool is up")
            answer = answers[0]
        else:
            raise TypeError(f"a ServerPool does not handle {message!r}")
        if block:
            return answer
        future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
        future.set(answer)
        return future

    def tell(self, message: Any) -> None:
        """As ``ActorRef.tell``: streams are routed, ``Cancel`` reaches the request's replica,
        ``CancelExact`` too if it names the message the request in flight came from."""
        self._check_running()
        if isinstance(message, STREAMING):
            self._send(message)
        elif isinstance(message, Cancel):
            name = self.router.replica_of(message.request_id)
            if name is not None:
                self._replicas[name].cancel(message.request_id)
        elif isinstance(message, CancelExact):
            self._cancel_exact(message)
        elif isinstance(message, AskedMessage):
            self._submit(message, None)
        elif isinstance(message, Submit):
            self._submit(message.message, None, message.future)
        else:
            raise TypeError(f"a ServerPool cannot be told {message!r}")

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop every replica; requests in flight fail with ``EngineStopped``."""
        self._stopped = True
        for replica in self._replicas.values():
            try:
                replica.stop()
            except Exception:
                _log.exception("stopping %s failed", replica.name)

    # -- routing ---------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._stopped:
            raise EngineStopped("the pool was stopped")

    def _route(self, message: Any, admit: Callable[[Replica], None], tried: set[str]) -> None:
        """Choose a replica (not in ``tried``) and admit there; a replica found down, or
        full, makes way for the next. ``tried`` grows with each replica that refused."""
        while True:
            up = [n for n in self.up() if n not in tried]
            if not up and tried:
                raise EngineStopped(f"no replica could take the request (tried {', '.join(sorted(tried))})")
            name = self.router.choose(message, up)
            try:
                admit(self._replicas[name])
                return
            except ReplicaDown:
                self.router.finished(message.request_id)
                tried.add(name)
            except QueueFull:
                self.router.finished(message.request_id)
                tried.add(name)
                if len(tried) == len(self._replicas):
                    raise
            except BaseException:
                self.router.finished(message.request_id)
                raise

    def _reroute(self, message: Any, admit: Callable[[Replica], None], tried: set[str]) -> Callable[[], bool]:
        """For a QueueFull that arrives later (a stream's Failed, a Ray result): try the
        other replicas, as ``_route`` does for a QueueFull raised at once. Runs in the
        thread that delivers the refusal."""

        def reroute() -> bool:
            name = self.router.replica_of(message.request_id)
            self.router.finished(message.request_id)
            if name is not None:
                tried.add(name)
            if self._stopped or len(tried) >= len(self._replicas):
                return False
            try:
                self._route(message, admit, tried)
            except Exception:  # nowhere to go: the caller gets the original refusal
                return False
            return True

        return reroute

    def _submit(
        self,
        message: AskedMessage,
        timeout: float | None,
        outer: pykka.ThreadingFuture[Any] | None = None,
    ) -> Tracked:
        """Admit a Generate (or an Embed) on a replica within ``timeout`` (caller's thread);
        its outcome goes to ``outer`` too, when given (a ``Submit``'s future).

        Raises:
            RequestTimeout: no replica answered the admission in time; cancelled there.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = _Sent(message, message)  # a replica admits the caller's own message
        settled = self._settled(sent)
        if outer is not None:
            settled = forwarding(settled, lambda: future, outer)
        future = Tracked(settled)
        tried: set[str] = set()

        def admit(replica: Replica) -> None:
            replica.submit(message, future, None if deadline is None else max(deadline - time.monotonic(), 0))

        future.on_full = self._reroute(message, admit, tried)
        self._track(sent, admit, tried)
        return future

    def _send(self, message: StreamMessage) -> None:
        sent = _Sent(message, message)
        relay = Relay(message.reply_to, self._settled(sent), message.n)
        relayed = sent.sent = dataclasses.replace(message, reply_to=relay)
        tried: set[str] = set()

        def admit(replica: Replica) -> None:
            replica.send(relayed)

        relay.on_full = self._reroute(message, admit, tried)
        self._track(sent, admit, tried)

    # -- what was sent, for exact cancels ---------------------------------------------

    def _track(self, sent: _Sent, admit: Callable[[Replica], None], tried: set[str]) -> None:
        """Remember what is sent, then route it (caller's thread)."""
        request_id = sent.message.request_id
        with self._lock:
            # A request id already in flight is refused by the router: keep the first's.
            self._sent.setdefault(request_id, sent)
        try:
            self._route(sent.message, admit, tried)
        except BaseException:
            self._forget(sent)
            raise

    def _settled(self, sent: _Sent) -> Callable[[], None]:
        """What a request's end does to the pool (the thread that ends the request)."""

        def settled() -> None:
            self.router.finished(sent.message.request_id)
            self._forget(sent)

        return settled

    def _forget(self, sent: _Sent) -> None:
        with self._lock:
            if self._sent.get(sent.message.request_id) is sent:
                del self._sent[sent.message.request_id]

    def _cancel_exact(self, cancel: CancelExact) -> None:
        """Cancel the request in flight with that id only if it came from ``cancel.message``."""
        with self._lock:
            sent = self._sent.get(cancel.request_id)
        if sent is None or (cancel.message is not sent.message and cancel.message is not sent.sent):
            return  # a late cancel: the id's request ended, or a newer one reuses it
        name = self.router.replica_of(cancel.request_id)
        if name is not None:
            self._replicas[name].cancel(cancel.request_id, sent.sent)

    # -- questions to the replicas ---------------------------------------------------

    def _any_replica(self, call: Callable[[Replica], Any]) -> Any:
        for name in self.up():
            try:
                return call(self._replicas[name])
            except ReplicaDown:
                continue
        raise EngineStopped("no replica of the pool is up")

    def _stats(self, timeout: float | None) -> dict[str, Any]:
        """Each replica's GetStats (None when down), their sums, the router's decisions."""
        totals = pool_stats(self._replicas.values(), timeout)
        totals["routing"] = dict(self.router.decisions)
        return totals

    def _drain(self, message: Drain, timeout: float | None) -> int:
        """Drain every replica at once, then stop the pool (caller's thread): the
        requests that did not finish (see :func:`drain_replicas`)."""
        try:
            results, late = drain_replicas(self._replicas.values(), message, timeout)
        except Exception:
            self.stop()
            raise
        loads = self.router.loads()
        self.stop()
        return sum(results.values()) + sum(loads.get(name, 0) for name in late)
