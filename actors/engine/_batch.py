"""Checking a strategy's plan and laying it out in the batch arrays.

Both run in the engine thread between the strategy and ``llama_decode``. The checks
are what stands between a buggy strategy and a process abort inside llama.cpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from actors.backend import put_rows
from actors.contract import StrategyError, is_int
from actors.engine._slots import Slot
from strategies import BatchPlan, SlotPlan, SlotState, SlotView

__all__ = ["BatchArrays", "Segment", "check_plan", "lay_out"]


@dataclass(slots=True)
class BatchArrays:
    """The batch's columns, as numpy arrays shared with llama.cpp."""

    tokens: npt.NDArray[np.int32]
    pos: npt.NDArray[np.int32]
    seq_ids: npt.NDArray[np.int32]
    logits: npt.NDArray[np.int8]


@dataclass(slots=True)
class Segment:
    """The rows ``[start, end)`` one slot fills; ``logits_row`` is -1 when none asks for logits.

    A decode with ``drafts`` holds the pending token, then that many of the slot's draft
    tokens, every row with logits (``logits_row`` is the first).
    """

    slot: Slot
    start: int
    end: int
    logits_row: int
    decode: bool
    drafts: int = 0


def check_plan(plan: object, views: Mapping[int, SlotView], budget: int, chunk_size: int) -> BatchPlan:
    """The plan, materialized, if the engine may run it, else ``StrategyError`` saying why.

    The entries are read once, into a new tuple: a plan built from a generator would
    otherwise be used up by this check and leave nothing for the batch.
    """
    if not isinstance(plan, BatchPlan):
        raise StrategyError(f"build_batch must return a BatchPlan, got {type(plan).__name__}")
    try:
        entries = tuple(plan.slots)
    except Exception as e:
        raise StrategyError(f"the plan's slots cannot be read: {e!r}") from None
    seen: set[int] = set()
    total = 0
    for entry in entries:
        if not isinstance(entry, SlotPlan):
            raise StrategyError(f"a plan entry must be a SlotPlan, got {type(entry).__name__}")
        if (
            not is_int(entry.seq_id)
            or not isinstance(entry.decode, bool)
            or not is_int(entry.prefill_tokens)
            or not is_int(entry.draft_tokens)
        ):
            raise StrategyError(
                "a plan entry needs an int seq_id, prefill_tokens and draft_tokens and a bool "
                f"decode: {entry!r}"
            )
        view = views.get(entry.seq_id)
        if view is None:
            raise StrategyError(f"plan names seq_id {entry.seq_id}, which is not a busy slot")
        if entry.seq_id in seen:
            raise StrategyError(f"plan names seq_id {entry.seq_id} twice")
        seen.add(entry.seq_id)
        if entry.decode and not view.has_pending_token:
            raise StrategyError(f"plan decodes seq_id {entry.seq_id}, which has no pending token")
        n = entry.prefill_tokens
        if not isinstance(n, int) or n < 0 or n > min(chunk_size, view.prefill_remaining):
            raise StrategyError(
                f"plan prefills {n!r} tokens for seq_id {entry.seq_id}; "
                f"allowed 0..{min(chunk_size, view.prefill_remaining)}"
            )
        d = entry.draft_tokens
        if d and (not entry.decode or not 0 < d <= view.draft_tokens):
            raise StrategyError(
                f"plan verifies {d!r} draft tokens for seq_id {entry.seq_id}; allowed "
                f"0..{view.draft_tokens}, and only with its decode"
            )
        total += n + d + (1 if entry.decode else 0)
    if total > budget:
        raise StrategyError(f"plan holds {total} tokens, over the budget of {budget}")
    if total == 0 and views:
        # An empty plan with work waiting would spin the engine forever.
        raise StrategyError("plan schedules no token although slots have work")
    return BatchPlan(entries)


def lay_out(plan: BatchPlan, slots: Mapping[int, Slot], arrays: BatchArrays) -> list[Segment]:
    """Write a checked plan into the batch arrays; returns one segment per slot.

    A decode row holds the slot's pending token and asks for logits (so does each draft
    row after it); a prefill chunk asks for logits on its last row only when it
    completes the prompt.
    """
    segments: list[Segment] = []
    row = 0
    for entry in plan.slots:
        slot = slots[entry.seq_id]
        n_past = len(slot.cached)
        if entry.decode:
            d = entry.draft_tokens
            end = row + 1 + d
            if d:
                put_rows(arrays, row, slot.seq_id, [slot.pending, *slot.draft[:d]], n_past, logits=True)
            else:  # the common row, written without a temporary
                arrays.tokens[row] = slot.pending
                arrays.pos[row] = n_past
                arrays.seq_ids[row] = slot.seq_id
                arrays.logits[row] = 1
            segments.append(Segment(slot, row, end, row, True, d))
            row = end
        elif entry.prefill_tokens:
            assert slot.request is not None and slot.state is SlotState.PREFILLING
            n = entry.prefill_tokens
            chunk = slot.request.context[n_past : n_past + n]
            end = put_rows(arrays, row, slot.seq_id, chunk, n_past, logits=False)
            completes = n_past + n == len(slot.request.context)
            if completes:
                arrays.logits[end - 1] = 1
            segments.append(Segment(slot, row, end, end - 1 if completes else -1, False))
            row = end
    return segments
