"""Classes 5 and 6: the engine thread never blocks on a consumer, and a full bounded
queue never loses the outcome.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from helpers import NO_EOG, wait_until
from hostile_child import (
    Child,
    Sink,
    _full_queue,
)
from hostile_runner import (
    case,
    check,
)

from actors import (
    Cancel,
    Done,
    Drain,
    EngineStopped,
    Failed,
    GetStats,
    InvalidRequest,
    QueueFull,
    ServerPool,
    Stream,
    StreamTokens,
    generate,
)
from actors.backend._faults import faults
from actors.engine._delivery import courier

# -- class 5: the engine thread never blocks on a consumer ---------------------------------------


def _answers_fast(ref: Any, seconds: float = 2.0) -> None:
    t0 = time.monotonic()
    ref.ask(GetStats(), timeout=seconds)
    assert time.monotonic() - t0 < seconds


@case("c05")
def _a_refused_stream_to_a_full_queue(c: Child) -> None:
    q = _full_queue()
    message = StreamTokens([1, 10**7], reply_to=q)
    c.ref.tell(message)
    _answers_fast(c.ref)
    c.serves(c.ref)
    assert q.get(timeout=5) == "unread"
    _, last = c.outcome(q, message.request_id)
    assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last


@case("c05")
def _a_stream_refused_with_queue_full_to_a_full_queue(c: Child) -> None:
    ref = c.start(n_parallel=1, max_queue=0)
    busy, busy_q = c.stream(ref, "Story:", max_tokens=400, temp=0, logit_bias=NO_EOG)
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 1, 20)
    refused = [_full_queue() for _ in range(3)]
    messages = [Stream("x", reply_to=q) for q in refused]
    for message in messages:
        ref.tell(message)
    _answers_fast(ref)
    ref.tell(Cancel(busy))
    c.outcome(busy_q, busy)
    for q, message in zip(refused, messages, strict=True):
        assert q.get(timeout=5) == "unread"
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Failed) and isinstance(last.error, QueueFull), last
    c.serves(ref)


def _stuck_tick(release: threading.Event) -> Callable[[int], None]:
    """A tick hook that holds the engine thread once, until ``release`` (at most 10 s)."""
    held = itertools.count()

    def hook(tick: int) -> None:
        if next(held) == 0:
            release.wait(10)

    return hook


@case("c05")
def _stop_with_full_queues_behind_a_stuck_tick(c: Child) -> None:
    for stop_first in (False, True):
        ref = c.start(n_parallel=1)
        release = threading.Event()
        faults.tick = _stuck_tick(release)
        busy, busy_q = c.stream(ref, "Story:", max_tokens=400, temp=0, logit_bias=NO_EOG)
        time.sleep(0.3)  # the engine is in its tick now
        stopped = ref.stop(block=False) if stop_first else None
        full = [_full_queue() for _ in range(4)]
        messages = [
            Stream(f"Story {i}:", max_tokens=400, logit_bias=NO_EOG, reply_to=q) for i, q in enumerate(full)
        ]
        for message in messages:
            ref.tell(message)  # still in the inbox at stop, or admitted then failed
        release.set()
        t0 = time.monotonic()
        if stopped is None:
            ref.stop(block=True, timeout=5)
        else:
            stopped.get(timeout=5)
        assert time.monotonic() - t0 < 5
        faults.reset()
        _, last = c.outcome(busy_q, busy)
        assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last
        for q, message in zip(full, messages, strict=True):
            assert q.get(timeout=5) == "unread"
            _, last = c.outcome(q, message.request_id)
            assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last


@case("c05")
def _an_unread_stream_does_not_hold_the_others(c: Child) -> None:
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    message = Stream("Story:", max_tokens=48, temp=0, logit_bias=NO_EOG, reply_to=q)
    c.ref.tell(message)
    time.sleep(0.3)
    for _ in range(2):
        completion = generate(c.ref, "Meanwhile", max_tokens=8, temp=0, logit_bias=NO_EOG, timeout=20)
        assert completion.generated_tokens == 8
    _, last = c.outcome(q, message.request_id)
    assert (
        isinstance(last, Done)
        and last.completion.stop_reason == "max_tokens"
        and last.completion.generated_tokens == 48
    ), last


@case("c05")
def _drain_and_stop_with_an_unread_stream(c: Child) -> None:
    ref = c.start(n_parallel=2)
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    message = Stream("Story:", max_tokens=24, temp=0, logit_bias=NO_EOG, reply_to=q)
    ref.tell(message)
    assert ref.ask(Drain(timeout=20)).get(timeout=20) == 0
    _, last = c.outcome(q, message.request_id)
    assert isinstance(last, Done) and last.completion.generated_tokens == 24, last
    ref = c.start(n_parallel=2)
    q = queue.Queue(maxsize=1)
    message = Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=q)
    ref.tell(message)
    time.sleep(0.5)
    t0 = time.monotonic()
    ref.stop(block=True, timeout=5)
    assert time.monotonic() - t0 < 5
    _, last = c.outcome(q, message.request_id)
    assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last


# -- class 6: a full bounded queue never loses the outcome ---------------------------------------


@case("c06")
def _a_bounded_queue_read_late_gets_everything(c: Child) -> None:
    for maxsize in (1, 3):
        q: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        message = Stream("Story:", max_tokens=20, temp=0, logit_bias=NO_EOG, reply_to=q)
        c.ref.tell(message)
        time.sleep(1.0)
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Done) and last.completion.generated_tokens == 20, last


@case("c06")
def _an_unread_stream_is_cancelled_after_stall_s(c: Child) -> None:
    courier.stall_s = 0.5
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    message = Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=q)
    c.ref.tell(message)
    c.idle(c.ref, 15)  # cancelled: the slot is free although nobody read
    _, last = c.outcome(q, message.request_id)
    assert isinstance(last, Done) and last.completion.stop_reason == "cancelled", last
    assert c.terminals.get(message.request_id) == 1


@case("c06")
def _held_events_are_given_up_and_the_consumer_abandoned(c: Child) -> None:
    courier.stall_s, courier.give_up_s = 0.3, 1.0
    abandoned: list[int] = []

    class Abandoned(queue.Queue[Any]):
        def on_abandon(self) -> None:
            abandoned.append(1)

    q = Abandoned(maxsize=1)
    message = Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=q)
    c.ref.tell(message)
    wait_until(lambda: bool(abandoned), 15)
    c.idle(c.ref)
    wait_until(lambda: courier.held() == 0, 5)
    assert abandoned == [1]
    assert c.terminals.get(message.request_id) == 1


@case("c06")
def _a_consumer_whose_put_raises(c: Child) -> None:
    for at, error in ((0, RuntimeError), (3, OSError), (3, TypeError)):

        def fail(event: object, n: int, at: int = at, error: type[Exception] = error) -> None:
            if n == at:
                raise error("consumer gone")

        sink = Sink(fail=fail)
        message = Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=sink)
        c.ref.tell(message)
        c.idle(c.ref)  # the request was cancelled
        wait_until(lambda rid=message.request_id: c.terminals.get(rid) == 1, 10)
        assert len(sink.events) == at
        n = len(sink.events)
        c.watch("a consumer that is gone", lambda sink=sink, n=n: len(sink.events) - n)


@case("c06")
def _a_consumer_whose_put_raises_on_the_terminal_event(c: Child) -> None:
    def fail(event: object, n: int) -> None:
        if isinstance(event, Done | Failed):
            raise RuntimeError("consumer gone at the end")

    sink = Sink(fail=fail)
    message = Stream("Story:", max_tokens=6, temp=0, logit_bias=NO_EOG, reply_to=sink)
    c.ref.tell(message)
    wait_until(lambda: c.terminals.get(message.request_id) == 1, 20)
    assert len(sink.events) == 6
    c.watch("the terminal that raised", lambda: len(sink.events) - 6)


@case("c06")
def _reply_paths_with_only_put(c: Child) -> None:
    sink = Sink()
    message = Stream("Story:", max_tokens=12, temp=0, logit_bias=NO_EOG, reply_to=sink)
    c.ref.tell(message)
    _, last = c.sink_outcome(sink, message.request_id)
    assert isinstance(last, Done) and last.completion.generated_tokens == 12
    bounded = Sink(capacity=1)  # put raises queue.Full while an event is unread
    message = Stream("Story:", max_tokens=12, temp=0, logit_bias=NO_EOG, reply_to=bounded)
    c.ref.tell(message)
    _, last = c.sink_outcome(bounded, message.request_id)
    assert isinstance(last, Done) and last.completion.generated_tokens == 12


@case("c06")
def _streams_sharing_one_bounded_queue(c: Child) -> None:
    q: queue.Queue[Any] = queue.Queue(maxsize=2)
    messages = [
        Stream(f"Story {i}:", max_tokens=10 + i, temp=0, logit_bias=NO_EOG, reply_to=q) for i in range(4)
    ]
    for message in messages:
        c.ref.tell(message)
    events: dict[str, list[Any]] = {m.request_id: [] for m in messages}
    while sum(isinstance(e[-1], Done | Failed) for e in events.values() if e) < len(messages):
        event = q.get(timeout=30)
        events[event.request_id].append(event)
        time.sleep(0.005)
    c.watch("the shared queue", q.qsize)
    for i, message in enumerate(messages):
        _, last = c._checked(events[message.request_id], message.request_id)
        assert isinstance(last, Done) and last.completion.generated_tokens == 10 + i, last


@case("c06")
def _a_pool_stream_to_a_bounded_queue_stays_in_flight_until_it_ends(c: Child) -> None:
    pool = ServerPool.start(replicas=1, model_path=c.model_path, n_ctx=2048, n_parallel=2, n_threads=1)
    try:
        (replica,) = pool.replicas
        c.serves(pool)
        for cancel in (False, True):
            q: queue.Queue[Any] = queue.Queue(maxsize=1)
            message = Stream(
                "Story:", max_tokens=40 if not cancel else 400, temp=0, logit_bias=NO_EOG, reply_to=q
            )
            pool.tell(message)
            time.sleep(0.5)  # its queue is full: the replica's courier holds the rest
            assert pool.router.loads()[replica] == 1, "a held event settled the request in the pool"
            if cancel:
                pool.tell(Cancel(message.request_id))  # reaches the replica: still in flight
            _, last = c.outcome(q, message.request_id)
            assert isinstance(last, Done), last
            assert last.completion.stop_reason == ("cancelled" if cancel else "max_tokens"), last
            wait_until(lambda: pool.router.loads()[replica] == 0, 10)
    finally:
        pool.stop()


@case("c06")
def _two_engines_sharing_one_bounded_reply_path(c: Child) -> None:
    refs = [c.start(n_parallel=1, max_queue=0) for _ in range(2)]
    for ref in refs:
        c.serves(ref)
    barrier = threading.Barrier(2, timeout=1)

    class Slow(queue.Queue[Any]):
        """A bounded queue whose put_nowait takes a moment (a lock, a pipe): both engines
        find it full at the same time."""

        def put_nowait(self, item: Any) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
            super().put_nowait(item)

    q = Slow(maxsize=1)
    q.put("unread")
    # Each engine refuses one stream (its only event is a Failed), both at once.
    messages = [StreamTokens([1, 10**7], reply_to=q) for _ in refs]
    for ref, message in zip(refs, messages, strict=True):
        ref.tell(message)
    time.sleep(0.5)
    assert q.get(timeout=5) == "unread"
    got = [q.get(timeout=3) for _ in messages]
    assert sorted(e.request_id for e in got) == sorted(m.request_id for m in messages)


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
