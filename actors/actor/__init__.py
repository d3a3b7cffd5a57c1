"""The actor: ``ServerActor`` owns one engine in its pykka thread, ``EngineRef`` prepares
requests in the caller's thread, ``Supervisor`` restarts a crashed engine, and
``estimate_memory`` says what an engine will hold before its model loads.

It imports the engine core, the backend and the request contract (and ``strategies``,
``telemetry``); never the caller side or scale-out.
"""

from __future__ import annotations

from actors.actor._estimate import MemoryEstimate, estimate_memory, estimate_options, kv_file_bound
from actors.actor._options import OPTION_NAMES, ServerOptions, StartOptions, check_options
from actors.actor._server import ServerActor
from actors.actor._supervisor import Supervisor

__all__ = [
    "OPTION_NAMES",
    "MemoryEstimate",
    "ServerActor",
    "ServerOptions",
    "StartOptions",
    "Supervisor",
    "check_options",
    "estimate_memory",
    "estimate_options",
    "kv_file_bound",
]
