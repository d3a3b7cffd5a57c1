"""``EngineRef``: the ``pykka.ActorRef`` of a ServerActor, which prepares requests itself.

``ServerActor.start()`` returns one. It is an ``ActorRef`` in every way, with two
additions that run in the sender's thread:

- a request (``Generate``, ``Stream``, ``Chat``, ...) is tokenized, its chat template
  rendered and its grammar checked here (:func:`actors.engine._prepare.prepare`), so a long
  prompt costs its sender's thread, not the engine thread every tenant shares;
- what it sends says whether it was told or asked (``_Admit.told``, ``_Told``): pykka
  stops an actor when a told message raises, so the actor must know which failures it
  may raise and which it must turn into the request's own outcome.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pykka

from actors.contract import (
    STREAMING,
    AdmittedMessage,
    ControlMessage,
    Decide,
    Embed,
    EngineError,
    Submit,
)
from actors.engine import Prepared, PreparedDecision, PreparedEmbed, prepare, prepare_decision, prepare_embed

if TYPE_CHECKING:
    from actors.backend import LlamaBackend

__all__ = ["EngineRef"]


@dataclass(frozen=True, slots=True)
class _Tick:
    """The message the actor sends itself while there is work."""


TICK = _Tick()


@dataclass(frozen=True, slots=True)
class _Told:
    """A message that was told, not asked: the actor must not raise for it."""

    message: object


@dataclass(frozen=True, slots=True)
class _Admit:
    """A request on its way to admission, prepared in the sender's thread when possible.

    ``prepared`` is None when the model was not loaded yet (the actor prepares it);
    ``error`` is why preparing failed, delivered by the actor as the request's outcome
    (a stream's ``Failed``, a future's exception). ``future`` is a pool's ``Submit``
    future.
    """

    message: AdmittedMessage
    prepared: Prepared | PreparedEmbed | PreparedDecision | None
    error: EngineError | None
    future: pykka.ThreadingFuture[object] | None
    told: bool


class EngineRef(pykka.ActorRef[Any]):
    """The ref of a ServerActor: ``ask``/``tell`` prepare requests in the caller's thread."""

    def __init__(self, actor: Any) -> None:
        super().__init__(actor)
        self.backend: LlamaBackend | None = None
        """The loaded model, set by the actor once it is loaded and cleared at stop."""
        self.n_ctx_slot: int | None = None
        """A slot's context, set with ``backend``: longer prompts are refused here."""
        self.thread_ident: int | None = None
        """The actor thread's ident, set once it runs: it may never ask itself."""

    def tell(self, message: Any) -> None:
        """``ActorRef.tell``; a request is prepared first (caller's thread)."""
        super().tell(message if message is TICK else self._wrap(message, told=True))

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        """``ActorRef.ask``; a request is prepared first, and one that cannot be prepared
        raises here (or, with ``block=False``, comes back as a failed future).

        A callback that runs in the engine thread (a telemetry receiver, a ``reply_to``)
        may not ask its own engine: the reply could only come from the thread that
        waits for it. That raises ``EngineError`` at once instead of deadlocking.
        """
        try:
            if threading.get_ident() == self.thread_ident:
                raise EngineError(
                    "a callback running in the engine's thread cannot ask its own engine "
                    "(it would wait for itself); tell it, or ask from another thread"
                )
            wrapped = self._wrap(message, told=False)
        except EngineError as error:
            if block:
                raise
            future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
            future.set_exception(exc_info=(type(error), error, None))
            return future
        return super().ask(wrapped, block=block, timeout=timeout)

    def _wrap(self, message: Any, *, told: bool) -> Any:
        request: AdmittedMessage
        if isinstance(message, Submit):
            request, future = message.message, message.future
        elif isinstance(message, AdmittedMessage):
            request, future = message, None
        else:
            # Only our own messages: pykka's (its stop message, proxies' calls) pass as they are.
            return _Told(message) if told and isinstance(message, ControlMessage) else message
        prepared: Prepared | PreparedEmbed | PreparedDecision | None = None
        error: EngineError | None = None
        backend, limit = self.backend, self.n_ctx_slot
        if backend is not None and limit is not None:
            try:
                if isinstance(request, Embed):
                    prepared = prepare_embed(backend, request, limit)
                elif isinstance(request, Decide):
                    prepared = prepare_decision(backend, request, limit)
                else:
                    prepared = prepare(backend, request, limit)
            except EngineError as e:
                if not told and not isinstance(request, STREAMING):
                    raise  # an asked Generate or pool submit: the caller gets it now
                error = e
        return _Admit(request, prepared, error, future, told)
