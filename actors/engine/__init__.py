"""The engine core: slots, the wait queue and the tick, the KV and RAM prompt caches,
batch layout, text output, and the courier that delivers stream events.

It imports the backend, the request contract, ``strategies`` and ``telemetry``; never
the actor, the caller side or scale-out, which are built on it.

``Engine`` is one idea per module, stacked so that each calls only those below it
(``.importlinter`` keeps it so):

- ``_engine``: :meth:`Engine.step`, the tick top to bottom, and the strategy's plan.
- ``_admission``: admit, queue by priority, start in a slot, cancel, expire.
- ``_forward``: one ``llama_decode``, and KV pressure (purge, split, preempt).
- ``_sampling``: sample, stream the token, stop strings, context shift.
- ``_finishing``: every way a request ends, delivered exactly once.
- ``_state``: the shared state and the telemetry it sends.
"""

from __future__ import annotations

from actors.engine._delivery import courier, settle
from actors.engine._embedding import PreparedEmbed, prepare_embed
from actors.engine._engine import Engine, EngineConfig
from actors.engine._prepare import Prepared, prepare

__all__ = [
    "Engine",
    "EngineConfig",
    "Prepared",
    "PreparedEmbed",
    "courier",
    "prepare",
    "prepare_embed",
    "settle",
]
