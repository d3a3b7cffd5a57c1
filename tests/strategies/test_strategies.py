"""Each strategy as a pure function of hand-made slot views (no model)."""

from __future__ import annotations

import copy

import pytest

import strategies
from strategies import BatchPlan, BatchStrategy, SlotPlan, SlotState, SlotView

ALL = [
    strategies.DecodeMaximal(),
    strategies.PrefillPriority(),
    strategies.Balanced(),
    strategies.Adaptive(64),
]


def decoding(seq_id: int, arrival: int) -> SlotView:
    return SlotView(seq_id, SlotState.GENERATING, True, 0, 5, arrival)


def prefilling(seq_id: int, arrival: int, remaining: int) -> SlotView:
    return SlotView(seq_id, SlotState.PREFILLING, False, remaining, 0, arrival)


MIXED = [
    decoding(0, 1),
    prefilling(1, 4, 900),
    decoding(2, 2),
    prefilling(3, 3, 100),
    decoding(4, 5),
]


def by_seq(plan: BatchPlan) -> dict[int, SlotPlan]:
    return {entry.seq_id: entry for entry in plan.slots}


@pytest.mark.parametrize("strategy", ALL, ids=repr)
@pytest.mark.parametrize("budget", [1, 2, 3, 7, 64, 512, 2048])
@pytest.mark.parametrize("chunk_size", [1, 16, 512])
def test_budget_chunk_size_and_pending_tokens_are_respected(
    strategy: BatchStrategy, budget: int, chunk_size: int
) -> None:
    views = list(MIXED)
    before = copy.deepcopy(views)
    plan = strategy.build_batch(views, budget, chunk_size, queue_depth=3)
    assert views == before, "a strategy must not mutate its input"
    assert plan.num_tokens <= budget
    seq_ids = [entry.seq_id for entry in plan.slots]
    assert len(seq_ids) == len(set(seq_ids))
    for entry in plan.slots:
        view = next(v for v in views if v.seq_id == entry.seq_id)
        assert not entry.decode or view.has_pending_token
        assert 0 <= entry.prefill_tokens <= min(chunk_size, view.prefill_remaining)
    # Work-conserving: a budget that covers all the work is used in full
    # (Adaptive holds prefill back on purpose while requests decode).
    work = 3 + min(chunk_size, 900) + min(chunk_size, 100)
    if isinstance(strategy, strategies.Adaptive):
        work = 3 + min(work - 3, strategy.prefill_per_tick)
    assert plan.num_tokens == min(budget, work)


@pytest.mark.parametrize("strategy", ALL, ids=repr)
def test_is_a_pure_function(strategy: BatchStrategy) -> None:
    first = strategy.build_batch(MIXED, 300, 128, queue_depth=0)
    assert strategy.build_batch(list(reversed(MIXED)), 300, 128, queue_depth=0) == first


def test_decode_maximal_decodes_first_then_fills_with_oldest_prefill() -> None:
    plan = by_seq(strategies.DecodeMaximal().build_batch(MIXED, 50, 512, queue_depth=0))
    assert all(plan[s].decode for s in (0, 2, 4))
    # 47 tokens left for prefill: the older prompt (seq 3, arrival 3) gets them all.
    assert plan[3].prefill_tokens == 47
    assert 1 not in plan


def test_decode_maximal_budget_smaller_than_decoders_serves_oldest() -> None:
    plan = strategies.DecodeMaximal().build_batch(MIXED, 2, 512, queue_depth=0)
    assert [(e.seq_id, e.decode) for e in plan.slots] == [(0, True), (2, True)]


def test_prefill_priority_prefills_first_then_decodes() -> None:
    plan = by_seq(strategies.PrefillPriority().build_batch(MIXED, 150, 512, queue_depth=0))
    assert plan[3].prefill_tokens == 100
    assert plan[1].prefill_tokens == 50
    assert not any(entry.decode for entry in plan.values())
    plan = by_seq(strategies.PrefillPriority().build_batch(MIXED, 1002, 512, queue_depth=0))
    assert plan[3].prefill_tokens == 100 and plan[1].prefill_tokens == 512
    assert [s for s, e in plan.items() if e.decode] == [0, 2, 4]


def test_balanced_gives_decode_half_the_budget_at_most() -> None:
    plan = strategies.Balanced().build_batch(MIXED, 4, 512, queue_depth=0)
    assert plan.num_decode_tokens == 2 and plan.num_prefill_tokens == 2
    plan = strategies.Balanced().build_batch(MIXED, 100, 512, queue_depth=0)
    assert plan.num_decode_tokens == 3 and plan.num_prefill_tokens == 97


def test_balanced_gives_unused_prefill_budget_back_to_decode() -> None:
    views = [decoding(i, i) for i in range(6)] + [prefilling(9, 9, 1)]
    plan = strategies.Balanced().build_batch(views, 6, 512, queue_depth=0)
    assert plan.num_prefill_tokens == 1 and plan.num_decode_tokens == 5


@pytest.mark.parametrize("strategy", ALL, ids=repr)
def test_no_slots_gives_an_empty_plan(strategy: BatchStrategy) -> None:
    assert strategy.build_batch([], 512, 512, queue_depth=0) == BatchPlan()


def test_adaptive_caps_prefill_only_while_something_decodes() -> None:
    adaptive = strategies.Adaptive(prefill_per_tick=64)
    plan = by_seq(adaptive.build_batch(MIXED, 2048, 512, queue_depth=0))
    assert all(plan[s].decode for s in (0, 2, 4))
    assert plan[3].prefill_tokens == 64 and 1 not in plan
    only_prompts = [v for v in MIXED if not v.has_pending_token]
    plan = by_seq(adaptive.build_batch(only_prompts, 2048, 512, queue_depth=0))
    assert plan[3].prefill_tokens == 100 and plan[1].prefill_tokens == 512
    with pytest.raises(ValueError):
        strategies.Adaptive(0)
