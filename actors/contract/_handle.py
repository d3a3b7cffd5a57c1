"""``EngineHandle``: what every helper and the HTTP face accept as an engine.

A ServerActor's ref, a ``Supervisor``, a ``ServerPool``, a ``ModelManager`` and a
``ModelHandle`` all answer the same messages through the same two calls, so helpers
are typed against this protocol rather than against any one of them.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["EngineHandle"]


class EngineHandle(Protocol):
    """An engine as callers hold it: ``ask`` for an answer, ``tell`` without one
    (callers' threads). ``ask`` raises what the engine refused with (``block=True``) or
    returns a future (``block=False``)."""

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """Send ``message`` and wait for (or get a future of) the answer."""
        ...

    def tell(self, message: Any) -> None:
        """Send ``message``; its outcome goes where the message says (a stream's
        ``reply_to``), or nowhere."""
        ...

    def is_alive(self) -> bool:
        """Whether the engine still takes messages."""
        ...
