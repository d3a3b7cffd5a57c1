"""What the engine sends back: completions, stream events and log-probabilities.

Frozen dataclasses, made in the engine thread and read in callers' threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from actors.contract._errors import EngineError

__all__ = [
    "Completion",
    "Done",
    "Failed",
    "Progress",
    "StopReason",
    "Token",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
]

StopReason = Literal["eog", "max_tokens", "stop", "length", "cancelled", "timeout", "tool_calls"]
"""Why a request finished: an end-of-generation token, ``max_tokens`` reached, a stop
string, the context window full (``length``), cancelled, past its ``deadline_s``, or
the turn ended to call tools (``tool_calls``: a chat with ``tools`` whose reply made
at least one call and then ended)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of one of the chat's tools that the reply made.

    ``arguments`` is the JSON text of the arguments object, as the model wrote it
    (it always parses; under ``tool_choice`` ``"required"`` or a named function it is
    valid under the tool's ``parameters`` schema). ``id`` is made by the server
    (``call_`` and 24 letters and digits; nine letters and digits for Mistral's
    formats, whose templates require them): send it back as the ``tool_call_id`` of
    the tool's result.
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call, as a stream releases it.

    The first delta of call ``index`` (0, 1, ... within the reply) carries its ``id``
    and ``name`` and usually empty ``arguments``; the next ones carry only fragments
    of the arguments' JSON text (``id`` and ``name`` None). The fragments of a call
    join to its ``ToolCall.arguments``.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a step."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The generated token's log-probability and the ``k`` most likely at that step.

    Values are the log-softmax of the model's raw logits, before sampling transforms
    (bias, penalties, grammar, temperature); ``top`` is sorted most likely first. With
    the request's ``post_sampling_probs`` they are instead the log of the probabilities
    the sampler drew the token from, after the whole chain (bias, penalties, grammar,
    top-k, top-p, min-p, temperature): ``top`` then holds only tokens the chain kept, so
    it may be shorter than ``k``, and greedy sampling gives the token alone, at 0.0.
    """

    token_id: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of one request.

    ``stop_string`` is the stop string that ended it (``stop_reason="stop"``);
    ``logprobs`` has one entry per generated token when the request asked for them.

    Of a chat: ``text`` is the reply's content alone; ``reasoning`` is its thinking
    (split out under the chat's ``reasoning_format``; "" when none) and
    ``tool_calls`` the calls it made (only complete ones: a reply cut by
    ``max_tokens`` inside a call leaves that call out).

    ``ttft_ms`` is the time from admission to the first generated token (equal to
    ``duration_ms`` when none came); ``prefix_cache_tokens`` prompt tokens were
    reused from the KV cache instead of being decoded. ``index`` is the choice, of a
    request with ``n`` > 1 (0 otherwise). With speculative decoding, ``draft_tokens``
    draft tokens were verified for it and ``draft_accepted`` of them were right (each
    one a token that cost no forward pass of its own). ``slot`` is the slot that ran it
    last, which holds its KV now (what ``SaveSlot(path, slot=...)`` saves); -1 when it
    never entered one. ``context_shifts``: the times its slot was full and dropped
    tokens of its context so that it could go on (``context_shift``; llama-server's
    ``truncated``).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    stop_reason: StopReason
    prompt_tokens: int
    generated_tokens: int
    prefix_cache_tokens: int
    ttft_ms: float
    duration_ms: float
    stop_string: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    index: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    slot: int = -1
    context_shifts: int = 0


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token and the text it releases.

    ``text`` may be empty while a character is incomplete or while text that could
    start a stop string is held back; the pieces join to exactly ``Completion.text``.
    ``index`` is the choice it belongs to, of a request with ``n`` > 1 (0 otherwise).

    Of a chat with ``tools`` or thinking, a token's text goes to one of three places:
    ``text`` (content), ``reasoning`` (thinking; the pieces join to
    ``Completion.reasoning``) or ``tool_calls`` (pieces of calls; see
    ``ToolCallDelta``). Markup (``<tool_call>``, ``<think>``) goes to none of them, and
    text that could still turn out to be markup is held back until it is known.
    """

    request_id: str
    text: str
    token_id: int
    logprob: TokenLogprob | None = None
    index: int = 0
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a stream's prompt is prefilled; only streams that ask (``progress=True``).

    The first is sent when the request enters a slot, before any prompt token is
    decoded (``processed == cached``, ``prefill_ms == 0.0``); then one after each prefill
    chunk is decoded, ``processed`` growing to ``total`` in the last, which comes just
    before the first ``Token``. A request preempted before its first token (KV cells ran
    out) starts its prefill again when it resumes, and its progress with it: a new
    first event. None is sent once a token was generated.

    ``total`` is the prompt's tokens, ``cached`` those this prefill found in a cache
    (the slot's KV or the RAM cache), ``processed`` those in the KV now (the cached ones
    included); ``prefill_ms`` is the time since the request first entered a slot, 0.0
    while this prefill has decoded nothing.
    """

    request_id: str
    processed: int
    total: int
    cached: int
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class Done:
    """The last event of a successful stream (of each choice, ``index``, when ``n`` > 1)."""

    request_id: str
    completion: Completion
    index: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    """The last event of a failed stream (of each choice, ``index``, when ``n`` > 1)."""

    request_id: str
    error: EngineError
    index: int = 0
