"""Request and slot state (no llama.cpp here).

Everything here is owned by the engine's actor thread. A slot keeps, in ``cached``, the
tokens whose KV sits in its sequence, in position order; a request catches its slot up
with its tokens one tick at a time, which covers chunked prefill, prefix reuse and
decode with one rule: ``len(cached) < len(prompt)`` is prefilling, else the last sampled
token (``pending``) waits to be decoded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pykka

from actors.chat import ReplyParser
from actors.contract import ReplyTo, RequestMessage, SamplingParams, Token, TokenLogprob
from actors.engine._output import TextStream
from actors.engine._prefix import CacheScope
from actors.engine._speculative import Acceptances, DraftWant
from strategies import AdapterSet, SlotState, SlotView

__all__ = ["CacheScope", "Choices", "Request", "Slot", "common_prefix_len", "running_choices"]


@dataclass(slots=True, eq=False)
class Choices:
    """Requests that answer as one: the ``n`` choices of one request (``n`` > 1), or a
    decision's leader and questions; one outcome each, one future for all."""

    requests: list[Request]
    future: pykka.ThreadingFuture[object] | None
    results: list[object] = field(default_factory=list)  # a Completion each, or None so far
    failed: bool = False
    # What the future gets once all have ended (None: the tuple of Completions): a
    # decision's questions make one Decision (it may raise the request's error instead).
    build: Callable[[Choices], object] | None = None

    @property
    def leader(self) -> Request:
        """Choice 0: the one that prefills the prompt; the others copy its KV."""
        return self.requests[0]


@dataclass(slots=True, eq=False)
class Request:
    """An admitted request and its progress (engine thread only)."""

    message: RequestMessage
    prompt: list[int]
    params: SamplingParams
    arrival: int
    sampler: Any
    future: pykka.ThreadingFuture[object] | None = None
    reply_to: ReplyTo | None = None
    t_admitted: float = field(default_factory=time.monotonic)
    t_started: float = 0.0
    t_first_token: float | None = None
    t_finished: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    text: TextStream = field(default_factory=TextStream)
    pieces: list[str] = field(default_factory=list)
    # A chat's reply split into content, thinking and tool calls (None: all content),
    # and the special tokens whose text it must see.
    reply: ReplyParser | None = None
    shown: frozenset[int] = frozenset()
    last: Token | None = None  # what the finish released (held-back text): the stream's last Token
    # A thinking budget: tokens thought so far, its limit, and the tokens still to force
    # (the close of the thinking, once the budget is spent).
    thought: int = 0
    budget: int | None = None
    budget_tokens: tuple[int, ...] = ()
    forced: list[int] = field(default_factory=list)
    # Tool calls: where the first call began (a token count; -1: none yet), the calls
    # complete so far, and the tokens one is expected to need (from those so far).
    call_start: int = -1
    calls_seen: int = 0
    call_tokens: int = 0
    call_after_thinking: bool = False  # it may not end while it thinks (a call is required)
    closed_early: bool = False  # a call's end was forced before max_tokens (it ends "max_tokens")
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None
    prefix_cache_tokens: int = 0
    seq_id: int = -1
    # What the slot must hold before the next token can be sampled: the prompt, and
    # after a preemption the prompt plus every token generated so far (recomputed).
    context: list[int] = field(default_factory=list)
    started: bool = False
    preemptions: int = 0
    context_shifts: int = 0  # times a full slot dropped tokens of its context for it
    deadline: float | None = None  # monotonic time by which it must end
    # The courier calls it when the stream's consumer stops reading (streams only).
    on_stall: Callable[[], None] | None = None
    grammar_strikes: int = 0  # tokens in a row whose grammar cost over the limit
    # A stream that asked for Progress events, and the prompt tokens its current
    # prefill found cached (set each time it enters a slot).
    progress: bool = False
    prefill_cached: int = 0
    # Of a request with n > 1: which choice, and all of them.
    index: int = 0
    choices: Choices | None = None
    # Speculative decoding: draft tokens verified and accepted so far, and the
    # estimate of its next draft token's chance (None: it does not speculate).
    draft_tokens: int = 0
    draft_accepted: int = 0
    acceptance: Acceptances | None = None
    # A decision's question: its labels' token ids, read (as log-probabilities) from its
    # first logits row instead of sampling; () for the leader, which only prefills.
    reads: tuple[int, ...] | None = None
    read: tuple[float, ...] | None = None
    adapters: AdapterSet = ()  # the LoRA adapter set it runs with, resolved at admission

    def __post_init__(self) -> None:
        if not self.context:
            self.context = self.prompt

    @property
    def request_id(self) -> str:
        return self.message.request_id

    @property
    def key(self) -> str:
        """Its key in the engine's request table: the request id, ``"id#i"`` for choice i > 0."""
        return self.message.request_id if self.index == 0 else f"{self.message.request_id}#{self.index}"

    @property
    def scope(self) -> CacheScope:
        """Whose KV this request may reuse: only a cache of the same scope."""
        return (self.message.cache_scope, self.adapters)

    @property
    def session(self) -> str | None:
        return self.message.session

    @property
    def mode(self) -> Literal["generate", "stream"]:
        return "generate" if self.reply_to is None else "stream"


