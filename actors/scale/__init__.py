"""Scale-out: ``ServerPool`` spreads requests over several engines (threads in this
process, or Ray actors on other processes and nodes) with a router and replicas;
``ModelManager`` serves several named models, loaded on demand under a memory budget.

It is the top layer of the engine: it may import every layer below (the actor, the
engine core, the backend, the contract), and nothing imports it but ``actors``.
"""

from __future__ import annotations

from actors.scale._handle import ModelHandle
from actors.scale._manager import ModelManager
from actors.scale._pool import ServerPool

__all__ = [
    "ModelHandle",
    "ModelManager",
    "ServerPool",
]
