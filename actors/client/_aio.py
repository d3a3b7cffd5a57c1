"""asyncio helpers: ``agenerate``, ``astream``, ``achat``, ``astream_chat``, ``astream_events``.

They run on the caller's event loop and never block it: every request goes to the
engine as a stream whose ``reply_to`` hands each event to the loop with
``loop.call_soon_threadsafe`` (awaiting a pykka future would block the loop; a thread
per token would be slow). Cancelling the awaiting task cancels the request and frees
its slot, with a ``CancelExact`` naming the task's own message (as the blocking
helpers do).

``timeout`` bounds the whole await of ``agenerate``/``achat`` (a Supervisor's restart
under way too), and each next piece of ``astream``/``astream_chat``. A restart is waited
for by polling, never by blocking the loop.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import pykka

from actors.client._helpers import _RESTART_WAIT_S, _Restarting, _tell_cancel
from actors.contract import (
    Completion,
    Done,
    EngineHandle,
    EngineStopped,
    Failed,
    InvalidRequest,
    Progress,
    RequestTimeout,
    Stream,
    StreamChat,
    StreamTokens,
    Token,
)

if TYPE_CHECKING:
    import asyncio

__all__ = ["achat", "agenerate", "astream", "astream_chat", "astream_events"]

# asyncio is imported when first used, not with the package: importing it pulls in
# concurrent.futures, which a script named concurrent.py beside the caller (as
# examples/concurrent.py is) would shadow.

_LIVENESS_POLL_S = 0.25
_RESTART_POLL_S = 0.05
Event = Progress | Token | Done | Failed


class _LoopQueue:
    """A ``reply_to`` that moves events from the engine thread onto an event loop.

    ``put`` runs on the engine thread, everything else on the loop. A waiting ``get``
    is one future, woken by the event's arrival or by the channel's check timer, which
    fires at most every ``_LIVENESS_POLL_S`` while someone waits: a stream's token
    costs no task and no timer (``asyncio.wait_for`` on a ``Queue`` would make both).
    """

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        self._events: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def put(self, event: Event) -> None:
        # Raises RuntimeError once the loop is closed: the engine then cancels the request.
        self.loop.call_soon_threadsafe(self._arrive, event)

    def _arrive(self, event: Event) -> None:
        self._events.append(event)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check(self) -> None:
        self._timer = None
        self._wake()

    def get_nowait(self) -> Event | None:
        """The next event if one is waiting, else None."""
        return self._events.popleft() if self._events else None

    async def get(self, wait: float) -> Event | None:
        """The next event, or None if none came in about ``wait`` s (at most the poll)."""
        if self._events:
            return self._events.popleft()
        waiter = self.loop.create_future()
        self._waiter = waiter
        if self._timer is None or wait < _LIVENESS_POLL_S:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(wait, self._check)
        try:
            await waiter
        finally:
            self._waiter = None
        return self._events.popleft() if self._events else None

    def close(self) -> None:
        """Stop the check timer (the stream is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _target(ref: EngineHandle, deadline: float | None) -> Any:
    """As ``_helpers._target``, polling a Supervisor's restart on the loop (loop thread)."""
    if not isinstance(ref, _Restarting):
        return ref
    import asyncio

    loop = asyncio.get_running_loop()
    limit = loop.time() + _RESTART_WAIT_S if deadline is None else deadline
    while True:
        try:
            return ref.ref(0)  # never waits; EngineStopped when no actor will come
        except RequestTimeout:
            if loop.time() >= limit:
                if deadline is None:
                    raise EngineStopped(f"the engine did not come back within {_RESTART_WAIT_S} s") from None
                raise
        await asyncio.sleep(_RESTART_POLL_S)


async def _events(
    ref: EngineHandle, make: Any, timeout: float | None, *, each: bool
) -> AsyncGenerator[Event, None]:
    """The request's events; ``timeout`` bounds them all, or each one with ``each`` (loop thread)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    target = await _target(ref, deadline)
    channel = _LoopQueue()
    # The message's checks and tell()'s preparation (tokenizing, the chat template, a
    # grammar's probe) run in the calling thread: a worker thread does them, so a long
    # prompt never stalls the loop.
    telling = loop.run_in_executor(None, _build_and_tell, target, make, channel)
    try:
        message = await asyncio.shield(telling)
    except asyncio.CancelledError:
        # The task is gone but the tell may still land: cancel whatever it admits.
        telling.add_done_callback(lambda told: _cancel_if_admitted(told, target))
        raise
    except pykka.ActorDeadError as e:
        raise EngineStopped(f"the engine is not running: {e}") from None
    finished = False
    ends = message.n  # a Done or Failed for each choice
    try:
        while True:
            event = await _next(target, channel, deadline, timeout)
            if isinstance(event, Done | Failed):
                ends -= 1
                finished = ends == 0
            yield event
            if finished:
                return
            if each and timeout is not None:
                deadline = loop.time() + timeout  # the consumer's own time does not count
    finally:
        channel.close()
        if not finished:  # the task was cancelled, timed out or stopped iterating
            _tell_cancel(target, message)


def _build_and_tell(target: EngineHandle, make: Any, channel: _LoopQueue) -> Any:
    """Make the request's message and send it (a worker thread); the message."""
    message = make(channel)
    target.tell(message)
    return message


def _cancel_if_admitted(told: asyncio.Future[Any], target: EngineHandle) -> None:
    """Cancel a request whose tell finished after its task was cancelled (loop thread)."""
    if not told.cancelled() and told.exception() is None:
        _tell_cancel(target, told.result())


async def _next(
    target: EngineHandle, channel: _LoopQueue, deadline: float | None, timeout: float | None
) -> Event:
    event = channel.get_nowait()
    if event is not None:
        return event
    loop = channel.loop
    while True:
        wait = (
            _LIVENESS_POLL_S if deadline is None else max(min(_LIVENESS_POLL_S, deadline - loop.time()), 0.0)
        )
        event = await channel.get(wait)
        if event is not None:
            return event
        if deadline is not None and loop.time() >= deadline:
            raise RequestTimeout(f"nothing from the engine within {timeout} s; request cancelled")
        if not target.is_alive():
            raise EngineStopped("the engine stopped before the request finished")


def _stream_message(prompt: str | Sequence[int], options: dict[str, Any]) -> Any:
    if isinstance(prompt, str):
        return lambda channel: Stream(prompt, reply_to=channel, **options)
    return lambda channel: StreamTokens(prompt, reply_to=channel, **options)


async def _complete(
    ref: EngineHandle, make: Any, timeout: float | None
) -> Completion | tuple[Completion, ...]:
    """The Completion, or with ``n`` > 1 the tuple of them in choice order."""
    done: list[Completion] = []
    # aclosing: a task cancelled here cancels the request now, not when the loop
    # finalizes the abandoned generator.
    async with contextlib.aclosing(_events(ref, make, timeout, each=False)) as events:
        async for event in events:
            if isinstance(event, Done):
                done.append(event.completion)
            elif isinstance(event, Failed):
                raise event.error
    if not done:
        raise EngineStopped("the stream ended without a result")  # unreachable: _events ends on Done/Failed
    return done[0] if len(done) == 1 else tuple(sorted(done, key=lambda c: c.index))


def _one_text(name: str, options: Mapping[str, Any]) -> None:
    if options.get("n", 1) != 1:
        raise InvalidRequest(
            f"{name} gives one text: n must be 1 (for n > 1 use astream_events and each event's index)"
        )


async def _texts(ref: EngineHandle, make: Any, timeout: float | None) -> AsyncIterator[str]:
    async with contextlib.aclosing(_events(ref, make, timeout, each=True)) as events:
        async for event in events:
            if isinstance(event, Token):
                if event.text:
                    yield event.text
            elif isinstance(event, Failed):
                raise event.error


@overload
async def agenerate(
    ref: EngineHandle,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = ...,
    n: Literal[1] = ...,
    **options: Any,
) -> Completion: ...
@overload
async def agenerate(
    ref: EngineHandle, prompt: str | Sequence[int], *, timeout: float | None = ..., n: int, **options: Any
) -> tuple[Completion, ...]: ...
async def agenerate(
    ref: EngineHandle,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    n: int = 1,
    **options: Any,
) -> Completion | tuple[Completion, ...]:
    """Await the ``Completion`` of ``prompt``; as ``generate`` but on the event loop.

    ``timeout`` bounds the whole await, from the call to its return; when it passes the
    request is cancelled and ``RequestTimeout`` raised. With ``n`` > 1, the tuple of
    ``n`` completions in choice order.
    """
    return await _complete(ref, _stream_message(prompt, {**options, "n": n}), timeout)


def astream(
    ref: EngineHandle, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Any
) -> AsyncIterator[str]:
    """Async-iterate the text pieces of a completion; leaving the loop early cancels it.

    Invalid options raise ``InvalidRequest`` at the first iteration (``n`` > 1 at once:
    use :func:`astream_events`). ``timeout`` bounds the wait for each next piece (the
    first one's counts a restart under way too).
    """
    _one_text("astream", options)
    return _texts(ref, _stream_message(prompt, options), timeout)


@overload
async def achat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = ...,
    n: Literal[1] = ...,
    **options: Any,
) -> Completion: ...
@overload
async def achat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = ...,
    n: int,
    **options: Any,
) -> tuple[Completion, ...]: ...
async def achat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = None,
    n: int = 1,
    **options: Any,
) -> Completion | tuple[Completion, ...]:
    """Await the reply to a conversation; as ``chat`` but on the event loop (``timeout``
    and ``n`` as ``agenerate``)."""
    return await _complete(
        ref, lambda channel: StreamChat(messages, reply_to=channel, n=n, **options), timeout
    )


