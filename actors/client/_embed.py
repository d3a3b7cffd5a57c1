"""Embedding helpers: ``embed()`` (blocking) and ``aembed()`` (asyncio).

Both send one ``Embed`` and return its vectors, a float32 ``numpy.ndarray`` of shape
``(len(texts), n_embd)``, from any handle: a ServerActor's ref, a ``Supervisor``, a
``ServerPool``. ``embed`` runs in the caller's thread and waits as ``generate`` does
(watching the actor, cancelling on timeout); ``aembed`` awaits it as
:func:`~actors.client._outcome.await_outcome` does, never blocking the loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from actors.client._helpers import _complete
from actors.client._outcome import await_outcome
from actors.contract import Embed, Embeddings, EngineHandle, Pooling

__all__ = ["aembed", "embed"]


def embed(
    ref: EngineHandle,
    texts: str | Sequence[str | Sequence[int]],
    model: str | None = None,
    normalize: bool = True,
    pooling: Pooling | None = None,
    timeout: float | None = None,
) -> npt.NDArray[np.float32]:
    """Embed ``texts`` and wait for the vectors (the caller's thread).

    Args:
        ref: the server: a ServerActor's ref, a ``Supervisor`` or a ``ServerPool``.
        texts: strings, or lists of token ids; or one string.
        model: which model, for a handle that serves several.
        normalize: scale each vector to unit length.
        pooling: ``"mean"``, ``"cls"`` or ``"last"``; None takes the model's own, else mean.
        timeout: seconds to wait in all; when it passes the request is cancelled and
            ``RequestTimeout`` raised.

    Returns:
        float32, shape ``(len(texts), n_embd)``, read-only; for one string, its vector,
        shape ``(n_embd,)``.

    Raises:
        InvalidRequest: bad texts or options (an empty list, an empty text...).
        QueueFull, EngineError: as ``generate``.
    """
    message = Embed(
        [texts] if isinstance(texts, str) else texts, model=model, normalize=normalize, pooling=pooling
    )
    vectors = embed_result(ref, message, timeout).vectors
    return vectors[0] if isinstance(texts, str) else vectors


def embed_result(ref: EngineHandle, message: Embed, timeout: float | None = None) -> Embeddings:
    """Send ``message`` and wait for its whole ``Embeddings`` (token counts too)."""
    result: Embeddings = _complete(ref, message, timeout, "embeddings")
    return result


async def aembed(
    ref: EngineHandle,
    texts: str | Sequence[str | Sequence[int]],
    model: str | None = None,
    normalize: bool = True,
    pooling: Pooling | None = None,
    timeout: float | None = None,
) -> npt.NDArray[np.float32]:
    """Await the vectors of ``texts``; as :func:`embed`, on the event loop."""
    message = Embed(
        [texts] if isinstance(texts, str) else texts, model=model, normalize=normalize, pooling=pooling
    )
    vectors = (await aembed_result(ref, message, timeout)).vectors
    return vectors[0] if isinstance(texts, str) else vectors


async def aembed_result(ref: EngineHandle, message: Embed, timeout: float | None = None) -> Embeddings:
    """Send ``message`` and await its whole ``Embeddings`` (the loop's thread)."""
    embeddings: Embeddings = await await_outcome(ref, message, timeout, "embeddings")
    return embeddings
