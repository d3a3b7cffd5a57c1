"""Blocking helpers for callers' threads: ``generate()`` and ``stream()``.

They run in the caller's thread, never in the actor's. Both watch the actor while they
wait, so a caller never hangs on an engine that died, and both cancel their request
when they give up (timeout, or a stream consumer that stops early).
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import pykka

from actors._errors import EngineStopped, RequestTimeout
from actors._messages import (
    Cancel,
    Chat,
    Generate,
    GenerateTokens,
    Stream,
    StreamChat,
    StreamTokens,
    SubmitMessage,
)
from actors._results import Completion, Done, Failed, Token

__all__ = ["chat", "generate", "stream", "stream_chat"]

T = TypeVar("T")

# How often a waiting helper checks that the actor is still alive.
_LIVENESS_POLL_S = 0.25


def _tell_cancel(ref: pykka.ActorRef[Any], request_id: str) -> None:
    with contextlib.suppress(pykka.ActorDeadError):  # a dead engine has nothing to cancel
        ref.tell(Cancel(request_id))


def _target(ref: Any) -> pykka.ActorRef[Any]:
    """The actor a request goes to: a Supervisor's current actor, or the ref itself.

    A request is watched on the actor that took it, so a helper never waits on a
    future of an engine that died while a supervisor already started the next one.
    """
    actor_ref = getattr(ref, "actor_ref", None)
    return actor_ref if actor_ref is not None else ref  # type: ignore[no-any-return]


def _ask(ref: pykka.ActorRef[Any], message: object) -> Any:
    try:
        return ref.ask(message)
    except pykka.ActorDeadError as e:
        raise EngineStopped(f"the engine is not running: {e}") from None


def generate(
    ref: pykka.ActorRef[Any],
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Completion:
    """Complete ``prompt`` (text or token ids) and wait for the ``Completion``.

    Args:
        ref: the server.
        prompt: text, or a list of token ids.
        timeout: seconds to wait in all; when it passes the request is cancelled and
            ``RequestTimeout`` raised.
        **options: any ``Generate`` option (``max_tokens``, ``temp``, ...).

    Raises:
        InvalidRequest, QueueFull: at admission. EngineError: the request failed.
    """
    message = Generate(prompt, **options) if isinstance(prompt, str) else GenerateTokens(prompt, **options)
    return _complete(ref, message, timeout)


def chat(
    ref: pykka.ActorRef[Any],
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Completion:
    """Complete a conversation (rendered with the model's chat template) and wait.

    ``messages`` are ``{"role": "system" | "user" | "assistant", "content": str}``
    dicts; everything else is as :func:`generate`.
    """
    return _complete(ref, Chat(messages, **options), timeout)


def _complete(ref: Any, message: SubmitMessage, timeout: float | None) -> Completion:
    ref = _target(ref)
    future = _ask(ref, message)
    try:
        completion: Completion = _wait_for(
            ref, lambda wait: future.get(timeout=wait), pykka.Timeout, timeout,
            f"no completion within {timeout} s; request cancelled",
        )  # fmt: skip
    except RequestTimeout:
        _tell_cancel(ref, message.request_id)
        raise
    return completion


def _wait_for(
    ref: pykka.ActorRef[Any],
    get: Callable[[float], T],
    empty: type[Exception],
    timeout: float | None,
    timeout_message: str,
) -> T:
    """Call ``get(wait)`` until it returns, watching the actor and the deadline.

    ``get`` raises ``empty`` when nothing arrived within ``wait`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
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
    ref: pykka.ActorRef[Any],
    prompt: str | Sequence[int],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Iterator[str]:
    """Stream the text of a completion piece by piece.

    Closing the iterator early (``break``, ``close()``, garbage collection) cancels
    the request.

    Args:
        ref: the server.
        prompt: text, or a list of token ids.
        timeout: the most seconds to wait for each next piece; when it passes the
            request is cancelled and ``RequestTimeout`` raised.
        **options: any ``Stream`` option (``max_tokens``, ``temp``, ...).
    """
    events: queue.Queue[Token | Done | Failed] = queue.Queue()
    if isinstance(prompt, str):
        message: Stream | StreamTokens | StreamChat = Stream(prompt, reply_to=events, **options)
    else:
        message = StreamTokens(prompt, reply_to=events, **options)
    return _stream_events(ref, message, events, timeout)


def stream_chat(
    ref: pykka.ActorRef[Any],
    messages: Sequence[Mapping[str, str]],
    *,
    timeout: float | None = None,
    **options: Any,
) -> Iterator[str]:
    """Stream the reply to a conversation piece by piece; as :func:`stream` otherwise."""
    events: queue.Queue[Token | Done | Failed] = queue.Queue()
    message = StreamChat(messages, reply_to=events, **options)
    return _stream_events(ref, message, events, timeout)


def _stream_events(
    ref: pykka.ActorRef[Any],
    message: Stream | StreamTokens | StreamChat,
    events: queue.Queue[Token | Done | Failed],
    timeout: float | None,
) -> Iterator[str]:
    ref = _target(ref)
    try:
        ref.tell(message)
    except pykka.ActorDeadError as e:
        raise EngineStopped(f"the engine is not running: {e}") from None
    finished = False
    try:
        while True:
            event = _wait_for(
                ref, lambda wait: events.get(timeout=wait), queue.Empty, timeout,
                f"no token within {timeout} s; request cancelled",
            )  # fmt: skip
            if isinstance(event, Token):
                if event.text:
                    yield event.text
            elif isinstance(event, Done):
                finished = True
                return
            else:
                finished = True
                raise event.error
    finally:
        if not finished:
            _tell_cancel(ref, message.request_id)