@dataclass(slots=True, eq=False)
class Slot:
    """One llama.cpp sequence and the request it serves, if any."""

    seq_id: int
    state: SlotState = SlotState.IDLE
    request: Request | None = None
    cached: list[int] = field(default_factory=list)
    pending: int = -1
    t_last_used: float = 0.0
    # Who the cached KV belongs to: reused only within the same cache scope.
    scope: CacheScope = (None, ())
    session: str | None = None
    # A context shift rewrote positions: the KV no longer matches a fresh prefill.
    shifted: bool = False
    # This tick's proposed draft tokens, to follow ``pending`` (speculative decoding);
    # a draft's kind keys the acceptance it is judged by. ``shadow``: the first token of
    # a draft the plan did not verify, the request's token count then, and the kind: the
    # next token tells, for free, whether it would have been right.
    draft: list[int] = field(default_factory=list)
    draft_kind: int = 0
    shadow: tuple[int, int, int] | None = None
    # This tick's call for a draft, and a costly drafter's (a draft model's) room: the
    # tokens it could make if the plan verified them (it made only the first so far).
    want: DraftWant | None = None
    draft_room: int = 0
    served_tick: int = 0  # the last tick it was in a batch (or its request entered it)

    def view(self, tick: int = 0) -> SlotView:
        """The read-only view a strategy sees at tick ``tick`` (busy slots only)."""
        request = self.request
        assert request is not None
        acceptance = request.acceptance.of(self.draft_kind).rate if request.acceptance is not None else 0.0
        return SlotView(
            seq_id=self.seq_id,
            state=self.state,
            has_pending_token=self.state is SlotState.GENERATING,
            prefill_remaining=len(request.context) - len(self.cached)
            if self.state is SlotState.PREFILLING
            else 0,
            generated_tokens=len(request.token_ids),
            arrival=request.arrival,
            draft_tokens=max(len(self.draft), self.draft_room),
            draft_acceptance=acceptance,
            adapters=request.adapters,
            waited_ticks=max(0, tick - self.served_tick - 1),
        )

    def release(self) -> Request | None:
        """Reset the per-request fields, keep the cached KV; returns the request."""
        request, self.request = self.request, None
        self.state = SlotState.IDLE
        self.pending = -1
        self.draft = []
        self.shadow = None
        self.draft_room, self.want = 0, None
        self.t_last_used = time.monotonic()
        return request


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if n < 64:
        for i in range(n):
            if a[i] != b[i]:
                return i
        return n
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def running_choices(request: Request, admitted: Mapping[str, Request]) -> int:
    """How many choices of ``request``'s request are in slots now (0 for a request with
    one choice); ``admitted``: the engine's requests by key, queued or running."""
    group = request.choices
    if group is None:
        return 0
    return sum(1 for r in group.requests if r.seq_id >= 0 and r.key in admitted)
