"""What a request's sampling and its stream are: :class:`SamplingParams` (resolved
against the server's defaults) and :class:`ReplyTo`, where a stream's events go.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

from actors.contract._checks import _checked_sampling

__all__ = ["ReplyTo", "SamplingParams", "put_nowait"]


class ReplyTo(Protocol):
    """Where a stream's events go: anything with ``put()``, e.g. ``queue.Queue``.

    The engine calls ``put_nowait`` when the object has it, else ``put``, from its own
    thread: it must not block. ``queue.Full`` means "not now": the event is held and
    retried (see :mod:`actors.engine._delivery`); any other exception means the consumer is
    gone and the request is cancelled.
    """

    def put(self, item: Any, /) -> Any:
        """Take one event (a ``Progress``, ``Token``, ``Done`` or ``Failed``) without blocking."""
        ...


def put_nowait(reply_to: ReplyTo, event: object) -> None:
    """Put ``event`` without waiting: ``put_nowait`` when the reply path has it (a full
    bounded queue then raises instead of blocking the engine), else ``put``."""
    put: Callable[[object], object] = getattr(reply_to, "put_nowait", None) or reply_to.put
    put(event)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling options of a request, resolved against the server's defaults.

    ``temp=0`` is greedy; ``seed=None`` draws a fresh random seed per request.
    """

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    grammar: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _checked_sampling(f.name, getattr(self, f.name)))

    def merged(self, overrides: Any) -> SamplingParams:
        """These defaults with every option the request (a request message) sets, not
        ``None``, replaced."""
        changes = {
            f.name: getattr(overrides, f.name) for f in fields(self) if getattr(overrides, f.name) is not None
        }
        if not changes:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)
