"""What a strategy sees and returns: the slots' views, the plan, the costs and the
embedding budget (frozen data; the engine builds the views and reads the plans)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["AdapterSet", "BatchPlan", "DecodeCost", "EmbedBudget", "SlotPlan", "SlotState", "SlotView"]

AdapterSet = tuple[tuple[int, float], ...]
"""The LoRA adapters a request runs with: ``(adapter id, scale)`` pairs, ids ascending,
no zero scale; ``()`` is the bare base model. llama.cpp applies one set to the whole
context, so one batch serves one set."""


class SlotState(enum.IntEnum):
    """What a slot is doing; ordered so ``state > IDLE`` means busy."""

    IDLE = 0
    PREFILLING = 1
    GENERATING = 2


@dataclass(frozen=True, slots=True)
class SlotView:
    """A read-only view of one busy slot, as a strategy sees it.

    Attributes:
        seq_id: the slot's llama.cpp sequence id.
        state: ``PREFILLING`` while prompt tokens are left, then ``GENERATING``.
        has_pending_token: a sampled token waits to be decoded (one decode token).
        prefill_remaining: prompt tokens not yet in the KV cache.
        generated_tokens: tokens generated so far for the request.
        arrival: the request's arrival order (smaller arrived earlier).
        draft_tokens: draft tokens the engine proposes to verify after the pending
            token (0 without speculation, or when the drafter has none).
        draft_acceptance: the estimated chance that each next draft token is right,
            from the request's recent verifications (0 to 1).
        adapters: the LoRA adapter set its request runs with (``()``: none).
        waited_ticks: ticks since the slot was last in a batch (0: it was in the last
            one), counted from when its request entered the slot.
    """

    seq_id: int
    state: SlotState
    has_pending_token: bool
    prefill_remaining: int
    generated_tokens: int
    arrival: int
    draft_tokens: int = 0
    draft_acceptance: float = 0.0
    adapters: AdapterSet = ()
    waited_ticks: int = 0


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What one slot contributes to this tick's batch.

    Attributes:
        seq_id: the slot.
        decode: decode the slot's pending token (one batch token, logits requested).
        prefill_tokens: how many of the slot's remaining prompt tokens to prefill; the
            engine requests logits on the last one only when it completes the prompt.
        draft_tokens: how many of the slot's proposed draft tokens to verify after its
            pending token (needs ``decode``; each is one more batch token with logits).
    """

    seq_id: int
    decode: bool = False
    prefill_tokens: int = 0
    draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The plan of one tick: one entry per contributing slot, in batch order."""

    slots: tuple[SlotPlan, ...] = ()

    def __post_init__(self) -> None:
        # Any iterable is read once, here: a generator would be used up by its first reader.
        object.__setattr__(self, "slots", tuple(self.slots))

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens in the plan."""
        return sum(1 for entry in self.slots if entry.decode)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens prefilled by the plan."""
        return sum(entry.prefill_tokens for entry in self.slots)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens verified by the plan."""
        return sum(entry.draft_tokens for entry in self.slots)

    @property
    def num_tokens(self) -> int:
        """Batch size the plan asks for."""
        return self.num_decode_tokens + self.num_prefill_tokens + self.num_draft_tokens


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """What a forward pass costs, as the engine measures it: ``fixed_ms`` plus
    ``per_token_ms`` for each token of the batch, and, where it timed them, the passes
    themselves: ``measured_ms[n - 1]`` is an ``n``-token pass.

    On a CPU ``per_token_ms`` is large (a 17-token batch costs about 9 one-token
    ones on a 2-core Xeon), so a draft token pays only when it is likely right. The
    line misses how the first extra rows cost: a one-token pass takes llama.cpp's
    matrix-vector path, so a second row can add 80% of it where later ones add 55%
    (a 2-core AMD EPYC), which is what ``measured_ms`` keeps.
    """

    fixed_ms: float
    per_token_ms: float
    measured_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_ms) and self.fixed_ms >= 0):
            raise ValueError(f"fixed_ms must be a finite number >= 0, got {self.fixed_ms!r}")
        if not (math.isfinite(self.per_token_ms) and self.per_token_ms > 0):
            raise ValueError(f"per_token_ms must be a finite number > 0, got {self.per_token_ms!r}")
        if not isinstance(self.measured_ms, tuple):
            raise ValueError(f"measured_ms must be a tuple, got {type(self.measured_ms).__name__}")
        previous = 0.0
        for ms in self.measured_ms:
            if not (isinstance(ms, float | int) and math.isfinite(ms) and ms >= previous and ms > 0):
                raise ValueError(f"measured_ms must be positive, finite and non-decreasing, got {ms!r}")
            previous = ms

    def batch_ms(self, n_tokens: int) -> float:
        """The expected time of a forward pass over ``n_tokens``: the measured pass, or
        past the measured sizes the largest one plus ``per_token_ms`` a token more."""
        measured = self.measured_ms
        if not measured:
            return self.fixed_ms + self.per_token_ms * n_tokens
        if n_tokens <= len(measured):
            return measured[n_tokens - 1] if n_tokens > 0 else 0.0
        return measured[-1] + self.per_token_ms * (n_tokens - len(measured))


@dataclass(frozen=True, slots=True)
class EmbedBudget:
    """What the engine measured for :meth:`BatchStrategy.embed_rows` (times in ms).

    Attributes:
        rows_max: the most rows a pass holds (``n_batch``, and 256).
        generation_ms: what a generating tick has taken lately, with the engine's time
            between ticks and without its embedding pass (a moving average); 0 before
            the first.
        row_ms: what an embedding row has cost lately (a pass's time over its rows,
            averaged the same way); 0 before the first pass.
        embed_ms: the time of the embedding passes lately, while slots were busy (a sum
            that decays by a tenth a tick).
        other_ms: the rest of those ticks' time, summed the same way.
    """

    rows_max: int
    generation_ms: float
    row_ms: float
    embed_ms: float
    other_ms: float
