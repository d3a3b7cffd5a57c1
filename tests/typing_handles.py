"""Static checks, run by mypy in ``make lint`` (not a test module): every engine handle
is an ``EngineHandle``, and the fake backend is a ``Backend``."""

from __future__ import annotations

from fake_backend import FakeBackend

from actors import ModelHandle, ModelManager, ServerPool, Supervisor
from actors.actor._ref import EngineRef
from actors.backend import Backend
from actors.contract import EngineHandle


def handles(
    ref: EngineRef, supervisor: Supervisor, pool: ServerPool, manager: ModelManager, handle: ModelHandle
) -> list[EngineHandle]:
    return [ref, supervisor, pool, manager, handle]


def backend(fake: FakeBackend) -> Backend:
    return fake
