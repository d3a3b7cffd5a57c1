"""Awaiting one asked request's outcome on an event loop: ``await_outcome``.

The loop never blocks: a worker thread sends the request (tokenizing and rendering
happen there), and the engine resolves a future that wakes the loop
(``_LoopFuture``); the actor is watched while it works, and cancelling the task (or its
timeout passing) cancels the request.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import pykka

from actors.client._aio import _LIVENESS_POLL_S, _target
from actors.client._helpers import _tell_cancel
from actors.contract import AskedMessage, EngineHandle, EngineStopped, RequestTimeout, Submit

if TYPE_CHECKING:
    import asyncio

__all__ = ["await_outcome"]


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


async def await_outcome(ref: EngineHandle, message: AskedMessage, timeout: float | None, what: str) -> Any:
    """Send ``message`` and await its outcome (the loop's thread); ``what`` names it in
    a timeout's message."""
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
                raise RequestTimeout(f"no {what} within {timeout} s; request cancelled")
            await asyncio.wait({future.done}, timeout=poll)
            if not future.done.done() and not target.is_alive():
                raise EngineStopped("the engine stopped before the request finished")
        finished = True
        return future.get(timeout=0)
    finally:
        if not finished:  # cancelled, timed out, or the engine went away
            if admitting.done():
                _tell_cancel(target, message)
            else:  # the ask may still land: cancel whatever it admits
                admitting.add_done_callback(lambda _: _tell_cancel(target, message))
