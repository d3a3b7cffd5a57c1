"""The engine on a scripted backend (``tests/fake_backend.py``): no model, milliseconds.

Scheduling, KV pressure, preemption, prefix sharing, speculation accounting and
finishing, each checked against the solo run of the fake model: a request's tokens must
not depend on which slots, cells, batches or cache paths served it, and the fake KV
cache asserts what llama.cpp would abort on. As vLLM tests its scheduler without GPUs.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any

import pykka
import pytest
from fake_backend import EOG, FakeBackend, solo
from speculation import AllDrafts

from actors.contract import (
    Completion,
    Done,
    GenerateTokens,
    InvalidRequest,
    QueueFull,
    SamplingParams,
    StrategyError,
    StreamTokens,
    Token,
)
from actors.engine import Engine, EngineConfig, courier, prepare
from strategies import Balanced, BatchPlan, DecodeCost, DecodeMaximal, PrefillPriority

pytestmark = pytest.mark.timeout(60)


class Sender:
    """What the engine names as the sender of its signals, and the stalls it was told of."""

    def __init__(self) -> None:
        self.stalled: list[Any] = []

    def on_stall(self, message: Any) -> None:
        self.stalled.append(message)


def engine(backend: FakeBackend | None = None, **config: Any) -> Engine:
    options: dict[str, Any] = {
        "chunk_size": 16,
        "max_queue": 8,
        "cache_prompt": True,
        "batch_strategy": DecodeMaximal(),
        "defaults": SamplingParams(temp=0.0),
        **config,
    }
    sender = Sender()
    return Engine(backend or FakeBackend(), EngineConfig(**options), sender, on_stall=sender.on_stall)


def submit(e: Engine, tokens: Sequence[int], **options: Any) -> pykka.ThreadingFuture[Any]:
    future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
    message = GenerateTokens(tuple(tokens), temp=0, **options)
    e.admit(prepare(e.backend, message, e.n_ctx_slot), future=future)
    return future


def run(e: Engine, ticks: int = 10_000) -> int:
    n = 0
    while e.has_work:
        e.step()
        n += 1
        assert n < ticks, "the engine does not finish"
    return n


def prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 30 for i in range(n)]


def result(future: pykka.ThreadingFuture[Any]) -> Completion:
    value = future.get(timeout=0)
    assert isinstance(value, Completion)
    return value


# -- scheduling --------------------------------------------------------------------


def test_each_request_gets_its_solo_run_whatever_the_batch() -> None:
    e = engine()
    prompts = [prompt(i, 5 + 9 * i) for i in range(6)]  # more than the 4 slots: some wait
    futures = [submit(e, p, max_tokens=12) for p in prompts]
    run(e)
    for p, f in zip(prompts, futures, strict=True):
        got = result(f)
        assert list(got.token_ids) == solo(e.backend.model, p, 12)  # type: ignore[attr-defined]
        assert got.stop_reason == "max_tokens" and got.prompt_tokens == len(p)


@pytest.mark.parametrize("strategy", [DecodeMaximal(), PrefillPriority(), Balanced()])
def test_every_strategy_gives_the_same_tokens(strategy: Any) -> None:
    e = engine(batch_strategy=strategy, chunk_size=8)
    prompts = [prompt(i, 30 + i) for i in range(4)]
    futures = [submit(e, p, max_tokens=10) for p in prompts]
    run(e)
    for p, f in zip(prompts, futures, strict=True):
        assert list(result(f).token_ids) == solo(e.backend.model, p, 10)  # type: ignore[attr-defined]


def test_a_full_queue_refuses_and_a_bad_token_is_refused_before_queueing() -> None:
    e = engine(max_queue=1)
    for i in range(5):  # 4 slots and 1 place in the queue
        submit(e, prompt(i, 4), max_tokens=4)
    with pytest.raises(QueueFull):
        submit(e, prompt(9, 4), max_tokens=4)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        prepare(e.backend, GenerateTokens((1, 99), temp=0), e.n_ctx_slot)
    run(e)


def test_admission_trusts_prepare_only_for_its_own_context() -> None:
    # prepare() checks the prompt once; a request fitted to another slot context is
    # refused, not admitted on the other context's word.
    e = engine()
    other = prepare(e.backend, GenerateTokens(tuple(prompt(1, 4)), temp=0), e.n_ctx_slot * 2)
    with pytest.raises(InvalidRequest, match="another context"):
        e.admit(other, future=pykka.ThreadingFuture())
    assert not e.has_work and not e.requests


def test_a_prompt_is_prefilled_in_chunks_of_chunk_size() -> None:
    backend = FakeBackend()
    e = engine(backend, chunk_size=8)
    submit(e, prompt(1, 40), max_tokens=2)
    run(e)
    sizes = [len(rows) for rows in backend.rows.passes]
    assert max(sizes) <= 8 and sum(sizes) == 40 + 1  # the prompt, then the one decode row


# -- finishing ----------------------------------------------------------------------


def test_the_end_token_stops_and_ignore_eos_goes_on() -> None:
    def stops_at_five(tokens: Sequence[int]) -> Any:
        logits = FakeBackend().model(tokens)
        if len(tokens) >= 8:
            logits[EOG] = 100.0
        return logits

    e = engine(FakeBackend(model=stops_at_five))
    ended = submit(e, prompt(1, 3), max_tokens=20)
    forced = submit(e, prompt(1, 3), max_tokens=20, ignore_eos=True)
    run(e)
    assert result(ended).stop_reason == "eog" and len(result(ended).token_ids) == 5
    assert result(forced).stop_reason == "max_tokens" and len(result(forced).token_ids) == 20


def test_a_stream_sends_each_token_then_done_and_samplers_are_freed() -> None:
    backend = FakeBackend()
    e = engine(backend)
    events: queue.Queue[Any] = queue.Queue()
    message = StreamTokens(tuple(prompt(2, 6)), temp=0, max_tokens=7, reply_to=events)
    e.admit(prepare(backend, message, e.n_ctx_slot), reply_to=events)
    run(e)
    got = [events.get_nowait() for _ in range(events.qsize())]
    tokens = [ev.token_id for ev in got if isinstance(ev, Token)]
    assert isinstance(got[-1], Done) and tokens == list(got[-1].completion.token_ids)
    assert tokens == solo(backend.model, prompt(2, 6), 7)
    assert not backend.sampling.live  # every sampler made was freed


def test_a_cancelled_request_frees_its_slot_and_sampler() -> None:
    backend = FakeBackend()
    e = engine(backend, cache_prompt=False)
    future = submit(e, prompt(3, 10), max_tokens=1000, ignore_eos=True)
    for _ in range(5):
        e.step()
    e.cancel(future_request_id(e))
    run(e)
    assert result(future).stop_reason == "cancelled"
    assert not backend.sampling.live and e.stats()["idle_slots"] == 4
    assert e.state.memory.cells.used == backend.kv.used  # the engine's books are llama.cpp's
    again = submit(e, prompt(4, 12), max_tokens=5)
    run(e)
    assert list(result(again).token_ids) == solo(backend.model, prompt(4, 12), 5)


def test_a_stream_nobody_reads_is_reported_through_on_stall_and_cancelled_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine never blocks on a consumer: the courier holds what a full queue cannot
    # take and tells on_stall (not the actor directly); the owner's cancel ends it.
    monkeypatch.setattr(courier, "stall_s", 0.05)
    backend = FakeBackend()
    e = engine(backend)
    events: queue.Queue[Any] = queue.Queue(maxsize=1)
    message = StreamTokens(tuple(prompt(5, 6)), temp=0, max_tokens=5000, ignore_eos=True, reply_to=events)
    e.admit(prepare(backend, message, e.n_ctx_slot), reply_to=events)
    sender = e.state.sender
    deadline = time.monotonic() + 10
    while not sender.stalled and time.monotonic() < deadline:
        e.step()
        time.sleep(0.001)
    assert sender.stalled == [message]
    e.cancel(message.request_id, message)
    assert not e.has_work and not backend.sampling.live


def future_request_id(e: Engine) -> str:
    (request_id,) = {r.request_id for r in e.requests.values()}
    return request_id


# -- KV pressure, preemption, sharing ------------------------------------------------


def test_kv_pressure_preempts_and_every_request_still_gets_its_solo_run() -> None:
    # 64 cells for 4 requests that each need 40: the engine must preempt and recompute.
    backend = FakeBackend(n_ctx=64, n_seq_max=4)
    e = engine(backend, n_ctx_per_slot=48)
    prompts = [prompt(i, 10) for i in range(4)]
    futures = [submit(e, p, max_tokens=30, ignore_eos=True) for p in prompts]
    run(e)
    for p, f in zip(prompts, futures, strict=True):
        got = result(f)
        assert list(got.token_ids) == solo(backend.model, p, 30), "a preempted request changed its tokens"
    assert e.state.preemptions > 0
    assert backend.kv.used <= backend.n_ctx


def test_a_shared_prefix_is_copied_not_recomputed() -> None:
    backend = FakeBackend(n_ctx=512)
    e = engine(backend)
    system = prompt(5, 48)
    first = submit(e, [*system, 3, 4], max_tokens=4)
    run(e)
    computed = sum(len(rows) for rows in backend.rows.passes)
    second = submit(e, [*system, 9, 9, 9], max_tokens=4)
    run(e)
    second_rows = sum(len(rows) for rows in backend.rows.passes) - computed
    got = result(second)
    assert got.prefix_cache_tokens >= len(system)
    assert second_rows < 10  # the three new prompt tokens and four decodes, not 51 rows
    assert list(got.token_ids) == solo(backend.model, [*system, 9, 9, 9], 4)
    assert list(result(first).token_ids) == solo(backend.model, [*system, 3, 4], 4)


def test_concurrent_requests_on_one_prefix_share_its_cells() -> None:
    backend = FakeBackend(n_ctx=512)
    e = engine(backend)
    system = prompt(6, 64)
    futures = [submit(e, [*system, 1 + i], max_tokens=3) for i in range(4)]
    run(e)
    for i, f in enumerate(futures):
        assert list(result(f).token_ids) == solo(backend.model, [*system, 1 + i], 3)
    assert backend.kv.copies > 0


def test_a_completion_counts_the_context_shifts_it_needed() -> None:
    p = prompt(3, 20)
    for shift in (True, False):
        e = engine(FakeBackend(n_ctx=128), context_shift=shift)  # 32 positions a slot
        future = submit(e, p, max_tokens=40)
        run(e)
        got = result(future)
        if shift:  # 20 + 40 tokens through 32 positions: at least one shift, counted
            assert got.generated_tokens == 40 and got.stop_reason == "max_tokens"
            assert got.context_shifts >= 1
        else:  # the context's end stops it instead
            assert got.stop_reason == "length" and got.context_shifts == 0
    e = engine()
    short = submit(e, p, max_tokens=4)
    run(e)
    assert result(short).context_shifts == 0


# -- speculation ---------------------------------------------------------------------


def test_ngram_speculation_keeps_the_tokens_and_counts_what_it_accepts() -> None:
    def repeats(tokens: Sequence[int]) -> Any:  # a period-4 pattern: n-gram drafts hit
        logits = FakeBackend().model(tokens) * 0
        logits[1 + len(tokens) % 4] = 10.0
        return logits

    backend = FakeBackend(model=repeats, n_ctx=512)
    e = engine(backend, spec_type="ngram", draft_max=4)
    p = [1, 2, 3, 4, 1, 2, 3, 4]
    future = submit(e, p, max_tokens=40)
    ticks = run(e)
    got = result(future)
    assert list(got.token_ids) == solo(repeats, p, 40)
    assert got.draft_tokens >= got.draft_accepted > 0
    assert ticks < 40  # accepted drafts: fewer ticks than tokens
    stats = e.stats()
    assert stats["draft_tokens"] == got.draft_tokens and stats["draft_accepted"] == got.draft_accepted


def test_draft_min_verifies_a_draft_of_that_many_tokens_or_none() -> None:
    def repeats(tokens: Sequence[int]) -> Any:  # period 4: every n-gram draft has 4 tokens
        logits = FakeBackend().model(tokens) * 0
        logits[1 + len(tokens) % 4] = 10.0
        return logits

    class UpTo(AllDrafts):  # verifies at most ``k`` draft tokens a slot
        def __init__(self, k: int) -> None:
            super().__init__()
            self.k = k

        def plan_drafts(self, slots: Any, plan: BatchPlan, budget: int, cost: DecodeCost) -> BatchPlan:
            return super().plan_drafts(slots, plan, min(budget, self.k), cost)

    p = [1, 2, 3, 4, 1, 2, 3, 4]

    def verified(strategy: DecodeMaximal, draft_min: int) -> tuple[Completion, list[int]]:
        """The completion, and the draft tokens of each tick that verified a draft."""
        backend = FakeBackend(model=repeats, n_ctx=512)
        e = engine(backend, spec_type="ngram", draft_max=8, draft_min=draft_min, batch_strategy=strategy)
        future = submit(e, p, max_tokens=40)
        runs = []
        while e.has_work:
            e.step()
            if e.state.now.drafts:
                runs.append(e.state.now.draft_tokens)
        got = result(future)
        assert list(got.token_ids) == solo(repeats, p, 40)  # drafts or none, the same tokens
        return got, runs

    # A draft has 4 tokens, fewer near max_tokens: those go with draft_min 4, and every
    # draft with 5 (the drafter never has that many).
    _, runs = verified(AllDrafts(), 0)
    assert max(runs) == 4 and min(runs) < 4
    got, runs = verified(AllDrafts(), 4)
    assert got.draft_accepted > 0 and set(runs) == {4}
    got, runs = verified(AllDrafts(), 5)
    assert got.draft_tokens == 0 and not runs
    # A strategy that verifies 2 of them: verified with draft_min 2, never with 3.
    got, runs = verified(UpTo(2), 2)
    assert got.draft_accepted > 0 and set(runs) == {2}
    got, runs = verified(UpTo(2), 3)
    assert got.draft_tokens == 0 and not runs


def test_a_strategy_that_plans_a_slot_twice_fails_the_batch_not_the_engine() -> None:
    class Twice(DecodeMaximal):
        def build_batch(self, slots: Any, budget: int, chunk: int, *, queue_depth: int) -> BatchPlan:
            plan = super().build_batch(slots, budget, chunk, queue_depth=queue_depth)
            return BatchPlan((*plan.slots, *plan.slots)) if plan.slots else plan

    backend = FakeBackend()
    e = engine(backend, batch_strategy=Twice())
    future = submit(e, prompt(1, 4), max_tokens=3)
    run(e)
    with pytest.raises(StrategyError, match="twice"):
        future.get(timeout=0)
    healthy = engine(backend, batch_strategy=DecodeMaximal())
    ok = submit(healthy, prompt(1, 4), max_tokens=3)
    run(healthy)
    assert list(result(ok).token_ids) == solo(backend.model, prompt(1, 4), 3)
