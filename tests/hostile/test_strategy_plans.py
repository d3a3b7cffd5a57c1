"""Class 9: a strategy's plan is materialized and checked; a bad one fails its requests, never the engine.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from helpers import NO_EOG
from hostile_child import (
    PROMPT_20,
    Child,
    _fails_with_strategy_error,
    _strategy_server,
)
from hostile_runner import (
    case,
    check,
)

from actors import (
    Generate,
)
from strategies import BatchPlan, DecodeMaximal, SlotPlan, SlotView

# -- class 9: a strategy's plan is materialized and checked ------------------------------------


def _good(slots: Sequence[SlotView], budget: int, chunk_size: int) -> BatchPlan:
    return DecodeMaximal().build_batch(slots, budget, chunk_size, queue_depth=0)


def _entries(change: Callable[[SlotPlan], object]) -> Callable[[Sequence[SlotView], int, int], object]:
    def plan(slots: Sequence[SlotView], budget: int, chunk_size: int) -> object:
        return BatchPlan(tuple(change(e) for e in _good(slots, budget, chunk_size).slots))  # type: ignore[misc]

    return plan


def _prefill(n: Callable[[int], object]) -> Callable[[SlotPlan], object]:
    return lambda e: SlotPlan(e.seq_id, e.decode, n(e.prefill_tokens)) if e.prefill_tokens else e  # type: ignore[arg-type]


def _slots_after_construction(slots: Sequence[SlotView], budget: int, chunk_size: int) -> BatchPlan:
    plan = _good(slots, budget, chunk_size)
    object.__setattr__(plan, "slots", (entry for entry in plan.slots))
    return plan


def _raise(error: BaseException) -> Callable[[Sequence[SlotView], int, int], object]:
    def plan(slots: Sequence[SlotView], budget: int, chunk_size: int) -> object:
        raise error

    return plan


GOOD_PLANS: dict[str, Callable[[Sequence[SlotView], int, int], object]] = {
    "batchplan-of-a-generator": lambda s, b, c: BatchPlan(e for e in _good(s, b, c).slots),  # type: ignore[arg-type]
    "slots-replaced-by-a-generator-after-construction": _slots_after_construction,
}

BAD_PLANS: dict[str, Callable[[Sequence[SlotView], int, int], object]] = {
    "a-list": lambda s, b, c: list(_good(s, b, c).slots),
    "none": lambda s, b, c: None,
    "an-object": lambda s, b, c: object(),
    "tuple-entries": _entries(lambda e: (e.seq_id, e.decode, e.prefill_tokens)),
    "dict-entries": _entries(lambda e: {"seq_id": e.seq_id, "prefill_tokens": e.prefill_tokens}),
    "none-entries": _entries(lambda e: None),
    "decode-an-int": _entries(lambda e: SlotPlan(e.seq_id, int(e.decode), e.prefill_tokens)),  # type: ignore[arg-type]
    "prefill-true": _entries(_prefill(lambda n: True)),
    "prefill-a-float": _entries(_prefill(lambda n: n - 0.5)),
    "prefill-a-numpy-int": _entries(_prefill(np.int64)),
    "prefill-negative": _entries(_prefill(lambda n: -1)),
    "prefill-past-the-prompt": _entries(_prefill(lambda n: n + 1)),
    "prefill-10**9": _entries(_prefill(lambda n: 10**9)),
    "seq-id-not-busy": _entries(lambda e: SlotPlan(e.seq_id + 100, e.decode, e.prefill_tokens)),
    "seq-id-a-bool": _entries(lambda e: SlotPlan(bool(e.seq_id), e.decode, e.prefill_tokens)),  # type: ignore[arg-type]
    "seq-id-twice": lambda s, b, c: BatchPlan(_good(s, b, c).slots * 2),
    "decode-while-prefilling": _entries(lambda e: SlotPlan(e.seq_id, True, e.prefill_tokens)),
    "over-the-budget": lambda s, b, c: BatchPlan(
        tuple(SlotPlan(v.seq_id, False, min(c, v.prefill_remaining)) for v in s) * 1
    ),
    "empty-plans-forever": lambda s, b, c: BatchPlan(()),
    "raises-valueerror": _raise(ValueError("strategy bug")),
}


# Over two chunks of 16 tokens: two slots prefilling at once overrun a budget of 16.


for _name, _plan in GOOD_PLANS.items():

    @case("c09", _name)
    def _good_plan(c: Child, plan: Callable[[Sequence[SlotView], int, int], object] = _plan) -> None:
        ref, toggle = _strategy_server(c)
        toggle.bad = plan
        futures = [
            ref.ask(Generate(f"{PROMPT_20} {i}", max_tokens=12, temp=0, logit_bias=NO_EOG)) for i in range(2)
        ]
        for future in futures:
            completion = future.get(timeout=30)
            assert completion.stop_reason == "max_tokens" and completion.generated_tokens == 12


for _name, _plan in BAD_PLANS.items():

    @case("c09", _name)
    def _bad_plan(c: Child, plan: Callable[[Sequence[SlotView], int, int], object] = _plan) -> None:
        _fails_with_strategy_error(c, plan)


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
