"""The engine core: slots, the wait queue and the tick, the KV and RAM prompt caches,
batch layout, text output, and the courier that delivers stream events.

It imports the backend, the request contract, ``strategies`` and ``telemetry``; never
the actor, the caller side or scale-out, which are built on it.

``Engine`` composes parts of one idea each, over one shared state; each calls only the
parts below it (``.importlinter`` keeps it so), and a tick reads plan → execute → update:

- ``_engine``: :meth:`Engine.step`, the tick top to bottom, and ``stats``.
- ``_scheduler``: admit, queue by priority, start in a slot, cancel, expire, and the
  strategy's plan (plain data); ``_drafting``: speculation's side of the plan.
- ``_runner``: the plan laid out, one ``llama_decode``, and KV pressure (purge, split,
  preempt).
- ``_output_stage``: record, sample, stream, stop strings, context shift; ``_closing``:
  the tokens that end a reply in time.
- ``_lifecycle``: a request entering a slot, and every way it ends, delivered exactly once.
- ``_decisions``: a ``Decide`` as a leader that prefills the state and one request
  per question over its cells, each read from its labels' logits.
- ``_embed_pass``: a tick's embedding pass, priced against generation.
- ``_slot_files``: a slot's tokens and KV saved to a file and restored, between ticks
  (``_kv_format``: the file, checked before it is read).
- ``_state``: the shared state and the telemetry it sends.
"""

from __future__ import annotations

from actors.engine._decisions import PreparedDecision, prepare_decision
from actors.engine._delivery import courier, settle
from actors.engine._embedding import PreparedEmbed, prepare_embed
from actors.engine._engine import Engine, EngineConfig
from actors.engine._prepare import Prepared, prepare

__all__ = [
    "Engine",
    "EngineConfig",
    "Prepared",
    "PreparedDecision",
    "PreparedEmbed",
    "courier",
    "prepare",
    "prepare_decision",
    "prepare_embed",
    "settle",
]
