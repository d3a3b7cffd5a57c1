"""The registry of a ``ModelManager``: its models and the pykka actor that loads,
leases and unloads them (see :mod:`actors.scale._manager`).

Everything here runs in the manager actor's thread, except ``machine_memory_mb``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import pykka

import telemetry
from actors.actor._estimate import MemoryEstimate
from actors.contract._errors import (
    ConfigError,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelLoadError,
    QueueFull,
)
from actors.scale._pool import ServerPool

__all__ = [
    "Acquire",
    "ManagerActor",
    "Model",
    "Register",
    "Release",
    "Snapshot",
    "Unload",
    "Unregister",
    "in_flight",
    "listed",
    "machine_memory_mb",
    "tell_quietly",
]

_log = logging.getLogger("llama_cpp_actors.manager")

_MIB = 1 << 20
# How often the manager looks for models idle past their keep_alive, at most and least.
_SWEEP_MIN_S, _SWEEP_MAX_S = 0.05, 5.0


def machine_memory_mb() -> float:
    """The machine's physical memory in MiB (any thread); 0 when the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _MIB
    except (ValueError, OSError, AttributeError):
        return 0.0


@dataclasses.dataclass(slots=True, eq=False)
class Model:
    """One registered model (manager thread only, but ``pool`` is read by callers)."""

    name: str
    options: dict[str, Any]
    estimate: MemoryEstimate
    keep_alive_s: float | None
    pinned: bool
    replicas: int
    capacity: int  # requests it takes at once: its slots and queues (every replica's)
    pool: ServerPool | None = None
    leases: int = 0
    idle_since: float = 0.0  # monotonic: when it was last seen with nothing to do
    loaded_at: float = 0.0
    loads: int = 0
    last_error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Register:
    model: Model
    eager: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Unregister:
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Acquire:
    name: str | None
    load: bool = False  # load it even without autoload (an explicit load)


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Unload:
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class _Sweep:
    pass


def in_flight(pool: ServerPool) -> int:
    return sum(pool.router.loads().values())


class ManagerActor(pykka.ThreadingActor):
    """Owns the registry; loads, unloads and leases models (its own thread)."""

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
        self._timer: threading.Timer | None = None
        self._due = 0.0  # when the timer fires (monotonic)

    # -- messages (manager thread) --------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """Dispatch one message; its errors go back to the asker."""
        if isinstance(message, Acquire):
            return self._acquire(message.name, message.load)
        if isinstance(message, Release):
            model = self.models.get(message.name)
            if model is not None:
                model.leases -= 1
                model.idle_since = time.monotonic()
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
        if isinstance(message, _Sweep):
            self._timer = None
            self._sweep()
            return None
        raise TypeError(f"the model manager does not handle {message!r}")

    def on_stop(self) -> None:
        """Unload every model; requests in flight fail with ``EngineStopped`` (manager thread)."""
        if self._timer is not None:
            self._timer.cancel()
        for model in self.models.values():
            self._unload(model, "stopped")

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

    def _acquire(self, name: str | None, load: bool) -> tuple[str, ServerPool]:
        """The model's name and engine, loaded if needed, with a lease the caller ends
        (``Release``)."""
        model = self._named(name)
        pool = model.pool
        if pool is not None and not pool.up() and pool.gave_up() is not None:
            # Its engine died for good (a load that failed, crashes past max_restarts):
            # free it and load again for this request.
            self._unload(model, "failed")
        if model.pool is None:
            if not (self.autoload or load):
                raise ModelLoadError(
                    f"model {model.name!r} is not loaded, and this manager loads models only when told"
                )
            self._load(model)
        assert model.pool is not None
        # Its engine bounds its queue only once loaded: until then requests wait in the
        # engine's inbox, so the manager bounds them (and the same number after).
        if model.leases + in_flight(model.pool) >= model.capacity:
            raise QueueFull(
                f"model {model.name!r} has {model.capacity} requests waiting or running (its slots "
                "and max_queue, loading or not)"
            )
        model.leases += 1
        model.idle_since = time.monotonic()
        return model.name, model.pool

    def _loaded(self) -> int:
        return sum(1 for m in self.models.values() if m.pool is not None)

    def _fits(self, needed_mb: float) -> bool:
        room = not self.max_models or self._loaded() < self.max_models
        return room and self._held_mb() + needed_mb <= self.budget_mb

    def _held_mb(self) -> float:
        return sum(m.estimate.total_mb for m in self.models.values() if m.pool is not None)

    def _load(self, model: Model) -> None:
        """Start the model's engine (its model loads in the engine's thread), first
        unloading idle models, least recently used first, until it fits."""
        needed = model.estimate.total_mb
        if not self._fits(needed):
            idle = sorted(
                (m for m in self.models.values() if m.pool is not None and self._evictable(m)),
                key=lambda m: m.idle_since,
            )
            for victim in idle:
                if self._fits(needed):
                    break
                self._unload(victim, "evicted")
        held = self._held_mb()
        busy = [m.name for m in self.models.values() if m.pool is not None]
        if self.max_models and len(busy) >= self.max_models:
            raise ModelLoadError(
                f"model {model.name!r} cannot load: {len(busy)} models are loaded (max_models="
                f"{self.max_models}) and none is idle ({', '.join(busy)})"
            )
        if held + needed > self.budget_mb:
            raise MemoryBudgetExceeded(
                f"model {model.name!r} needs about {needed:.0f} MiB, but {held:.0f} MiB of the "
                f"{self.budget_mb:.0f} MiB budget is held by models in use or pinned "
                f"({', '.join(busy)})",
                needed_mb=needed,
                budget_mb=self.budget_mb,
                held_mb=held,
            )
        try:
            # No Supervisor restarts: a crashed or unloadable engine gives up at once, its
            # requests fail with its reason, and the next request loads the model afresh.
            model.pool = ServerPool.start(
                replicas=model.replicas, name=model.name, max_restarts=0, **model.options
            )
        except Exception as e:
            model.last_error = repr(e)
            raise
        model.loads += 1
        model.loaded_at = model.idle_since = time.monotonic()
        model.last_error = None
        self._arm_sweep()

    def _evictable(self, model: Model) -> bool:
        return (
            not model.pinned and model.leases == 0 and model.pool is not None and in_flight(model.pool) == 0
        )

    def _unload(self, model: Model, reason: str) -> None:
        pool, model.pool = model.pool, None
        if pool is None:
            return
        if reason == "failed":
            model.last_error = pool.gave_up()
        try:
            pool.stop()  # blocks until every replica's engine freed its model
        except Exception:
            _log.exception("stopping model %r failed", model.name)
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
        timer = threading.Timer(period, lambda: tell_quietly(ref, _Sweep()))
        timer.daemon = True
        self._timer, self._due = timer, due
        timer.start()

    def _sweep(self) -> None:
        now = time.monotonic()
        for model in self.models.values():
            pool = model.pool
            if pool is None or model.pinned or model.keep_alive_s is None:
                continue
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


def tell_quietly(ref: pykka.ActorRef[Any], message: object) -> None:
    with contextlib.suppress(pykka.ActorDeadError):
        ref.tell(message)


def listed(models: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in models) or "no model"
