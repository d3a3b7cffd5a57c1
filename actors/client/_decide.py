"""Decision helpers: ``decide()`` (blocking) and ``adecide()`` (asyncio).

Both send one ``Decide`` and return its ``Decision``, from any handle: a ServerActor's
ref, a ``Supervisor``, a ``ServerPool``, a ``ModelManager``. ``decide`` runs in the
caller's thread and waits as ``generate`` does (watching the actor, cancelling on
timeout); ``adecide`` never blocks the loop (the questions are rendered in a worker
thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.client._helpers import _complete
from actors.client._outcome import await_outcome
from actors.contract import Decide, Decision, EngineHandle

__all__ = ["adecide", "adecide_result", "decide", "decide_result"]


def decide(
    ref: EngineHandle,
    state: Any,
    questions: Mapping[str, Any],
    timeout: float | None = None,
    **options: Any,
) -> Decision:
    """Answer ``questions`` about ``state`` and wait for the ``Decision`` (the caller's thread).

    Args:
        ref: the server: a ServerActor's ref, a ``Supervisor``, a ``ServerPool`` or a
            ``ModelManager`` (name the model with ``model=``).
        state: text, or a JSON object or list.
        questions: names to questions (``Question`` objects or System One dicts).
        timeout: seconds to wait in all; when it passes the request is cancelled and
            ``RequestTimeout`` raised.
        **options: the other fields of :class:`~actors.contract.Decide`
            (``template_kwargs``, ``model``, ``priority``, ``deadline_s``, ...).

    Raises:
        InvalidRequest: a question this model cannot answer (the reason named).
        PromptTooLong: the state does not fit a slot's context.
        QueueFull, EngineError: as ``generate``.
    """
    return decide_result(ref, Decide(state, questions, **options), timeout)


def decide_result(ref: EngineHandle, message: Decide, timeout: float | None = None) -> Decision:
    """Send a ``Decide`` made already and wait for its ``Decision`` (the caller's thread)."""
    decision: Decision = _complete(ref, message, timeout, "decision")
    return decision


async def adecide(
    ref: EngineHandle,
    state: Any,
    questions: Mapping[str, Any],
    timeout: float | None = None,
    **options: Any,
) -> Decision:
    """Await the ``Decision`` of ``questions`` about ``state``; as :func:`decide`, on the
    event loop (cancelling the task cancels the request)."""
    return await adecide_result(ref, Decide(state, questions, **options), timeout)


async def adecide_result(ref: EngineHandle, message: Decide, timeout: float | None = None) -> Decision:
    """Send a ``Decide`` made already and await its ``Decision`` (the loop's thread)."""
    decision: Decision = await await_outcome(ref, message, timeout, "decision")
    return decision
