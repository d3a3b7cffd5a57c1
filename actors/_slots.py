"""Request and slot state, and the prefix-cache slot choice (no llama.cpp here).

Everything here is owned by the engine's actor thread. A slot keeps, in ``cached``, the
tokens whose KV sits in its sequence, in position order; a request catches its slot up
with its tokens one tick at a time, which covers chunked prefill, prefix reuse and
decode with one rule: ``len(cached) < len(prompt)`` is prefilling, else the last sampled
token (``pending``) waits to be decoded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pykka

from actors._messages import ReplyTo, RequestMessage, SamplingParams
from actors._output import TextStream
from actors._results import TokenLogprob
from strategies import SlotState, SlotView

__all__ = ["Request", "Slot", "choose_slot", "common_prefix_len"]

# A cached prefix is only worth its slot when it covers this share of the new prompt.
_MIN_PREFIX_SHARE = 0.10


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
    logprobs: list[TokenLogprob] | None = None
    stop_string: str | None = None
    prefix_cache_tokens: int = 0
    seq_id: int = -1

    @property
    def request_id(self) -> str:
        return self.message.request_id

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

    def view(self) -> SlotView:
        """The read-only view a strategy sees (busy slots only)."""
        request = self.request
        assert request is not None
        return SlotView(
            seq_id=self.seq_id,
            state=self.state,
            has_pending_token=self.state is SlotState.GENERATING,
            prefill_remaining=len(request.prompt) - len(self.cached)
            if self.state is SlotState.PREFILLING
            else 0,
            generated_tokens=len(request.token_ids),
            arrival=request.arrival,
        )

    def release(self) -> Request | None:
        """Reset the per-request fields, keep the cached KV; returns the request."""
        request, self.request = self.request, None
        self.state = SlotState.IDLE
        self.pending = -1
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


def choose_slot(idle: Sequence[Slot], prompt: Sequence[int], cache_prompt: bool) -> tuple[Slot, int]:
    """Pick the idle slot for a new prompt and how many cached tokens it can reuse.

    The slot whose cache shares the longest prefix with the prompt (when that covers
    over 10% of it), else an empty slot, else the least recently used one. At most
    ``len(prompt) - 1`` tokens are reused so the last prompt token is always decoded:
    its logits give the first generated token.
    """
    assert idle, "choose_slot needs at least one idle slot"
    if cache_prompt:
        best, best_len = idle[0], -1
        for slot in idle:
            n = common_prefix_len(slot.cached, prompt)
            if n > best_len:
                best, best_len = slot, n
        if best_len > _MIN_PREFIX_SHARE * len(prompt):
            return best, min(best_len, len(prompt) - 1)
    empty = [slot for slot in idle if not slot.cached]
    if empty:
        return empty[0], 0
    return min(idle, key=lambda slot: slot.t_last_used), 0
