"""What the speculative-decoding tests share: prompts a draft can copy from (``GROUNDED``)
and a strategy that verifies every draft token (``AllDrafts``)."""

from __future__ import annotations

from typing import Any

from strategies import BatchPlan, DecodeCost, DecodeMaximal, SlotPlan

PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the great lamp, and wrote the "
    "weather in his book: wind from the west, waves high, one ship far out on the water. "
)
GROUNDED = [
    "Original text:\n" + PASSAGE + "\n\nThe same text, copied exactly:\n" + PASSAGE[:40],
    "The cat sat on the mat. " * 6,
    "Repeat after me: red, green, blue, red, green, blue, red, green, blue, red, green,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
]


class AllDrafts(DecodeMaximal):
    """Verifies every draft token there is, within the budget: the mechanics at any
    batch size (on a CPU the default rule verifies few drafts beside 5 other decoding
    slots, and when depends on timing)."""

    def plan_drafts(self, slots: Any, plan: BatchPlan, budget: int, cost: DecodeCost) -> BatchPlan:
        views = {view.seq_id: view for view in slots}
        entries = []
        for e in plan.slots:
            k = min(views[e.seq_id].draft_tokens, budget) if e.decode else 0
            budget -= k
            entries.append(SlotPlan(e.seq_id, e.decode, e.prefill_tokens, k))
        return BatchPlan(tuple(entries))
