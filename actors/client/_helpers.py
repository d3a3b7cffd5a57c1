"""Blocking helpers for callers' threads: ``generate()`` and ``stream()``.

They run in the caller's thread, never in the actor's. Both watch the actor while they
wait, so a caller never hangs on an engine that died, and both cancel their request
when they give up (timeout, or a stream consumer that stops early).

A ``timeout`` bounds everything the caller waits for: a Supervisor's restart under
way, admission (``ask(..., block=False)``, so an engine stuck in a long tick cannot
hold the caller), then the result. The cancel they send is a ``CancelExact`` naming
their own message: a late one (an abandoned stream collected long after) never hits a
newer request that reuses the id.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, overload, runtime_checkable

import pykka

from actors.contract import (
    AdmittedMessage,
    AskedMessage,
    CancelExact,
    Chat,
    Completion,
    Done,
    EngineHandle,
    EngineStopped,
    Failed,
    Generate,
    GenerateTokens,
    InvalidRequest,
    Progress,
    RequestTimeout,
    Stream,
    StreamChat,
    StreamTokens,
    Token,
)

__all__ = ["chat", "generate", "stream", "stream_chat"]

T = TypeVar("T")

# How often a waiting helper checks that the actor is still alive.
_LIVENESS_POLL_S = 0.25


# As Supervisor.actor_ref, for a call without a timeout.
_RESTART_WAIT_S = 60.0


@runtime_checkable
class _Restarting(Protocol):
    """A handle whose actor may be restarting: a ``Supervisor``.

    Methods only: ``isinstance`` on a runtime protocol reads every member, and reading
    a property such as ``actor_ref`` would wait for the restart.
    """

    def ref(self, timeout: float | None = ...) -> pykka.ActorRef[Any]: ...

    def current(self) -> pykka.ActorRef[Any] | None: ...


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _tell_cancel(ref: EngineHandle, message: AdmittedMessage) -> None:
    """Cancel the request admitted from ``message``, and no other with its id (any thread)."""
    # A dead engine or a stopped pool has nothing to cancel.
    with contextlib.suppress(pykka.ActorDeadError, EngineStopped):
        ref.tell(CancelExact(message.request_id, message))


def _target(ref: EngineHandle, deadline: float | None = None) -> Any:
    """The actor a request goes to: a Supervisor's current actor, or the ref itself.

    A request is watched on the actor that took it, so a helper never waits on a
    future of an engine that died while a supervisor already started the next one.
    A restart under way is waited for until ``deadline`` (``RequestTimeout``), or up
    to the supervisor's own limit without one (``EngineStopped``).
    """
    if not isinstance(ref, _Restarting):
        return ref
    if deadline is not None:
        return ref.ref(_remaining(deadline))
    try:
        return ref.ref(_RESTART_WAIT_S)
    except RequestTimeout as e:
        raise EngineStopped(str(e)) from None


@overload
def generate(
    ref: EngineHandle,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = ...,
    n: Literal[1] = ...,
    **options: Any,
) -> Completion: ...
@overload
def generate(
    ref: EngineHandle, prompt: str | Sequence[int], *, timeout: float | None = ..., n: int, **options: Any
) -> tuple[Completion, ...]: ...
def generate(
    ref: EngineHandle,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    n: int = 1,
    **options: Any,
) -> Completion | tuple[Completion, ...]:
    """Complete ``prompt`` (text or token ids) and wait for the ``Completion``.

    With ``n`` > 1 the prompt is prefilled once and ``n`` completions are sampled, each
    on its own (seed + i when a seed is given): the tuple of them, in choice order.

    Args:
        ref: the server: a ServerActor's ref, a ``Supervisor`` or a ``ServerPool``.
        prompt: text, or a list of token ids.
        timeout: seconds to wait in all, from the call to its return: a restart under
            way, admission and the completion; when it passes the request is cancelled
            and ``RequestTimeout`` raised.
        **options: any ``Generate`` option (``max_tokens``, ``temp``, ...).

    Raises:
        InvalidRequest, QueueFull: at admission. EngineError: the request failed.
    """
    message = (
        Generate(prompt, n=n, **options)
        if isinstance(prompt, str)
        else GenerateTokens(prompt, n=n, **options)
    )
    completion: Completion | tuple[Completion, ...] = _complete(ref, message, timeout)
    return completion


@overload
def chat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = ...,
    n: Literal[1] = ...,
    **options: Any,
) -> Completion: ...
@overload
def chat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = ...,
    n: int,
    **options: Any,
) -> tuple[Completion, ...]: ...
def chat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = None,
    n: int = 1,
    **options: Any,
) -> Completion | tuple[Completion, ...]:
    """Complete a conversation (rendered with the model's chat template) and wait.

    ``messages`` are ``{"role": "system" | "user" | "assistant", "content": str}``
    dicts; everything else (``n`` too) is as :func:`generate`.
    """
    completion: Completion | tuple[Completion, ...] = _complete(ref, Chat(messages, n=n, **options), timeout)
    return completion


def _complete(
    ref: EngineHandle, message: AskedMessage, timeout: float | None, what: str = "completion"
) -> Any:
    """Admit ``message`` and wait for its outcome (a Completion, its tuple, an Embed's
    Embeddings, a Decide's Decision), watching the actor; cancel it when ``timeout``
    passes."""
    deadline = _deadline(timeout)
    target = _target(ref, deadline)
    timed_out = f"no {what} within {timeout} s; request cancelled"
    try:
        # Not a blocking ask: an engine busy in a long tick (or stuck) answers the
        # admission only after it, and the caller's timeout counts that wait too.
        admitted = target.ask(message, block=False, timeout=_remaining(deadline))
        future = _wait_for(
            target, lambda wait: admitted.get(timeout=wait), pykka.Timeout, deadline, timed_out
        )  # fmt: skip
        outcome = _wait_for(target, lambda wait: future.get(timeout=wait), pykka.Timeout, deadline, timed_out)
    except RequestTimeout:
        _tell_cancel(target, message)  # it may have been admitted meanwhile
        raise
    except pykka.ActorDeadError as e:
        raise EngineStopped(f"the engine is not running: {e}") from None
    return outcome


def _wait_for(
    ref: EngineHandle,
    get: Callable[[float], T],
    empty: type[Exception],
    deadline: float | None,
    timeout_message: str,
) -> T:
    """Call ``get(wait)`` until it returns, watching the actor and the deadline.

    ``get`` raises ``empty`` when nothing arrived within ``wait`` seconds. Runs in the
    caller's thread.

    Raises:
        RequestTimeout: ``deadline`` (a ``time.monotonic()`` value) passed.
        EngineStopped: the actor stopped while nothing had arrived.
    """
    while True:
        wait = _LIVENESS_POLL_S
        if deadline is not None:
            wait = max(min(wait, deadline - time.monotonic()), 0.0)
        try:
            return get(wait)
        except empty:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            raise RequestTimeout(timeout_message)
        if not ref.is_alive():
            raise EngineStopped("the engine stopped before the request finished")


def stream(
    ref: EngineHandle,
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Iterator[str]:
    """Stream the text of a completion piece by piece.

    Closing the iterator early (``break``, ``close()``, garbage collection) cancels
    the request.

    Args:
        ref: the server: a ServerActor's ref, a ``Supervisor`` or a ``ServerPool``.
        prompt: text, or a list of token ids.
        timeout: the most seconds to wait for each next piece (the first one's wait
            counts a restart under way too); when it passes the request is cancelled
            and ``RequestTimeout`` raised.
        **options: any ``Stream`` option (``max_tokens``, ``temp``, ...).
    """
    events: queue.Queue[Progress | Token | Done | Failed] = queue.Queue()
    if isinstance(prompt, str):
        message: Stream | StreamTokens | StreamChat = Stream(prompt, reply_to=events, **options)
    else:
        message = StreamTokens(prompt, reply_to=events, **options)
    return _stream_events(ref, message, events, timeout)


def stream_chat(
    ref: EngineHandle,
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Iterator[str]:
    """Stream the reply to a conversation piece by piece; as :func:`stream` otherwise."""
    events: queue.Queue[Progress | Token | Done | Failed] = queue.Queue()
    message = StreamChat(messages, reply_to=events, **options)
    return _stream_events(ref, message, events, timeout)


def _stream_events(
    ref: EngineHandle,
    message: Stream | StreamTokens | StreamChat,
    events: queue.Queue[Progress | Token | Done | Failed],
    timeout: float | None,
) -> Iterator[str]:
    if message.n != 1:
        raise InvalidRequest(
            "stream gives one text: n must be 1 (for n > 1 send Stream(..., n=) and read each event's index)"
        )
    deadline = _deadline(timeout)  # the first piece's wait counts a restart under way
    target = _target(ref, deadline)
    try:
        target.tell(message)
    except pykka.ActorDeadError as e:
        raise EngineStopped(f"the engine is not running: {e}") from None
    finished = False
    try:
        while True:
            event = _wait_for(
                target, lambda wait: events.get(timeout=wait), queue.Empty, deadline,
                f"no token within {timeout} s; request cancelled",
            )  # fmt: skip
            if isinstance(event, Token):
                if event.text:
                    yield event.text
                    deadline = _deadline(timeout)  # the consumer's own time does not count
            elif isinstance(event, Done):
                finished = True
                return
            elif isinstance(event, Failed):
                finished = True
                raise event.error
            # else a Progress (the option progress=True): no text, nothing to yield
    finally:
        if not finished:
            _tell_cancel(target, message)
