"""Class 12: a BaseException from a callback stops no actor.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pykka
from helpers import NO_EOG, wait_until
from hostile_child import (
    Child,
    Sink,
    _bias,
    _fails_with_strategy_error,
    _full_queue,
)
from hostile_runner import (
    case,
    check,
)

import telemetry
from actors import (
    Done,
    EngineError,
    EngineStopped,
    Failed,
    Generate,
    GetStats,
    Stream,
    Supervisor,
)
from actors.backend._faults import faults
from actors.engine._delivery import courier
from strategies import SlotView

# -- class 12: a BaseException from a callback stops no actor -------------------------------------


class Custom(BaseException):
    """Neither an Exception nor SystemExit: what a library's own control flow might raise."""


BASE_EXCEPTIONS: dict[str, Callable[[], BaseException]] = {
    "systemexit": lambda: SystemExit(3),
    "keyboardinterrupt": KeyboardInterrupt,
    "custom-baseexception": lambda: Custom("custom"),
    "generatorexit": GeneratorExit,
}


def _raiser(make: Callable[[], BaseException]) -> Callable[..., None]:
    def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        raise make()

    return receive


for _kind, _make in BASE_EXCEPTIONS.items():

    @case("c12", f"receivers-raise-{_kind}")
    def _receivers_raise(c: Child, make: Callable[[], BaseException] = _make) -> None:
        signals = [
            telemetry.tick,
            telemetry.request_start,
            telemetry.request_done,
            telemetry.request_exception,
        ]
        subscription = telemetry.Subscription({s: _raiser(make) for s in signals})
        try:
            completion = c.complete(c.ref, Generate("Story:", max_tokens=6, temp=0, logit_bias=NO_EOG))
            assert completion.stop_reason == "max_tokens"
            rid, q = c.stream(c.ref, "Story:", max_tokens=6, temp=0.5, logit_bias=NO_EOG)
            _, last = c.outcome(q, rid)
            assert isinstance(last, Done)
            c.refused(c.ref, Generate("Hi", logit_bias=_bias(c, lambda t, p: True)))  # request_exception
            c.alive()
            c.serves(c.ref)
        finally:
            subscription.close()

    @case("c12", f"strategy-raises-{_kind}")
    def _strategy_raises(c: Child, make: Callable[[], BaseException] = _make) -> None:
        def plan(slots: Sequence[SlotView], budget: int, chunk_size: int) -> object:
            raise make()

        _fails_with_strategy_error(c, plan, check_alive=True)

    @case("c12", f"put-raises-{_kind}")
    def _put_raises(c: Child, make: Callable[[], BaseException] = _make) -> None:
        def fail(event: object, n: int) -> None:
            if n == 2:
                raise make()

        sink = Sink(fail=fail)
        message = Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=sink)
        c.ref.tell(message)
        c.idle(c.ref)
        wait_until(lambda: c.terminals.get(message.request_id) == 1, 10)
        assert len(sink.events) == 2
        c.watch("a consumer that raised", lambda: len(sink.events) - 2)
        c.alive()


@case("c12")
def _a_model_load_receiver_raises_systemexit(c: Child) -> None:
    subscription = telemetry.Subscription({telemetry.model_load: _raiser(lambda: SystemExit(4))})
    try:
        ref = c.start(n_parallel=1)
        c.serves(ref)
        c.alive()
    finally:
        subscription.close()


@case("c12")
def _the_courier_thread_survives_baseexceptions(c: Child) -> None:
    courier.stall_s, courier.give_up_s = 0.3, 1.0
    armed = threading.Event()

    class Explosive(queue.Queue[Any]):
        def put_nowait(self, item: Any) -> None:
            if armed.is_set():
                raise SystemExit(5)
            super().put_nowait(item)

        def on_abandon(self) -> None:
            raise KeyboardInterrupt

    q = Explosive(maxsize=1)
    q.put("unread")
    c.ref.tell(Stream("Story:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=q))
    time.sleep(0.3)
    armed.set()  # the courier's retry raises SystemExit in the courier's thread
    c.idle(c.ref)
    wait_until(lambda: courier.held() == 0, 10)
    # It still delivers for the next full queue.
    later = _full_queue()
    message = Stream("Story:", max_tokens=5, temp=0, logit_bias=NO_EOG, reply_to=later)
    c.ref.tell(message)
    time.sleep(0.5)
    assert later.get(timeout=5) == "unread"
    _, last = c.outcome(later, message.request_id)
    assert isinstance(last, Done) and last.completion.generated_tokens == 5
    c.alive()


@case("c12")
def _a_tick_that_raises_systemexit_crashes_only_its_engine(c: Child) -> None:
    ref = c.start(n_parallel=1)
    c.serves(ref)

    def hook(tick: int) -> None:
        raise SystemExit(6)

    faults.tick = hook
    rid, q = c.stream(ref, "Story:", max_tokens=20, temp=0)
    _, last = c.outcome(q, rid)
    faults.reset()
    assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last
    wait_until(lambda: not ref.is_alive(), 10)
    c.alive()
    c.serves(c.ref)


@case("c12")
def _a_kv_pressure_receiver_raises_systemexit_at_a_context_shift(c: Child) -> None:
    shifts: list[int] = []

    def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        shifts.append(1)
        raise SystemExit(7)

    subscription = telemetry.Subscription({telemetry.kv_pressure: receive})
    try:
        ref = c.start(n_parallel=1, n_ctx_per_slot=48)
        completion = c.complete(ref, Generate("Story:", max_tokens=60, temp=0, logit_bias=NO_EOG))
        assert completion.stop_reason == "max_tokens" and completion.generated_tokens == 60
        assert shifts, "no context shift happened"
        c.alive()
    finally:
        subscription.close()


@case("c12")
def _a_tick_that_raises_systemexit_under_a_supervisor_restarts(c: Child) -> None:
    subscription = telemetry.Subscription({telemetry.server_restart: _raiser(lambda: SystemExit(8))})
    sup = Supervisor.start(model_path=c.model_path, n_parallel=2, n_ctx=2048, max_restarts=3, max_seconds=30)
    try:
        c.serves(sup)
        first = sup.actor_ref

        def hook(tick: int) -> None:
            raise SystemExit(9)

        faults.tick = hook
        q: queue.Queue[Any] = queue.Queue()
        message = Stream("Story:", max_tokens=50, temp=0, reply_to=q)
        sup.tell(message)
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last
        faults.reset()
        wait_until(lambda: sup.actor_ref is not first and sup.actor_ref.is_alive(), 20)
        c.serves(sup)
        assert sup.restarts == 1
        c.alive()
    finally:
        faults.reset()
        subscription.close()
        sup.stop()


@case("c12")
def _a_callback_that_asks_its_own_engine(c: Child) -> None:
    waits: list[float] = []

    def ask_back(sender: Any) -> None:
        t0 = time.monotonic()
        with contextlib.suppress(EngineError, pykka.Timeout):
            sender.ask(GetStats(), timeout=1)
        waits.append(time.monotonic() - t0)

    subscription = telemetry.Subscription(
        {telemetry.request_start: lambda sender, measurements, metadata: ask_back(sender)}
    )
    try:
        c.serves(c.ref)
    finally:
        subscription.close()
    sink = Sink(fail=lambda event, n: ask_back(c.ref) if n == 0 else None)
    message = Stream("Hi", max_tokens=2, temp=0, reply_to=sink)
    c.ref.tell(message)
    c.sink_outcome(sink, message.request_id)
    assert len(waits) == 2 and max(waits) < 0.5, f"the engine waited on itself for {max(waits):.1f} s"


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
