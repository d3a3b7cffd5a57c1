"""The engine core: slots, the wait queue and the tick (admission, batch layout, one
forward pass, sampling, KV pressure, finishing), the KV and RAM prompt caches, text
output and the courier that delivers stream events.

It imports the backend, the request contract, ``strategies`` and ``telemetry``; never
the actor, the caller side or scale-out, which are built on it.
"""

from __future__ import annotations

from actors.engine._engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
