"""The strategy contract: read-only slot views in, a batch plan out.

With speculative decoding on, a slot's view also says how many draft tokens the
engine proposes for it and how often its drafts were right; after ``build_batch``
the engine calls ``plan_drafts``, which spends the budget left on them (by default
:func:`strategies.add_drafts`: only the drafts whose expected tokens pay for the
longer forward pass they cause, by the engine's measured ``DecodeCost``).

A strategy runs in the engine's actor thread, once per tick, and must be a pure
function of its arguments: it mutates nothing, sends no signal and calls nothing in
llama.cpp. The engine validates the plan it returns before it touches a batch, so a
buggy strategy fails requests with a clear ``StrategyError`` instead of aborting the
process with an oversized batch.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BatchPlan", "BatchStrategy", "DecodeCost", "EmbedBudget", "SlotPlan", "SlotState", "SlotView"]


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
    """

    seq_id: int
    state: SlotState
    has_pending_token: bool
    prefill_remaining: int
    generated_tokens: int
    arrival: int
    draft_tokens: int = 0
    draft_acceptance: float = 0.0


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


class BatchStrategy(abc.ABC):
    """Decides how one tick's token budget is split between decode and prefill.

    Subclass it and implement :meth:`build_batch`. It runs in the engine thread, once
    per tick, so keep it cheap; it must not mutate the views or keep state that
    changes its answer for the same input.
    """

    @abc.abstractmethod
    def build_batch(
        self,
        slots: Sequence[SlotView],
        budget: int,
        chunk_size: int,
        *,
        queue_depth: int,
    ) -> BatchPlan:
        """Plan one tick.

        Args:
            slots: views of the busy slots (idle slots are not shown).
            budget: the most tokens the batch may hold (``n_batch``).
            chunk_size: the most prompt tokens one slot may prefill this tick.
            queue_depth: requests waiting for a free slot.

        Returns:
            The plan; at most ``budget`` tokens, a slot at most once, a decode only
            for a slot with a pending token, and per slot at most
            ``min(chunk_size, prefill_remaining)`` prefill tokens. Draft tokens may
            be planned here too (at most the view's ``draft_tokens``, with a decode),
            but the built-ins leave them to :meth:`plan_drafts`.
        """

    def plan_drafts(
        self, slots: Sequence[SlotView], plan: BatchPlan, budget: int, cost: DecodeCost
    ) -> BatchPlan:
        """Add draft tokens to ``plan`` (called only when some slot has a draft).

        Args:
            slots: the views ``build_batch`` saw.
            plan: what ``build_batch`` returned.
            budget: the most draft tokens the batch and the KV cells can still take.
            cost: the engine's measured cost of a forward pass.

        Returns:
            The plan with each decoding slot's ``draft_tokens`` set; by default
            :func:`strategies.add_drafts` (drafts only where they pay). Override it
            to return ``plan`` for a strategy that never speculates.
        """
        from strategies._drafts import add_drafts

        return add_drafts(slots, plan, budget, cost)

    def embed_rows(self, budget: EmbedBudget) -> int:
        """How many rows this tick's embedding pass may take while slots are busy
        (called only then: an engine with nothing else to do fills its passes).

        The pass runs before generation's batch in the same tick, so it adds its time to
        every running stream's gap between tokens; a longer text is fed in chunks of this
        size over several ticks.

        Returns:
            From 0 (no pass this tick) to ``budget.rows_max``. By default: 16 rows until
            the times are measured; then the rows that cost three quarters of a
            generating tick (at least one), and no pass while embeddings had more than
            two thirds of the time the rest of the ticks had lately. A stream beside
            embeddings then runs at least about half as fast as alone.
        """
        if budget.generation_ms <= 0.0 or budget.row_ms <= 0.0:
            return min(budget.rows_max, 16)
        rows = max(1, min(budget.rows_max, int(0.75 * budget.generation_ms / budget.row_ms)))
        if budget.embed_ms + rows * budget.row_ms > budget.other_ms * 2 / 3:
            return 0
        return rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
