"""Plan checking and batch layout, with hand-made slots."""

from __future__ import annotations

import numpy as np
import pytest

from actors.contract import Generate, SamplingParams
from actors.contract._errors import StrategyError
from actors.engine._batch import BatchArrays, check_plan, lay_out
from actors.engine._slots import Request, Slot, common_prefix_len
from strategies import BatchPlan, SlotPlan, SlotState


def arrays(n: int = 64) -> BatchArrays:
    return BatchArrays(
        np.full(n, -1, np.int32),
        np.full(n, -1, np.int32),
        np.full(n, -1, np.int32),
        np.full(n, -1, np.int8),
    )


def busy_slot(seq_id: int, prompt: list[int], cached: int, pending: int = -1) -> Slot:
    request = Request(Generate("x"), prompt, SamplingParams(), arrival=seq_id, sampler=None)
    slot = Slot(seq_id, request=request, cached=prompt[:cached])
    slot.state = SlotState.GENERATING if pending >= 0 else SlotState.PREFILLING
    slot.pending = pending
    return slot


def test_lay_out_asks_logits_for_decodes_and_only_the_last_token_of_a_completed_prompt() -> None:
    gen = busy_slot(0, [5, 6, 7], cached=3, pending=42)
    partial = busy_slot(1, list(range(100, 110)), cached=2)
    completing = busy_slot(2, list(range(200, 206)), cached=3)
    slots = {0: gen, 1: partial, 2: completing}
    plan = BatchPlan((SlotPlan(0, decode=True), SlotPlan(1, prefill_tokens=4), SlotPlan(2, prefill_tokens=3)))
    views = {s.seq_id: s.view() for s in slots.values()}
    check_plan(plan, views, budget=8, chunk_size=4)
    a = arrays()
    segments = lay_out(plan, slots, a)
    n = segments[-1].end
    assert n == 8
    assert a.tokens[:n].tolist() == [42, 102, 103, 104, 105, 203, 204, 205]
    assert a.pos[:n].tolist() == [3, 2, 3, 4, 5, 3, 4, 5]
    assert a.seq_ids[:n].tolist() == [0, 1, 1, 1, 1, 2, 2, 2]
    assert a.logits[:n].tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    assert [s.logits_row for s in segments] == [0, -1, 7]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (BatchPlan((SlotPlan(9, decode=True),)), "not a busy slot"),
        (BatchPlan((SlotPlan(0, decode=True), SlotPlan(0, decode=True))), "twice"),
        (BatchPlan((SlotPlan(1, decode=True),)), "no pending token"),
        (BatchPlan((SlotPlan(1, prefill_tokens=5),)), "allowed 0..4"),
        (BatchPlan((SlotPlan(1, prefill_tokens=-1),)), "allowed"),
        (BatchPlan((SlotPlan(0, prefill_tokens=1),)), "allowed 0..0"),
        (BatchPlan((SlotPlan(0, decode=True), SlotPlan(1, prefill_tokens=4))), "over the budget"),
        (BatchPlan(), "no token"),
        ("not a plan", "must return a BatchPlan"),
    ],
)
def test_check_plan_refuses_what_llama_cpp_would_choke_on(plan: object, message: str) -> None:
    slots = {
        0: busy_slot(0, [1, 2], cached=2, pending=3),
        1: busy_slot(1, list(range(10)), cached=0),
    }
    views = {s: slot.view() for s, slot in slots.items()}
    with pytest.raises(StrategyError, match=message):
        check_plan(plan, views, budget=4, chunk_size=4)


def test_common_prefix_len() -> None:
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    long = list(range(1000))
    assert common_prefix_len(long, [*long[:777], -5]) == 777
    assert common_prefix_len(long, long) == 1000
