"""The three built-in strategies of LlamaCppEx, as pure functions of the slot views.

Every strategy serves slots oldest first (by ``arrival``), so a request is never
starved by ones that came after it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from strategies._base import BatchPlan, BatchStrategy, SlotPlan, SlotView

__all__ = ["Balanced", "DecodeMaximal", "PrefillPriority"]


def _oldest_first(slots: Sequence[SlotView]) -> list[SlotView]:
    return sorted(slots, key=lambda view: view.arrival)


def _decoders(ordered: Sequence[SlotView], limit: int) -> list[int]:
    """The seq_ids of at most ``limit`` slots with a pending token, oldest first."""
    if limit <= 0:
        return []
    chosen = [view.seq_id for view in ordered if view.has_pending_token]
    return chosen[:limit]


def _prefills(ordered: Sequence[SlotView], budget: int, chunk_size: int) -> dict[int, int]:
    """Prompt chunks of at most ``chunk_size`` tokens, oldest first, within ``budget``."""
    chunks: dict[int, int] = {}
    for view in ordered:
        if budget <= 0:
            break
        if view.prefill_remaining > 0:
            take = min(view.prefill_remaining, chunk_size, budget)
            chunks[view.seq_id] = take
            budget -= take
    return chunks


def _plan(ordered: Sequence[SlotView], decode: Collection[int], prefill: Mapping[int, int]) -> BatchPlan:
    entries = []
    for view in ordered:
        wants_decode = view.seq_id in decode
        n_prefill = prefill.get(view.seq_id, 0)
        if wants_decode or n_prefill:
            entries.append(SlotPlan(view.seq_id, decode=wants_decode, prefill_tokens=n_prefill))
    return BatchPlan(tuple(entries))


class DecodeMaximal(BatchStrategy):
    """Decode tokens first, prompt chunks fill what is left (the default).

    Generating requests never stall behind a long prompt: the lowest inter-token
    latency, at the cost of a slower time to first token under load.
    """

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        ordered = _oldest_first(slots)
        decode = _decoders(ordered, budget)
        prefill = _prefills(ordered, budget - len(decode), chunk_size)
        return _plan(ordered, set(decode), prefill)


class PrefillPriority(BatchStrategy):
    """Prompt chunks first, decode tokens fill what is left.

    New requests reach their first token sooner, while running ones may pause.
    """

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        ordered = _oldest_first(slots)
        prefill = _prefills(ordered, budget, chunk_size)
        decode = _decoders(ordered, budget - sum(prefill.values()))
        return _plan(ordered, set(decode), prefill)


class Balanced(BatchStrategy):
    """Decode gets ``min(budget // 2, generating slots)``, prefill the rest.

    What prefill leaves unused goes back to the remaining decode tokens, so the
    batch is as full as the work allows.
    """

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        ordered = _oldest_first(slots)
        all_decoders = _decoders(ordered, budget)
        quota = min(budget // 2, len(all_decoders))
        prefill = _prefills(ordered, budget - quota, chunk_size)
        left = budget - quota - sum(prefill.values())
        decode = all_decoders[: quota + max(left, 0)]
        return _plan(ordered, set(decode), prefill)
