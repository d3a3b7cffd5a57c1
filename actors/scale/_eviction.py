"""Which models a ModelManager unloads to load another: a pure policy over the models'
state (the manager's thread calls it; it changes nothing).

Idle models go first, least recently used first, until the new model fits the memory
budget and ``max_models``; a model that is pinned, leased, loading or has requests in
flight is never chosen, and an engine that gave up always may be.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.contract import MemoryBudgetExceeded, ModelLoadError
from actors.scale._models import Model
from actors.scale._pool import ServerPool

__all__ = ["evictable", "in_flight", "victims"]


def in_flight(pool: ServerPool) -> int:
    """The requests a model's pool runs or queues now."""
    return sum(pool.router.loads().values())


def evictable(model: Model) -> bool:
    """Whether ``model`` may be unloaded for room now."""
    pool = model.pool
    if pool is None or model.pinned or model.leases:
        return False
    if pool.gave_up() is not None:
        return True  # a failed engine holds nothing worth keeping
    return model.ready and in_flight(pool) == 0  # a loading engine would stop only once loaded


def victims(
    model: Model,
    needed: float,
    models: Iterable[Model],
    held: float,
    loaded: int,
    budget_mb: float,
    max_models: int,
) -> list[Model]:
    """The idle models to unload, least recently used first, for ``needed`` MiB and a
    place under ``max_models`` (0: no limit), when ``held`` MiB and ``loaded`` engines are taken now.

    Raises:
        ModelLoadError: ``max_models`` are loaded and none is idle.
        MemoryBudgetExceeded: even unloading every idle model would not make it fit.
    """
    models = list(models)
    idle = sorted((m for m in models if m.pool is not None and evictable(m)), key=lambda m: m.idle_since)
    chosen: list[Model] = []
    for victim in idle:
        if held + needed <= budget_mb and (not max_models or loaded < max_models):
            break
        chosen.append(victim)
        held -= victim.estimate.total_mb
        loaded -= 1
    busy = [m.name for m in models if m.pool is not None and m not in chosen]
    # Worth waiting for: busy models that are not pinned, if their going idle (and then
    # unloading) would make the room; a model that could never fit is refused at once.
    waiting = [
        m for m in models if m.pool is not None and m is not model and not m.pinned and m not in chosen
    ]
    room_later = bool(waiting) and held - sum(m.estimate.total_mb for m in waiting) + needed <= budget_mb
    if max_models and loaded >= max_models:
        raise _held(
            ModelLoadError(
                f"model {model.name!r} cannot load: {loaded} models are loaded (max_models="
                f"{max_models}) and none is idle ({', '.join(busy)})"
            ),
            room_later,
        )
    if held + needed > budget_mb:
        raise _held(
            MemoryBudgetExceeded(
                f"model {model.name!r} needs about {needed:.0f} MiB, but {held:.0f} MiB of the "
                f"{budget_mb:.0f} MiB budget is held by models in use, loading or pinned "
                f"({', '.join(busy)})",
                needed_mb=needed,
                budget_mb=budget_mb,
                held_mb=held,
            ),
            room_later,
        )
    return chosen


def _held(error: ModelLoadError, room_later: bool) -> ModelLoadError:
    """``error``, marked ``room_held`` when busy models that may go idle hold the room the
    model needs: the request may wait for them (``wait_s``)."""
    error.room_held = room_later  # type: ignore[attr-defined]
    return error
