"""A ``ModelManager``'s registered models and the messages its actor takes (frozen
dataclasses, made in callers' threads and read in the manager's), and what a model's
pool says of its state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

import pykka

from actors.actor import MemoryEstimate, StartOptions
from actors.contract import EngineStopped, GetInfo
from actors.scale._pool import ServerPool

__all__ = [
    "LOAD_WAIT_S",
    "Acquire",
    "Loaded",
    "Model",
    "Register",
    "Release",
    "Snapshot",
    "Stopped",
    "Sweep",
    "Unload",
    "Unregister",
    "model_state",
    "stop_engine",
    "tell_quietly",
    "watch_load",
    "why_down",
]


@dataclasses.dataclass(slots=True, eq=False)
class Model:
    """One registered model (manager thread only, but ``pool`` is read by callers).

    A model is *loaded* while it has a ``pool`` (its engine may still be loading the
    file: ``ready`` turns True once the engine answered), and is counted against the
    budget from the load's start until its engine has stopped.
    """

    name: str
    options: dict[str, Any]  # the checked options ServerPool.start takes (no caller objects)
    checked: StartOptions
    estimate: MemoryEstimate
    keep_alive_s: float | None
    pinned: bool
    replicas: int
    capacity: int  # requests it takes at once: its slots and queues (every replica's)
    pool: ServerPool | None = None
    ready: bool = False
    generation: int = 0  # one per load: a late Loaded for an earlier engine is ignored
    leases: int = 0
    idle_since: float = 0.0  # monotonic: when it was last seen with nothing to do
    loaded_at: float = 0.0
    loads: int = 0
    last_error: str | None = None
    failed_at: float = 0.0  # monotonic: when its engine last failed (a load, a crash)

    def labels(self) -> set[str]:
        """What telemetry calls its replicas (``metadata["replica"]``, the Prometheus
        label): its name, or ``name-0`` to ``name-(n-1)`` for n replicas."""
        if self.replicas == 1:
            return {self.name}
        return {f"{self.name}-{i}" for i in range(self.replicas)}


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
    request_id: str | None = None  # refused while another model runs the same id


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    model: Model  # the lease's own model: a later one of the same name is another
    request_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Unload:
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Sweep:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Loaded:
    model: Model
    generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class Stopped:
    token: object


_VERDICT_WAIT_S = 1.0  # how long a refused request waits to learn why its engine died


def why_down(pool: ServerPool, error: EngineStopped) -> str:
    """Why a model's engine refused a request: its supervisor's verdict (a failed load
    names llama.cpp's reason), which the monitor thread gives a moment after the engine
    died; else the refusal itself (caller's thread)."""
    deadline = time.monotonic() + _VERDICT_WAIT_S
    while (
        (reason := pool.gave_up()) is None
        and pool.is_alive()
        and not pool.up()
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return reason or str(error)


def model_state(pool: ServerPool | None, ready: bool) -> str:
    """``unloaded``, ``loading`` (its engine is loading the file), ``ready``,
    ``restarting`` or ``failed`` (it died: the next request loads it again)."""
    if pool is None:
        return "unloaded"
    if pool.gave_up() is not None:
        return "failed"
    if not ready:
        return "loading"
    return "ready" if pool.up() else "restarting"


_log = logging.getLogger("llama_cpp_actors.manager")

LOAD_WAIT_S = 3600.0  # how long a load may take before the manager stops watching it


def stop_engine(pool: ServerPool, name: str, ref: pykka.ActorRef[Any], token: object) -> None:
    """Stop a model's engine (its own thread), then tell the manager its memory is free."""
    try:
        pool.stop()
    except Exception:
        _log.exception("stopping model %r failed", name)
    finally:
        tell_quietly(ref, Stopped(token))


def watch_load(ref: pykka.ActorRef[Any], model: Model, pool: ServerPool, generation: int) -> None:
    """Tell the manager when the engine has loaded its model: it answers ``GetInfo``
    only then (a thread of its own, which ends with the load)."""

    def watch() -> None:
        try:
            pool.ask(GetInfo(), timeout=LOAD_WAIT_S)
        except Exception:
            return  # it failed or was stopped: gave_up() says which
        tell_quietly(ref, Loaded(model, generation))

    threading.Thread(target=watch, name=f"llama-cpp-actors-load-{model.name}", daemon=True).start()


def tell_quietly(ref: pykka.ActorRef[Any], message: object) -> None:
    with contextlib.suppress(pykka.ActorDeadError):
        ref.tell(message)
