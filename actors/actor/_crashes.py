"""Why ServerActors died, and stopping the live ones at exit (any thread).

A Supervisor reads :func:`crash_reason` to tell a crash from a stop; the actor records
its reason before it dies.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref

import pykka

__all__ = ["TickCrashed", "crash_reason", "crashes", "live_servers", "why_died"]


class TickCrashed(Exception):
    """A tick raised a BaseException (``sys.exit()`` in a callback, say): pykka would stop
    every actor of the process for it; as an Exception it crashes only this engine."""


live_servers: weakref.WeakSet[pykka.ThreadingActor] = weakref.WeakSet()  # ServerActors
# Why an actor died, by actor URN: a Supervisor reads it to tell a crash from a stop.
crashes: dict[str, str] = {}


def why_died(actor_urn: str) -> str | None:
    """Why the actor with this URN crashed, if it recorded it, without taking the record
    (a Supervisor's monitor takes it; any thread)."""
    return crashes.get(actor_urn)


def crash_reason(actor_urn: str) -> str | None:
    """Why the actor with this URN crashed, or None if it stopped on request (any thread)."""
    return crashes.pop(actor_urn, None)


@atexit.register
def _stoplive_servers() -> None:
    # The actor threads are daemons so a forgotten server never hangs interpreter
    # exit; stop them here so llama.cpp is not torn down in the middle of a decode.
    for server in list(live_servers):
        with contextlib.suppress(Exception):  # best effort at exit
            server.actor_ref.stop(block=True, timeout=5)
