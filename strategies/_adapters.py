"""Which LoRA adapter set a tick serves, when the busy slots run more than one.

llama.cpp applies one adapter set to the whole context (``llama_set_adapters_lora``),
so one ``llama_decode`` serves only the slots of one set; the others wait for a tick of
their own. Switching sets is not free: the next decode re-reserves llama.cpp's compute
graph (8-11 ms on a quiet 2-core AMD EPYC with SmolLM2-135M, where a one-row decode
takes 13-17 ms: ``bench/lora.py``), so a set keeps the batch for ``quantum`` ticks in a
row while it has work.

The rule (:func:`fair_adapters`), pure like every strategy:

1. The set served last tick keeps the batch while it has work and has had fewer than
   ``quantum`` ticks in a row.
2. Otherwise the set whose slot has waited the most ticks goes next (then the set with
   more slots, then the one with the oldest request): a round robin over the sets with
   work, so no set waits more than ``quantum`` ticks per other set before its turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from strategies._types import AdapterSet, SlotView

__all__ = ["fair_adapters"]


def fair_adapters(
    slots: Sequence[SlotView], current: AdapterSet | None, streak: int, quantum: int
) -> AdapterSet:
    """The adapter set to serve this tick (see the module's docstring).

    Args:
        slots: the busy slots' views (at least one).
        current: the set the last tick served (None: none yet).
        streak: how many ticks in a row ``current`` has been served.
        quantum: the most ticks in a row a set keeps the batch while another waits.
    """
    groups: dict[AdapterSet, list[SlotView]] = {}
    for view in slots:
        groups.setdefault(view.adapters, []).append(view)
    if len(groups) == 1:
        return next(iter(groups))
    if current in groups and streak < quantum:
        return current
    others = [key for key in groups if key != current] or list(groups)

    def urgency(key: AdapterSet) -> tuple[int, int, int]:
        views = groups[key]
        return (max(v.waited_ticks for v in views), len(views), -min(v.arrival for v in views))

    return max(others, key=urgency)
