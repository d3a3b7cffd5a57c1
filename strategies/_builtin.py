"""The three built-in strategies of LlamaCppEx, as pure functions of the slot views.

Every strategy serves slots oldest first (by ``arrival``), so a request is never
starved by ones that came after it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from strategies._base import BatchStrategy
from strategies._types import BatchPlan, SlotPlan, SlotView

__all__ = ["Adaptive", "Balanced", "DecodeMaximal", "PrefillPriority"]


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
        """Plan decode tokens first (oldest first), then prompt chunks in what is left."""
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
        """Plan prompt chunks (oldest first), then the decode tokens that still fit."""
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
        """Plan decode tokens up to the quota, prompt chunks in the rest, then decode in what is left."""
        ordered = _oldest_first(slots)
        all_decoders = _decoders(ordered, budget)
        quota = min(budget // 2, len(all_decoders))
        prefill = _prefills(ordered, budget - quota, chunk_size)
        left = budget - quota - sum(prefill.values())
        decode = all_decoders[: quota + max(left, 0)]
        return _plan(ordered, set(decode), prefill)


class Adaptive(BatchStrategy):
    """Decode first; while anything decodes, prefill at most ``prefill_per_tick`` tokens.

    The built-ins let a long prompt fill the whole budget (``n_batch``), and a tick's
    time grows with its batch: on a CPU a 2,000-token tick takes seconds, and every
    running request waits that long for its next token. Capping the prefill share
    while requests are decoding bounds their inter-token latency; with nothing to
    decode, prompts get the full budget. ``bench/strategies.py`` measures the trade.
    """

    def __init__(self, prefill_per_tick: int = 128) -> None:
        if prefill_per_tick < 1:
            raise ValueError("prefill_per_tick must be >= 1")
        self.prefill_per_tick = prefill_per_tick

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        """Plan decode tokens first, then prompt chunks capped while anything decodes."""
        ordered = _oldest_first(slots)
        decode = _decoders(ordered, budget)
        prefill_budget = budget - len(decode)
        if decode:
            prefill_budget = min(prefill_budget, self.prefill_per_tick)
        prefill = _prefills(ordered, prefill_budget, chunk_size)
        return _plan(ordered, set(decode), prefill)

    def __repr__(self) -> str:
        return f"Adaptive(prefill_per_tick={self.prefill_per_tick})"
