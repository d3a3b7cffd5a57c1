"""Embedding helpers: ``embed()`` (blocking) and ``aembed()`` (asyncio).

Both send one ``Embed`` and return its vectors, a float32 ``numpy.ndarray`` of shape
``(len(texts), n_embd)``, from any handle: a ServerActor's ref, a ``Supervisor``, a
``ServerPool``. ``embed`` runs in the caller's thread and waits as ``generate`` does
(watching the actor, cancelling on timeout). ``aembed`` never blocks the loop: a worker
thread makes and sends the request (tokenizing happens there), and the engine resolves
a future that wakes the loop (``_LoopFuture``); cancelling the task cancels the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pykka

from actors.client._aio import _LIVENESS_POLL_S, _target
from actors.client._helpers import _complete, _tell_cancel
from actors.contract import Embed, Embeddings, EngineHandle, EngineStopped, Pooling, RequestTimeout, Submit

if TYPE_CHECKING:
    import asyncio

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


class _LoopFuture(pykka.ThreadingFuture[Any]):
    """A pykka future that, once set (in the engine's thread), wakes an event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.done = loop.create_future()

    def set(self, value: Any | None = None) -> None:
        super().set(value)
        self._wake()

    def set_exception(self, exc_info: Any = None) -> None:
        super().set_exception(exc_info)
        self._wake()

    def _wake(self) -> None:
        # RuntimeError once the loop is closed: nobody awaits the result any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._arrive)

    def _arrive(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


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
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    target = await _target(ref, deadline)
    future = _LoopFuture(loop)
    wait = None if deadline is None else max(deadline - loop.time(), 0.0)
    # Tokenizing happens in the sending thread: a worker thread, never the loop.
    admitting = loop.run_in_executor(None, lambda: target.ask(Submit(message, future), timeout=wait))
    finished = False
    try:
        try:
            await asyncio.shield(admitting)
        except pykka.ActorDeadError as e:
            raise EngineStopped(f"the engine is not running: {e}") from None
        except pykka.Timeout:
            raise RequestTimeout(f"the request was not admitted within {timeout} s; cancelled") from None
        while not future.done.done():
            poll = _LIVENESS_POLL_S if deadline is None else min(_LIVENESS_POLL_S, deadline - loop.time())
            if poll <= 0:
                raise RequestTimeout(f"no embeddings within {timeout} s; request cancelled")
            await asyncio.wait({future.done}, timeout=poll)
            if not future.done.done() and not target.is_alive():
                raise EngineStopped("the engine stopped before the request finished")
        finished = True
        embeddings: Embeddings = future.get(timeout=0)
        return embeddings
    finally:
        if not finished:  # cancelled, timed out, or the engine went away
            if admitting.done():
                _tell_cancel(target, message)
            else:  # the ask may still land: cancel whatever it admits
                admitting.add_done_callback(lambda _: _tell_cancel(target, message))