def astream_chat(
    ref: EngineHandle, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None, **options: Any
) -> AsyncIterator[str]:
    """Async-iterate the reply to a conversation piece by piece (``n`` must be 1)."""
    _one_text("astream_chat", options)
    return _texts(ref, lambda channel: StreamChat(messages, reply_to=channel, **options), timeout)


async def _tokens_then_done(
    ref: EngineHandle, make: Any, timeout: float | None
) -> AsyncIterator[Progress | Token | Done]:
    async with contextlib.aclosing(_events(ref, make, timeout, each=True)) as events:
        async for event in events:
            if isinstance(event, Failed):
                raise event.error
            yield event


def astream_events(
    ref: EngineHandle,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    timeout: float | None = None,
    **options: Any,
) -> AsyncIterator[Progress | Token | Done]:
    """Async-iterate a request's events: every ``Token`` (with its id and logprobs), then
    the ``Done`` that carries the ``Completion``; a failure raises its ``EngineError``.
    With ``progress=True``, ``Progress`` events come first, while the prompt is prefilled.
    With ``n`` > 1 the choices' events interleave, each with its ``index``, and the
    iteration ends after the ``n``-th ``Done``.

    For callers that need more than the text, such as an HTTP server. Give ``prompt``
    (text or token ids) or ``messages`` (a conversation for the chat template).
    Leaving the loop early cancels the request; ``timeout`` bounds the wait for each
    next event, as in :func:`astream`.

    Raises:
        InvalidRequest: neither or both of ``prompt`` and ``messages``; any invalid
            option is raised at the first iteration.
    """
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give a prompt or messages, not both")
    if messages is not None:
        chat = messages
        return _tokens_then_done(ref, lambda channel: StreamChat(chat, reply_to=channel, **options), timeout)
    assert prompt is not None
    return _tokens_then_done(ref, _stream_message(prompt, options), timeout)
