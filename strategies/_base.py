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
from collections.abc import Sequence

from strategies._adapters import fair_adapters
from strategies._drafts import add_drafts
from strategies._types import AdapterSet, BatchPlan, DecodeCost, EmbedBudget, SlotView

__all__ = ["BatchStrategy"]


class BatchStrategy(abc.ABC):
    """Decides how one tick's token budget is split between decode and prefill.

    Subclass it and implement :meth:`build_batch`. It runs in the engine thread, once
    per tick, so keep it cheap; it must not mutate the views or keep state that
    changes its answer for the same input.

    Attributes:
        adapter_quantum: the most ticks in a row one LoRA adapter set keeps the batch
            while another set's slots wait (see :meth:`choose_adapters`). 4 by
            default: a switch of set costs most of a one-row decode on 2 cores, and
            4 ticks a turn served 3-9% more tokens than 2 at concurrency 8 with 2, 4
            and 8 tenants (medians of three runs of ``bench/lora.py``), each
            tenant's worst wait up to 0.25 s longer.
    """

    adapter_quantum: int = 4

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

    def choose_adapters(
        self, slots: Sequence[SlotView], *, current: AdapterSet | None, streak: int
    ) -> AdapterSet:
        """Which LoRA adapter set this tick serves (called only when the busy slots run
        more than one; :meth:`build_batch` then sees only that set's slots).

        Args:
            slots: views of the busy slots.
            current: the set the last tick served (None: none yet).
            streak: how many ticks in a row ``current`` has been served.

        Returns:
            The ``adapters`` of one of the views; by default :func:`strategies.fair_adapters`
            (the set served keeps the batch for ``adapter_quantum`` ticks while it has
            work, then the set whose slot waited longest).
        """
        return fair_adapters(slots, current, streak, self.adapter_quantum)

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
            to return ``plan`` for a strategy that never speculates. The engine
            verifies none of a slot's drafts where this count is under its
            ``draft_min``.
        """
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
