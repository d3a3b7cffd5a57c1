"""Choosing a tick's LoRA adapter set (``fair_adapters``) as a pure function."""

from __future__ import annotations

import dataclasses

import pytest

from strategies import AdapterSet, DecodeMaximal, SlotState, SlotView, fair_adapters

A: AdapterSet = ((0, 1.0),)
B: AdapterSet = ((1, 1.0),)
C: AdapterSet = ((0, 0.5), (1, 0.5))


def view(seq_id: int, adapters: AdapterSet, waited: int = 0, arrival: int = 0) -> SlotView:
    return SlotView(seq_id, SlotState.GENERATING, True, 0, 3, arrival, adapters=adapters, waited_ticks=waited)


def test_one_set_is_served_whatever_the_streak() -> None:
    views = [view(0, A), view(1, A, 5)]
    assert fair_adapters(views, A, 100, 2) == A
    assert fair_adapters(views, None, 0, 2) == A


def test_the_set_served_keeps_the_batch_within_its_quantum() -> None:
    views = [view(0, A), view(1, B, waited=7)]
    assert fair_adapters(views, A, 1, 2) == A
    assert fair_adapters(views, A, 2, 2) == B


def test_after_its_quantum_the_longest_wait_goes_next_then_more_slots_then_older() -> None:
    views = [view(0, A), view(1, B, 3), view(2, C, 5)]
    assert fair_adapters(views, A, 2, 2) == C
    tied = [view(0, A), view(1, B, 4, arrival=9), view(2, C, 4, arrival=1), view(3, B, 0, arrival=8)]
    assert fair_adapters(tied, A, 2, 2) == B  # more slots
    older = [view(0, A), view(1, B, 4, arrival=9), view(2, C, 4, arrival=1)]
    assert fair_adapters(older, A, 2, 2) == C  # the older request


def test_a_set_no_longer_busy_is_not_kept() -> None:
    assert fair_adapters([view(0, B), view(1, C, 1)], A, 0, 2) == C


@pytest.mark.parametrize(("sets", "quantum"), [(2, 1), (3, 2), (8, 2), (5, 4)])
def test_no_set_waits_more_than_a_quantum_per_other_set(sets: int, quantum: int) -> None:
    """Simulated ticks: the chosen set's slots are served (their wait resets), the others
    wait a tick more; a set of many slots does not crowd out a set of one."""
    groups: list[AdapterSet] = [((i, 1.0),) for i in range(sets)]
    views = [view(i, groups[i % sets], arrival=i) for i in range(sets * 2 + 1)]
    current: AdapterSet | None = None
    streak, longest = 0, 0
    served = {g: 0 for g in groups}
    for _ in range(200):
        chosen = fair_adapters(views, current, streak, quantum)
        served[chosen] += 1
        streak = streak + 1 if chosen == current else 1
        current = chosen
        views = [
            dataclasses.replace(v, waited_ticks=0 if v.adapters == chosen else v.waited_ticks + 1)
            for v in views
        ]
        longest = max(longest, *(v.waited_ticks for v in views))
    assert longest <= quantum * (sets - 1)
    assert max(served.values()) - min(served.values()) <= quantum


def test_the_strategy_method_uses_its_quantum() -> None:
    class Long(DecodeMaximal):
        adapter_quantum = 5

    views = [view(0, A), view(1, B, 9)]
    assert Long().choose_adapters(views, current=A, streak=4) == A
    assert DecodeMaximal().choose_adapters(views, current=A, streak=4) == B
