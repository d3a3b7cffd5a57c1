"""How many draft tokens to verify: each only where its expected tokens pay for it.

A pure function of the slot views, the plan, the budget and the measured cost of a
forward pass. Verifying draft tokens lengthens the one forward pass every slot of the
tick waits for; a draft token is worth it when the tokens it is expected to add raise
the tick's tokens per millisecond. With a per-token acceptance ``a`` the ``i``-th
draft token of a slot adds a token with probability ``a ** i`` (all before it right
too). Adding one such token to a tick whose decode rows are expected to give ``E``
tokens in ``C`` ms pays when ``a ** i / per_token_ms > E / C``, by a 15% margin; the
rule adds the best one, updates ``E`` and ``C`` and asks again, so drafts stop by
themselves where acceptance is low or the batch is already large (at concurrency 8 on
a CPU a draft token needs about a 0.9 chance of being right; alone, about 0.6).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from strategies._base import BatchPlan, DecodeCost, SlotPlan, SlotView

__all__ = ["add_drafts"]

_MAX_ACCEPTANCE = 0.999  # a rate of 1.0 would make every draft token look free
# A draft token must beat the tick's rate by this much: the line does not see what a
# draft row costs besides its compute (sampling it, a batch of a new shape), and at a
# full batch a draft that only breaks even lost 5% in bench/speculative.py.
_MARGIN = 1.15


def add_drafts(slots: Sequence[SlotView], plan: BatchPlan, budget: int, cost: DecodeCost) -> BatchPlan:
    """``plan`` with the draft tokens that pay, within ``budget`` (see the module's rule).

    Only entries that decode get drafts, at most their view's ``draft_tokens``.
    """
    views = {view.seq_id: view for view in slots}
    entries = list(plan.slots)
    # The tick's decode rows: one token each, expected, at ``cost``'s price (measured on
    # decode rows). Prompt chunks are left out of both sides: their tokens are cheaper
    # per token and yield none, so leaving them out errs toward fewer drafts.
    expected = float(plan.num_decode_tokens + plan.num_draft_tokens)
    cost_ms = cost.batch_ms(plan.num_decode_tokens + plan.num_draft_tokens)
    heap: list[tuple[float, int, int, float]] = []  # (-gain, entry index, i, acceptance)
    for index, entry in enumerate(entries):
        view = views.get(entry.seq_id)
        if not entry.decode or view is None or view.draft_tokens <= entry.draft_tokens:
            continue
        a = min(max(float(view.draft_acceptance), 0.0), _MAX_ACCEPTANCE)
        i = entry.draft_tokens + 1
        if a > 0.0:
            heapq.heappush(heap, (-(a**i), index, i, a))
    extra = [0] * len(entries)
    while heap and budget > 0:
        neg_gain, index, i, a = heapq.heappop(heap)
        gain = -neg_gain
        if gain * cost_ms <= _MARGIN * expected * cost.per_token_ms:
            break  # the best one left does not pay: none after it does either
        extra[index] += 1
        budget -= 1
        expected += gain
        cost_ms += cost.per_token_ms
        view = views[entries[index].seq_id]
        if i < view.draft_tokens:
            heapq.heappush(heap, (-(a ** (i + 1)), index, i + 1, a))
    if not any(extra):
        return plan
    return BatchPlan(
        tuple(
            SlotPlan(e.seq_id, e.decode, e.prefill_tokens, e.draft_tokens + n) if n else e
            for e, n in zip(entries, extra, strict=True)
        )
    )
