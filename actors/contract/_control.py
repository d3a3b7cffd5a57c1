"""Control messages: cancelling, draining, asking for stats, info or a tokenizer,
and the internal ones the helpers and pools send. Frozen, checked on creation (the
caller's thread), like the request messages of :mod:`actors.contract._messages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.contract._checks import MAX_ID_LENGTH, _checked_float, _require, _show, checked_text
from actors.contract._decide import Decide
from actors.contract._embed import Embed
from actors.contract._lora import GetLora, SetLora
from actors.contract._messages import RequestMessage, SubmitMessage
from actors.contract._slot_files import EraseSlot, RestoreSlot, SaveSlot

if TYPE_CHECKING:
    import pykka

__all__ = [
    "AdmittedMessage",
    "AskedMessage",
    "Cancel",
    "CancelExact",
    "ControlMessage",
    "Drain",
    "GetInfo",
    "GetStats",
    "GetTokenizer",
    "Submit",
]

AskedMessage = SubmitMessage | Embed | Decide
"""The requests answered with a future of their outcome (a ``Completion``, its tuple,
the ``Embeddings``, the ``Decision``)."""
AdmittedMessage = RequestMessage | Embed | Decide
"""Every request an engine admits: the asked ones and the streams."""


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel a queued or running request; unknown ids are ignored."""

    request_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_id", checked_text("request_id", self.request_id, MAX_ID_LENGTH))


@dataclass(frozen=True, slots=True)
class CancelExact:
    """Internal: cancel ``request_id`` only if it runs the request admitted from ``message``.

    The helpers cancel their own request with it: a late cancel (an abandoned stream
    iterator collected long after) must not hit a newer request that reuses the id.
    """

    request_id: str
    message: object


@dataclass(frozen=True, slots=True)
class GetStats:
    """Ask for a dict of the engine's current load."""


@dataclass(frozen=True, slots=True)
class GetInfo:
    """Ask for a dict describing the loaded model and context."""


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop taking requests, finish the running and queued ones, then stop the actor.

    ``ref.ask(Drain(timeout=30))`` returns a Future that resolves (to the number of
    requests that were still unfinished and got ``EngineStopped``) once the actor stops.
    """

    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            timeout = _checked_float("Drain timeout", self.timeout)
            _require(timeout >= 0, f"Drain timeout must be >= 0 seconds or None, got {_show(self.timeout)}")
            object.__setattr__(self, "timeout", timeout)


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit ``message`` (Generate, GenerateTokens, Chat, Embed or Decide) and complete ``future``.

    Internal: a ``ServerPool`` passes the future it hands to its caller, so it learns
    when the request ends without a thread per request. ``ask`` answers None once admitted.
    """

    message: AskedMessage
    future: pykka.ThreadingFuture[object]

    @property
    def model(self) -> str | None:
        """The model its request names, if any (a ``ModelManager`` routes by it)."""
        model: str | None = getattr(self.message, "model", None)
        return model


@dataclass(frozen=True, slots=True)
class GetTokenizer:
    """Ask for an ``actors.Tokenizer`` that tokenizes in the caller's thread."""


ControlMessage = (
    Cancel
    | CancelExact
    | GetStats
    | GetInfo
    | GetTokenizer
    | GetLora
    | SetLora
    | SaveSlot
    | RestoreSlot
    | EraseSlot
    | Drain
)
"""Every message a caller sends that is no request: an engine answers each when asked,
and logs the failure of one told (a told message never takes the engine down); a
``ModelManager`` answers each itself or routes it to a model."""
