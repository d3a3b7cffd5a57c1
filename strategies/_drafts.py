"""How many draft tokens to verify: each only where its expected tokens pay for it.

A pure function of the slot views, the plan, the budget and the measured cost of a
forward pass. Verifying draft tokens lengthens the one forward pass every slot of the
tick waits for; drafts are worth it when the tokens they are expected to add raise the
tick's tokens per millisecond. With a per-token acceptance ``a`` the ``i``-th draft
token of a slot adds a token with probability ``a ** i`` (all before it right too).
The rule ranks every candidate draft token by that gain, and for each count ``m`` of
the best ones prices the batch ``m`` rows larger by the measured cost of a pass
(``DecodeCost.batch_ms``, not a line: a pass's first extra rows cost more than later
ones on a CPU, so one draft token may lose where three would win), the time the rows
add priced 15% over the measure (50% beside other decoding slots); it verifies the
count that gives the most tokens per millisecond, if that beats the tick without
drafts. So drafts stop by themselves where acceptance is low or the batch is already
large (on a 2-core CPU a lone slot's drafts need about a 0.85 chance of being right,
and beside 7 other decoding slots none pays).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from strategies._types import BatchPlan, DecodeCost, SlotPlan, SlotView

__all__ = ["add_drafts"]

_MAX_ACCEPTANCE = 0.999  # a rate of 1.0 would make every draft token look free
# Draft rows are priced this much over what they add to the pass: the pass's time does
# not see what a draft row costs besides its compute (verifying it, a batch of a new
# shape), and at a full batch a draft that only broke even lost 5% in bench/speculative.py.
_MARGIN = 1.15
# Beside other decoding slots a draft row measured about twice what the calibrated
# curve gives its row (ticks of 9 rows on an AMD EPYC: +8.6 to +12 ms against the
# curve's 5): the rows of a crowded batch are priced higher still, so drafts pay there
# only where the pass is far from its slope (a GPU), never by a hair.
_CROWDED_MARGIN = 1.5
_NEGLIGIBLE = 0.01  # a candidate this unlikely to add a token ends the search


def add_drafts(slots: Sequence[SlotView], plan: BatchPlan, budget: int, cost: DecodeCost) -> BatchPlan:
    """``plan`` with the draft tokens that pay, within ``budget`` (see the module's rule).

    Only entries that decode get drafts, at most their view's ``draft_tokens``.
    """
    views = {view.seq_id: view for view in slots}
    entries = list(plan.slots)
    # The tick's decode rows: one token each, expected, at ``cost``'s price (measured on
    # decode rows). Prompt chunks are left out of both sides: their tokens are cheaper
    # per token and yield none, so leaving them out errs toward fewer drafts.
    rows = plan.num_decode_tokens + plan.num_draft_tokens
    margin = _MARGIN if rows <= 1 else _CROWDED_MARGIN
    expected = float(rows)
    base_ms = cost.batch_ms(rows)
    best, best_rate = 0, expected / base_ms if rows else 0.0
    heap: list[tuple[float, int, int, float]] = []  # (-gain, entry index, i, acceptance)
    for index, entry in enumerate(entries):
        view = views.get(entry.seq_id)
        if not entry.decode or view is None or view.draft_tokens <= entry.draft_tokens:
            continue
        a = min(max(float(view.draft_acceptance), 0.0), _MAX_ACCEPTANCE)
        i = entry.draft_tokens + 1
        if a > 0.0:
            heapq.heappush(heap, (-(a**i), index, i, a))
    picks: list[int] = []  # entry index of each candidate, best first
    while heap and len(picks) < budget:
        neg_gain, index, i, a = heapq.heappop(heap)
        if -neg_gain < _NEGLIGIBLE:
            break  # what is left adds next to nothing, and every row costs
        picks.append(index)
        expected -= neg_gain
        rate = expected / (base_ms + margin * (cost.batch_ms(rows + len(picks)) - base_ms))
        if rate > best_rate:
            best, best_rate = len(picks), rate
        if i < views[entries[index].seq_id].draft_tokens:
            heapq.heappush(heap, (-(a ** (i + 1)), index, i + 1, a))
    if not best:
        return plan
    extra = [0] * len(entries)
    for index in picks[:best]:
        extra[index] += 1
    return BatchPlan(
        tuple(
            SlotPlan(e.seq_id, e.decode, e.prefill_tokens, e.draft_tokens + n) if n else e
            for e, n in zip(entries, extra, strict=True)
        )
    )
