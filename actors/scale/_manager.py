"""``ModelManager``: several named models in one process, loaded on demand under a
memory budget (ollama's scheduler and LlamaCppEx's ``ModelManager``, as a pykka actor).

Each registered model becomes an engine only when a request needs it (or at once, for
``load="eager"``): a one-replica ``ServerPool`` whose ``ServerActor`` loads the model in
its own thread, so a load never blocks the manager or the other models. Requests for
a model that is loading wait in its engine's inbox, each under its own timeout.

Before a load, the model's host memory is estimated from its GGUF header
(:mod:`actors.actor._estimate`). A load that would pass the budget first unloads idle
models, least recently used first; a model with requests in flight, or ``pinned``,
is never unloaded for room. If it still cannot fit, the request fails with
``MemoryBudgetExceeded`` naming the numbers. A model idle for its ``keep_alive_s``
unloads (ollama's ``keep_alive``).

Threads: the manager's state lives in ``ManagerActor`` and changes only in its thread;
the ``ModelManager`` handle's methods run in callers' threads. A request leases its
model from the actor (which loads it if needed), is routed to the model's pool from the
caller's thread, and the lease ends once the pool counts it as in flight: a model is
unloaded only when it has neither leases nor requests in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, Literal

import pykka

from actors.actor import check_options, estimate_options
from actors.contract import (
    Cancel,
    CancelExact,
    ConfigError,
    ControlMessage,
    Drain,
    EngineStopped,
    GetStats,
    InvalidRequest,
    ModelLoadError,
)
from actors.scale._checks import (
    checked_keep_alive,
    checked_name,
    checked_timeout,
    known_name,
    listed,
    machine_memory_mb,
    plain_options,
    routed_id,
    times,
)
from actors.scale._handle import ModelHandle
from actors.scale._manager_queries import drain_pools, models_stats
from actors.scale._models import (
    Acquire,
    Model,
    Register,
    Release,
    Snapshot,
    Unload,
    Unregister,
    tell_quietly,
    why_down,
)
from actors.scale._pool import ServerPool
from actors.scale._registry import ManagerActor

__all__ = ["ModelManager"]

_DEFAULT_KEEP_ALIVE_S = 300.0
_WAIT_POLL_S = 0.05  # how often a request waiting for room asks again
_STATS_TIMEOUT_S = 1.0  # an engine still loading answers GetStats only once loaded


class ModelManager:
    """Named models behind one handle, loaded on demand under a memory budget.

    Start it with :meth:`start`; send it the messages a ServerActor takes (their
    ``model`` field names the model) or pass it to any helper (``generate(manager,
    ..., model="chat")``). Every method runs in the caller's thread.
    """

    DEFAULT_WAIT_S = 300.0
    """How long a request waits, by default, for a busy model to make room for its own
    (the HTTP router waits as long)."""

    def __init__(
        self,
        budget_mb: float,
        default: str | None,
        max_models: int = 0,
        autoload: bool = True,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> None:
        self._stopped = False
        self.wait_s = wait_s
        self._actor: pykka.ActorRef[Any] = ManagerActor.start(budget_mb, default, self, max_models, autoload)

    @classmethod
    def start(
        cls,
        models: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        memory_budget_mb: float | None = None,
        default: str | None = None,
        max_models: int = 0,
        autoload: bool = True,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> ModelManager:
        """Start a manager and register ``models`` (``{name: register's keywords}``).

        Args:
            models: the models to register at once, by name; each value holds
                :meth:`register`'s keywords (server options, ``keep_alive_s``,
                ``pinned``, ``load``, ``replicas``).
            memory_budget_mb: host memory the loaded models may hold together, by their
                estimates; None: 80% of the machine's memory.
            default: the model a request without ``model`` goes to; without it, such a
                request needs the manager to hold exactly one model.
            max_models: at most this many models loaded at once (llama-server's
                ``--models-max``); 0: as many as the budget holds.
            autoload: load a model for its first request; False: a request for a model
                that is not loaded fails with ``ModelLoadError`` (load it with :meth:`load`).
            wait_s: how long a request for a model that cannot load now waits for a busy
                model to make room (it goes idle, then unloads); 0 refuses at once with
                ``MemoryBudgetExceeded`` (or ``ModelLoadError`` for ``max_models``). A
                request's own ``timeout`` bounds the wait too. Never waits for pinned
                models, nor for one that failed lately.

        Raises:
            ConfigError: a bad option or model; MemoryBudgetExceeded: an eager model
                that cannot fit. Nothing stays started.
        """
        if memory_budget_mb is None:
            budget = 0.8 * machine_memory_mb()
            if budget <= 0:
                raise ConfigError("the machine's memory is unknown here: pass memory_budget_mb")
        elif (
            isinstance(memory_budget_mb, bool)
            or not isinstance(memory_budget_mb, int | float)
            or not 0 < memory_budget_mb < float("inf")
        ):
            raise ConfigError(f"memory_budget_mb must be a number of MiB > 0, got {memory_budget_mb!r}")
        else:
            budget = float(memory_budget_mb)
        if default is not None:
            default = checked_name(default)
        if isinstance(max_models, bool) or not isinstance(max_models, int) or not 0 <= max_models <= 1024:
            raise ConfigError(f"max_models must be an int from 0 (no limit) to 1024, got {max_models!r}")
        if not isinstance(autoload, bool):
            raise ConfigError(f"autoload must be a bool, got {autoload!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 <= wait_s <= 86400:
            raise ConfigError(f"wait_s must be a number of seconds from 0 to 86400, got {wait_s!r}")
        if models is not None and not isinstance(models, Mapping):
            raise ConfigError("models must be a dict of {name: options}")
        manager = cls(budget, default, max_models, autoload, float(wait_s))
        try:
            for name, options in (models or {}).items():
                if not isinstance(options, Mapping):
                    raise ConfigError(f"model {name!r}: its options must be a dict, got {options!r}")
                manager.register(name, **options)
            if default is not None and default not in manager.models():
                raise ConfigError(f"default {default!r} is not one of the models: {listed(models or ())}")
        except BaseException:
            manager.stop()
            raise
        return manager

    # -- the registry (callers' threads) ---------------------------------------------------

    def register(
        self,
        name: str,
        /,
        *,
        keep_alive_s: float | None = _DEFAULT_KEEP_ALIVE_S,
        pinned: bool = False,
        load: Literal["lazy", "eager"] = "lazy",
        replicas: int = 1,
        **server_options: Any,
    ) -> None:
        """Add a model: ``server_options`` are ``ServerActor.start``'s, checked now.

        Args:
            name: what requests call it (their ``model``).
            keep_alive_s: idle seconds before it unloads; None: never for idleness.
            pinned: never unloaded, for idleness or for room.
            load: ``"lazy"`` (at its first request) or ``"eager"`` (now).
            replicas: engines serving it (a ``ServerPool``'s replicas).

        Raises:
            ConfigError: a bad option, or the name is taken. ModelLoadError: the file is
                missing or not a GGUF. MemoryBudgetExceeded: it can never fit, or (eager)
                cannot fit now.
        """
        self._check_running()
        name = checked_name(name)
        if not isinstance(pinned, bool):
            raise ConfigError(f"pinned must be a bool, got {pinned!r}")
        if load not in ("lazy", "eager"):
            raise ConfigError(f"load must be 'lazy' or 'eager', got {load!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 64:
            raise ConfigError(f"replicas must be an int from 1 to 64, got {replicas!r}")
        if "name" in server_options:
            raise ConfigError("a managed engine is named after its model; do not pass name")
        checked = check_options(**server_options)
        estimate = estimate_options(checked)
        model = Model(
            name=name,
            options=plain_options(server_options, checked),
            checked=checked,
            estimate=times(estimate, replicas),
            keep_alive_s=checked_keep_alive(keep_alive_s),
            pinned=pinned,
            replicas=replicas,
            capacity=replicas * (checked.n_parallel + checked.max_queue),
        )
        self._call(Register(model, load == "eager"))

    def unregister(self, name: str) -> None:
        """Remove a model; its engine stops, requests in flight fail with ``EngineStopped``."""
        self._check_running()
        self._call(Unregister(known_name(name)))

    def unload(self, name: str) -> None:
        """Unload a model now (it loads again at its next request); as :meth:`unregister`
        for its requests in flight."""
        self._check_running()
        self._call(Unload(known_name(name)))

    def load(self, name: str) -> None:
        """Load a model now (if it is not): its engine starts and loads in its own thread.

        Raises:
            InvalidRequest: unknown model. MemoryBudgetExceeded: it cannot fit now (a
                load never waits for room; requests do, for ``wait_s``).
        """
        self._check_running()
        leased, _ = self._lease(known_name(name), load=True, timeout=0.0)
        tell_quietly(self._actor, Release(leased))

    def models(self) -> tuple[str, ...]:
        """The registered models' names."""
        self._check_running()
        return tuple(self._call(Snapshot())["models"])

    def engine(self, name: str) -> ModelHandle:
        """A handle for one model: what a helper takes to reach it without ``model=``.

        Raises:
            InvalidRequest: unknown model.
        """
        models = self.models()
        if name not in models:
            raise InvalidRequest(
                f"unknown model {name!r}: this manager serves {listed(dict.fromkeys(models))}"
            )
        return ModelHandle(self, name)

    # -- the ActorRef-like surface (callers' threads) --------------------------------------

    def is_alive(self) -> bool:
        """True until :meth:`stop`."""
        return not self._stopped and self._actor.is_alive()

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """As ``ActorRef.ask``: a request goes to its ``model`` (loaded if needed) and is
        answered as that model's engine answers it; ``GetStats`` gives every model's
        state and its engine's stats; ``GetInfo``, ``GetTokenizer``, ``GetLora`` and
        ``SetLora`` are the default model's; ``Drain`` drains every model, then stops the
        manager.
        """
        return self._ask(message, getattr(message, "model", None), block, timeout)

    def tell(self, message: Any) -> None:
        """As ``ActorRef.tell``: a stream goes to its ``model``; a ``Cancel`` reaches it."""
        self._tell(message, getattr(message, "model", None))

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Unload every model and stop; requests in flight fail with ``EngineStopped``."""
        self._stopped = True
        with contextlib.suppress(pykka.ActorDeadError):
            self._actor.stop(block=block, timeout=timeout)

    # -- routing ---------------------------------------------------------------------------

    def _call(self, message: object) -> Any:
        """The manager actor's answer (its errors raise here)."""
        return self._actor.ask(message, block=True)

    def _check_running(self) -> None:
        if self._stopped or not self._actor.is_alive():
            raise EngineStopped("the model manager was stopped")

    def _lease(
        self,
        name: str | None,
        load: bool = False,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> tuple[Model, ServerPool]:
        """The model's engine, with a lease (caller's thread). A model that cannot load
        while busy models hold the room is asked for again until ``wait_s`` (or
        ``timeout``) has passed."""
        wait = self.wait_s if timeout is None else min(self.wait_s, timeout)
        deadline = time.monotonic() + wait
        while True:
            self._check_running()
            try:
                leased: tuple[Model, ServerPool] = self._call(Acquire(name, load, request_id))
                return leased
            except pykka.ActorDeadError:
                raise EngineStopped("the model manager was stopped") from None
            except ModelLoadError as e:
                if not getattr(e, "room_held", False) or time.monotonic() >= deadline:
                    raise
            time.sleep(_WAIT_POLL_S)

    def _ask(self, message: Any, name: str | None, block: bool, timeout: float | None) -> Any:
        timeout = checked_timeout(timeout)
        if isinstance(message, ControlMessage):
            answer = self._control(message, name, timeout)
            if block:
                return answer
            future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
            future.set(answer)
            return future
        request_id = routed_id(message)
        model, pool = self._lease(name, request_id=request_id, timeout=timeout)
        try:
            return pool.ask(message, block=block, timeout=timeout)
        except EngineStopped as e:
            raise EngineStopped(f"model {model.name!r}: {why_down(pool, e)}") from None
        finally:
            tell_quietly(self._actor, Release(model, request_id))

    def _tell(self, message: Any, name: str | None) -> None:
        if isinstance(message, ControlMessage):
            self._control(message, name, None)
            return
        request_id = routed_id(message)
        model, pool = self._lease(name, request_id=request_id)
        try:
            pool.tell(message)
        except EngineStopped as e:
            raise EngineStopped(f"model {model.name!r}: {why_down(pool, e)}") from None
        finally:
            tell_quietly(self._actor, Release(model, request_id))

    def _pools(self) -> dict[str, Any]:
        self._check_running()
        snapshot: dict[str, Any] = self._call(Snapshot())
        return snapshot

    def _control(self, message: Any, name: str | None, timeout: float | None) -> Any:
        if isinstance(message, Cancel | CancelExact):
            # A cancel names no model: it goes to the engine that runs its id (the manager
            # refuses an id in flight on two models), if any.
            for info in self._pools()["models"].values():
                pool = info["pool"]
                if pool is not None and pool.router.replica_of(message.request_id) is not None:
                    with contextlib.suppress(EngineStopped):
                        pool.tell(message)
            return None
        if isinstance(message, GetStats):
            stats = self._stats(timeout)
            if name is None:
                return stats
            if name not in stats["models"]:
                raise InvalidRequest(f"unknown model {name!r}: this manager serves {listed(stats['models'])}")
            return stats["models"][name]
        if isinstance(message, Drain):
            return self._drain(message)
        model, pool = self._lease(name)  # GetInfo, GetTokenizer, LoRA, slot files: the model's own
        try:
            return pool.ask(message, timeout=timeout)
        finally:
            tell_quietly(self._actor, Release(model))

    def _stats(self, timeout: float | None) -> dict[str, Any]:
        """Every model's state, and the stats of the engines that are ready."""
        return models_stats(self._pools(), _STATS_TIMEOUT_S if timeout is None else timeout)

    def _drain(self, message: Drain) -> int:
        """Drain every model at once, then stop the manager."""
        pools = [info["pool"] for info in self._pools()["models"].values() if info["pool"] is not None]
        unfinished = drain_pools(pools, message)
        self.stop()
        return unfinished
