"""The registry of a ``ModelManager``: its models and the pykka actor that loads,
leases and unloads them (see :mod:`actors.scale._manager`).

Everything here runs in the manager actor's thread, except ``machine_memory_mb``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pykka

import telemetry
from actors.actor import estimate_options
from actors.contract import (
    ConfigError,
    EngineError,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelFailedLately,
    ModelLoadError,
    QueueFull,
)
from actors.scale._checks import listed, times
from actors.scale._eviction import in_flight, victims
from actors.scale._models import (
    Acquire,
    Loaded,
    Model,
    Register,
    Release,
    Snapshot,
    Stopped,
    Sweep,
    Unload,
    Unregister,
    stop_engine,
    tell_quietly,
    watch_load,
)
from actors.scale._pool import ServerPool

__all__ = ["ManagerActor"]

_log = logging.getLogger("llama_cpp_actors.manager")

_MIB = 1 << 20
# How often the manager looks for models idle past their keep_alive, at most and least.
_SWEEP_MIN_S, _SWEEP_MAX_S = 0.05, 5.0
_STOP_WAIT_S = 30.0  # how long a load waits for the idle engines it unloaded to stop
_FAILED_BACKOFF_S = 60.0  # a model that failed lately unloads no working model to load again


class ManagerActor(pykka.ThreadingActor):
    """Owns the registry; loads, unloads and leases models (its own thread).

    It never waits on an engine, except for the idle engines it unloads to make room
    (an idle, loaded engine stops at once) and when the manager stops: an engine is
    stopped in a thread of its own, and its memory counts until it has stopped.
    """

    use_daemon_thread = True

    def __init__(
        self, budget_mb: float, default: str | None, sender: object, max_models: int, autoload: bool
    ) -> None:
        super().__init__()
        self.budget_mb = budget_mb
        self.default = default
        self.max_models = max_models  # 0: no limit
        self.autoload = autoload
        self.sender = sender  # what the signals name as their sender: the handle
        self.models: dict[str, Model] = {}
        self._stopping: dict[object, tuple[float, threading.Thread]] = {}  # token: (MiB, stopper)
        self._leased_ids: dict[str, Model] = {}  # request ids between Acquire and Release
        self._timer: threading.Timer | None = None
        self._due = 0.0  # when the timer fires (monotonic)

    # -- messages (manager thread) --------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """Dispatch one message; its errors go back to the asker.

        A ``BaseException`` (a caller's object raising ``SystemExit``) becomes an
        ``EngineError``: pykka would stop every actor of the process for it.
        """
        try:
            return self._dispatch(message)
        except Exception:
            raise
        except BaseException as e:
            raise EngineError(f"the model manager's {type(message).__name__} failed: {e!r}") from None

    def _dispatch(self, message: Any) -> Any:
        if isinstance(message, Acquire):
            return self._acquire(message)
        if isinstance(message, Release):
            message.model.leases -= 1
            message.model.idle_since = time.monotonic()
            if message.request_id is not None and self._leased_ids.get(message.request_id) is message.model:
                del self._leased_ids[message.request_id]
            return None
        if isinstance(message, Loaded):
            if message.model.generation == message.generation and message.model.pool is not None:
                message.model.ready = True
                message.model.idle_since = time.monotonic()  # keep_alive counts from here
            return None
        if isinstance(message, Stopped):
            self._stopping.pop(message.token, None)
            return None
        if isinstance(message, Register):
            return self._register(message.model, message.eager)
        if isinstance(message, Unregister):
            model = self._named(message.name)
            self._unload(model, "unregistered")
            del self.models[model.name]
            if self.default == model.name:
                self.default = None
            return None
        if isinstance(message, Unload):
            model = self._named(message.name)
            if model.pool is not None:
                self._unload(model, "unloaded")
            return None
        if isinstance(message, Snapshot):
            return self._snapshot()
        if isinstance(message, Sweep):
            self._timer = None
            self._sweep()
            return None
        raise TypeError(f"the model manager does not handle {message!r}")

    def on_stop(self) -> None:
        """Unload every model and wait for their engines; requests in flight fail with
        ``EngineStopped`` (manager thread)."""
        if self._timer is not None:
            self._timer.cancel()
        for model in self.models.values():
            self._unload(model, "stopped")
        for _, stopper in list(self._stopping.values()):
            stopper.join(_STOP_WAIT_S)

    def on_failure(self, *_: object) -> None:
        """A manager that crashed still frees its models (manager thread)."""
        self.on_stop()

    # -- the registry ------------------------------------------------------------------

    def _named(self, name: str | None) -> Model:
        if name is None:
            name = self.default
            if name is None:
                if len(self.models) != 1:
                    raise InvalidRequest(
                        f"name the model: this manager serves {listed(self.models)} and has no default"
                    )
                name = next(iter(self.models))
        model = self.models.get(name)
        if model is None:
            raise InvalidRequest(f"unknown model {name!r}: this manager serves {listed(self.models)}")
        return model

    def _register(self, model: Model, eager: bool) -> None:
        if model.name in self.models:
            raise ConfigError(f"a model named {model.name!r} is registered already")
        for other in self.models.values():
            if shared := sorted(model.labels() & other.labels()):
                raise ConfigError(
                    f"models {model.name!r} and {other.name!r} would both label telemetry "
                    f"{shared[0]!r} (a model's n replicas are name-0 to name-(n-1)): rename one"
                )
        if model.estimate.total_mb > self.budget_mb:
            raise MemoryBudgetExceeded(
                f"model {model.name!r} needs about {model.estimate.total_mb:.0f} MiB, more than the "
                f"whole memory budget of {self.budget_mb:.0f} MiB",
                needed_mb=model.estimate.total_mb,
                budget_mb=self.budget_mb,
                held_mb=0.0,
            )
        self.models[model.name] = model
        if eager:
            try:
                self._load(model)
            except BaseException:
                del self.models[model.name]
                raise

    def _acquire(self, message: Acquire) -> tuple[Model, ServerPool]:
        """The model and its engine, loaded if needed, with a lease the caller ends
        (``Release``)."""
        model = self._named(message.name)
        request_id = message.request_id
        if request_id is not None:
            for other in self.models.values():
                leased_by = self._leased_ids.get(request_id)
                running = other.pool is not None and other.pool.router.replica_of(request_id) is not None
                if (leased_by is not None and leased_by is not model) or (other is not model and running):
                    raise InvalidRequest(
                        f"request_id {request_id!r} is in flight on another model: ids must be unique"
                    )
        pool = model.pool
        if pool is not None and not pool.up() and pool.gave_up() is not None:
            # Its engine died for good (a load that failed, a crash): free it and load
            # again for this request.
            self._unload(model, "failed")
        if model.pool is None:
            if not (self.autoload or message.load):
                raise ModelLoadError(
                    f"model {model.name!r} is not loaded, and this manager loads models only when told"
                )
            self._load(model)
        assert model.pool is not None
        # Its engine bounds its queue only once loaded: until then requests wait in the
        # engine's inbox, so the manager bounds them (and the same number after).
        if in_flight(model.pool) >= model.capacity:
            raise QueueFull(
                f"model {model.name!r} has {model.capacity} requests waiting or running (its slots "
                "and max_queue, loading or not)"
            )
        model.leases += 1
        model.idle_since = time.monotonic()
        if request_id is not None:
            self._leased_ids[request_id] = model
        return model, model.pool

    def _loaded(self) -> int:
        return sum(1 for m in self.models.values() if m.pool is not None) + len(self._stopping)

    def _held_mb(self) -> float:
        held = sum(m.estimate.total_mb for m in self.models.values() if m.pool is not None)
        return held + sum(mb for mb, _ in self._stopping.values())

    def _load(self, model: Model) -> None:
        """Start the model's engine (its model loads in the engine's thread), first
        unloading idle models, least recently used first, when it would not fit (not for a
        model whose engine failed lately: ``ModelFailedLately``)."""
        try:
            # The file is read again: it may have changed since it was registered.
            model.estimate = times(estimate_options(model.checked), model.replicas)
        except ModelLoadError as e:
            model.last_error, model.failed_at = str(e), time.monotonic()
            raise
        needed = model.estimate.total_mb
        victims = self._victims(model, needed)
        if victims and model.failed_at and time.monotonic() - model.failed_at < _FAILED_BACKOFF_S:
            # It failed lately: it may try again, but not at the cost of models that work.
            raise ModelFailedLately(
                f"model {model.name!r} failed lately ({model.last_error}); it loads again without "
                f"unloading a working model only {_FAILED_BACKOFF_S:.0f} s after that"
            )
        for victim in victims:
            self._unload(victim, "evicted")
        for token in [t for t, (_, stopper) in self._stopping.items() if stopper.is_alive()]:
            if self._held_mb() + needed <= self.budget_mb and self._has_room():
                break
            self._stopping[token][1].join(_STOP_WAIT_S)  # an idle engine stops at once
        try:
            # No Supervisor restarts: a crashed or unloadable engine gives up at once, its
            # requests fail with its reason, and the next request loads the model afresh.
            model.pool = ServerPool.start(
                replicas=model.replicas, name=model.name, max_restarts=0, **model.options
            )
        except Exception as e:
            model.last_error, model.failed_at = repr(e), time.monotonic()
            raise
        model.loads += 1
        model.generation += 1
        model.ready = False
        model.loaded_at = model.idle_since = time.monotonic()
        model.last_error = None
        watch_load(self.actor_ref, model, model.pool, model.generation)
        self._arm_sweep()

    def _has_room(self) -> bool:
        return not self.max_models or self._loaded() < self.max_models

    def _victims(self, model: Model, needed: float) -> list[Model]:
        """The idle models to unload for ``model`` (see :func:`victims`)."""
        return victims(model, needed, self.models.values(), self._held_mb(), self._loaded(),
                       self.budget_mb, self.max_models)  # fmt: skip

    def _unload(self, model: Model, reason: str) -> None:
        """Take the model's engine away now and stop it in a thread of its own; its
        memory counts until it has stopped (``_Stopped``)."""
        pool, model.pool = model.pool, None
        model.ready = False
        if pool is None:
            return
        if reason == "failed" or pool.gave_up() is not None:
            model.last_error, model.failed_at = pool.gave_up(), time.monotonic()
        token = object()
        ref = self.actor_ref
        stopper = threading.Thread(
            target=stop_engine,
            args=(pool, model.name, ref, token),
            name=f"llama-cpp-actors-unload-{model.name}",
        )
        stopper.daemon = True
        self._stopping[token] = (model.estimate.total_mb, stopper)
        stopper.start()
        if telemetry.model_unload.receivers:
            telemetry.emit(
                telemetry.model_unload,
                self.sender,
                {
                    "loaded_ms": (time.monotonic() - model.loaded_at) * 1000.0,
                    "memory_mb": model.estimate.total_mb,
                },
                {"model": model.name, "model_path": model.estimate.model_path, "reason": reason},
            )

    # -- keep_alive ----------------------------------------------------------------------

    def _arm_sweep(self) -> None:
        """Schedule the next look for idle models, if a loaded model can expire."""
        alive = [
            m.keep_alive_s
            for m in self.models.values()
            if m.pool is not None and m.keep_alive_s is not None and not m.pinned
        ]
        if not alive:
            return
        period = min(max(min(alive) / 4, _SWEEP_MIN_S), _SWEEP_MAX_S)
        due = time.monotonic() + period
        if self._timer is not None:
            if self._due <= due:
                return
            self._timer.cancel()  # a model with a shorter keep_alive came: look sooner
        ref = self.actor_ref
        timer = threading.Timer(period, lambda: tell_quietly(ref, Sweep()))
        timer.daemon = True
        self._timer, self._due = timer, due
        timer.start()

    def _sweep(self) -> None:
        now = time.monotonic()
        for model in self.models.values():
            pool = model.pool
            if pool is None or model.pinned:
                continue
            if pool.gave_up() is not None and not model.leases:
                self._unload(model, "failed")  # it counted against the budget for nothing
                continue
            if model.keep_alive_s is None or not model.ready:
                continue  # keep_alive counts from the end of the load
            if model.leases or in_flight(pool):
                model.idle_since = now
            elif now - model.idle_since >= model.keep_alive_s:
                self._unload(model, "idle")
        self._arm_sweep()

    def _snapshot(self) -> dict[str, Any]:
        return {
            "budget_mb": self.budget_mb,
            "max_models": self.max_models,
            "autoload": self.autoload,
            "held_mb": self._held_mb(),
            "default": self.default,
            "models": {
                m.name: {
                    "pool": m.pool,
                    "ready": m.ready,
                    "loaded": m.pool is not None,
                    "estimate_mb": m.estimate.total_mb,
                    "pinned": m.pinned,
                    "keep_alive_s": m.keep_alive_s,
                    "leases": m.leases,
                    "loads": m.loads,
                    "last_error": m.last_error,
                    "idle_s": time.monotonic() - m.idle_since if m.pool is not None else None,
                }
                for m in self.models.values()
            },
        }
