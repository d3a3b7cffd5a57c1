"""Faults injected at precise points of a real engine: every request ends once, nobody hangs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, same_greedy, wait_until

import telemetry
from actors import (
    DecodeError,
    EngineError,
    EngineStopped,
    Failed,
    Generate,
    GetStats,
    Stream,
    Supervisor,
    generate,
    stream,
)
from actors.backend._faults import faults

StartServer = Callable[..., pykka.ActorRef[Any]]


@pytest.fixture(autouse=True)
def clean_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


def on_call(n: int, code: int) -> Callable[[int], int | None]:
    """A decode hook that reports ``code`` on the n-th decode call after it is set."""
    seen: list[int] = []

    def hook(call: int) -> int | None:
        seen.append(call)
        return code if len(seen) == n else None

    return hook


def settle(ref: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    stats: dict[str, Any] = ref.ask(GetStats())
    while stats["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = ref.ask(GetStats())
    return stats


def test_no_kv_space_on_one_decode_is_retried_transparently(server: pykka.ActorRef[Any]) -> None:
    recorder = Recorder()
    options = {"max_tokens": 12, "temp": 0, "logit_bias": NO_EOG}
    reference = generate(server, "Once upon a time", **options, logprobs=2)
    faults.decode = on_call(3, 1)
    futures = [server.ask(Generate("Once upon a time", **options)) for _ in range(2)]
    for future in futures:  # the retry runs smaller batches: the same tokens
        same_greedy(reference, future.get(timeout=60).token_ids)
    assert recorder.of("kv_pressure")


@pytest.mark.parametrize("code", [-1, -3, 2])
def test_a_failed_decode_fails_the_active_requests_and_the_engine_serves_on(
    server: pykka.ActorRef[Any], code: int
) -> None:
    recorder = Recorder()
    faults.decode = on_call(3, code)
    futures = [server.ask(Generate(f"Story {i}", max_tokens=20, logit_bias=NO_EOG)) for i in range(3)]
    for future in futures:
        with pytest.raises(DecodeError, match=f"code {code}"):
            future.get(timeout=30)
    assert len(recorder.of("exception")) == 3
    assert settle(server)["active_slots"] == 0
    assert generate(server, "Fine again", max_tokens=3, logit_bias=NO_EOG).generated_tokens == 3


def test_an_exception_while_sampling_fails_only_that_request(server: pykka.ActorRef[Any]) -> None:
    doomed: list[int] = []

    def sample(index: int) -> None:
        if len(doomed) < 1 and index == 1:
            doomed.append(index)
            raise RuntimeError("sampler exploded")

    others = [server.ask(Generate(f"Plain {i}", max_tokens=40, logit_bias=NO_EOG)) for i in range(3)]
    # All three are decoding (batch rows 0, 1, 2) before the fault: a fixed sleep was too
    # long once decoding got faster, and every request had ended.
    wait_until(lambda: server.ask(GetStats())["generating_slots"] == 3, seconds=30)
    faults.sample = sample
    outcomes = []
    for future in others:
        try:
            outcomes.append(future.get(timeout=30).generated_tokens)
        except EngineError as e:
            outcomes.append(str(e))
    failed = [o for o in outcomes if isinstance(o, str)]
    assert len(failed) == 1 and "sampler exploded" in failed[0]
    assert sorted(o for o in outcomes if isinstance(o, int)) == [40, 40]


def test_a_slow_receiver_slows_but_does_not_stop_the_engine(server: pykka.ActorRef[Any]) -> None:
    calls: list[float] = []

    def slow(sender: Any, **payload: Any) -> None:
        calls.append(time.monotonic())
        time.sleep(1.0)

    telemetry.request_start.connect(slow)
    try:
        t0 = time.monotonic()
        completion = generate(server, "Hello", max_tokens=4, logit_bias=NO_EOG, timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        telemetry.request_start.disconnect(slow)
    assert completion.generated_tokens == 4 and calls
    assert elapsed >= 1.0  # the receiver ran in the engine thread: its second is everyone's


def test_stop_with_queued_and_running_requests_fails_all_at_once(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, max_queue=16)
    futures = [ref.ask(Generate(f"Job {i}", max_tokens=500, logit_bias=NO_EOG)) for i in range(14)]
    assert ref.ask(GetStats())["queue_depth"] == 10
    t0 = time.monotonic()
    ref.stop()
    for future in futures:
        with pytest.raises(EngineStopped):
            future.get(timeout=5)
    assert time.monotonic() - t0 < 5


def test_a_crashed_tick_restarts_under_a_supervisor(model_path: str) -> None:
    recorder = Recorder()
    sup = Supervisor.start(model_path=model_path, n_parallel=2, n_ctx=2048, max_restarts=3, max_seconds=30)
    try:
        q: queue.Queue[Any] = queue.Queue()
        sup.tell(Stream("A long story", reply_to=q, max_tokens=500, logit_bias=NO_EOG))
        running = sup.ask(Generate("Another", max_tokens=500, logit_bias=NO_EOG))
        first = sup.actor_ref
        time.sleep(0.3)
        faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("tick crashed"))
        t0 = time.monotonic()
        with pytest.raises(EngineStopped, match="crashed"):
            running.get(timeout=5)
        event = q.get(timeout=5)
        while not isinstance(event, Failed):
            event = q.get(timeout=5)
        assert isinstance(event.error, EngineStopped)
        assert time.monotonic() - t0 < 1.0
        faults.reset()
        completion = generate(sup, "After the restart", max_tokens=3, logit_bias=NO_EOG, timeout=30)
        assert completion.generated_tokens == 3
        assert sup.actor_ref is not first and sup.restarts == 1
        assert recorder.of("restart") or [m for k, m, _ in recorder.events if k == "server_restart"]
        assert list(stream(sup, "Streams too", max_tokens=2, logit_bias=NO_EOG))
    finally:
        sup.stop()
        pykka.ActorRegistry.stop_all()


def test_a_supervisor_gives_up_after_max_restarts(model_path: str) -> None:
    sup = Supervisor.start(model_path=model_path, n_parallel=1, n_ctx=512, max_restarts=2, max_seconds=30)
    try:
        faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("always crashes"))
        for _ in range(3):
            with pytest.raises(EngineError):
                generate(sup, "doomed", max_tokens=2, timeout=10)
        deadline = time.monotonic() + 10
        while sup.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sup.is_alive()
        with pytest.raises(EngineStopped, match="gave up"):
            sup.ask(GetStats())
    finally:
        faults.reset()
        sup.stop()
        pykka.ActorRegistry.stop_all()


def test_load_every_request_has_exactly_one_outcome(start_server: StartServer) -> None:
    import random

    recorder = Recorder()
    # 16 callers on 8 slots and a queue of 4: some requests find it full.
    ref = start_server(n_parallel=8, max_queue=4, n_ctx=4096)
    outcomes: dict[str, str] = {}
    lock = threading.Lock()

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for k in range(6):
            request_id = f"{seed}-{k}"
            n = rng.randint(1, 24)
            try:
                if rng.random() < 0.5:
                    c = generate(ref, f"Load {seed} {k}", max_tokens=n, request_id=request_id, timeout=120)
                    result = c.stop_reason
                else:
                    pieces = stream(ref, f"Load {seed} {k}", max_tokens=n, request_id=request_id, timeout=120)
                    for i, _ in enumerate(pieces):
                        if rng.random() < 0.1 and i > 0:
                            pieces.close()  # type: ignore[attr-defined]
                            break
                    result = "streamed"
            except EngineError as e:
                result = type(e).__name__
            with lock:
                assert request_id not in outcomes
                outcomes[request_id] = result

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert len(outcomes) == 16 * 6
    assert set(outcomes.values()) <= {"eog", "max_tokens", "streamed", "cancelled", "QueueFull"}
    settle(ref)
    starts = {md["request_id"] for _, md in recorder.of("start")}
    ends = [md["request_id"] for _, md in recorder.of("done") + recorder.of("exception")]
    assert len(ends) == len(set(ends)) and set(ends) == starts
    assert ref.ask(GetStats())["active_slots"] == 0


def test_deadline_ends_running_and_queued_requests_with_timeout(start_server: StartServer) -> None:
    ref = start_server(n_parallel=1)
    running = ref.ask(Generate("Long", max_tokens=2000, logit_bias=NO_EOG, deadline_s=0.5))
    queued = ref.ask(Generate("Waits", max_tokens=5, deadline_s=0.3))
    blocker_after = ref.ask(Generate("After", max_tokens=3, logit_bias=NO_EOG))
    late = queued.get(timeout=10)
    assert late.stop_reason == "timeout" and late.generated_tokens == 0
    first = running.get(timeout=10)
    assert first.stop_reason == "timeout" and 0 < first.generated_tokens < 2000
    assert blocker_after.get(timeout=30).generated_tokens == 3


def test_lower_priority_runs_first_fifo_within_a_priority(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=1)
    blocker = ref.ask(Generate("Blocker", max_tokens=30, logit_bias=NO_EOG))
    order = [("late-low", 5), ("urgent-1", -1), ("normal", 0), ("urgent-2", -1)]
    futures = [ref.ask(Generate(name, max_tokens=1, request_id=name, priority=p)) for name, p in order]
    blocker.get(timeout=60)
    for future in futures:
        future.get(timeout=60)
    started = [md["request_id"] for _, md in recorder.of("start")][1:]
    assert started == ["urgent-1", "urgent-2", "normal", "late-low"]


def test_drain_finishes_the_work_then_stops(start_server: StartServer) -> None:
    from actors import Drain

    ref = start_server(n_parallel=2)
    futures = [ref.ask(Generate(f"Job {i}", max_tokens=20, logit_bias=NO_EOG)) for i in range(4)]
    drained = ref.ask(Drain(timeout=60))
    with pytest.raises(EngineStopped, match="draining"):
        ref.ask(Generate("too late"))
    assert all(f.get(timeout=60).generated_tokens == 20 for f in futures)
    assert drained.get(timeout=60) == 0
    ref.actor_stopped.wait(5)
    assert not ref.is_alive()


def test_a_drain_that_times_out_fails_what_is_left(start_server: StartServer) -> None:
    from actors import Drain

    ref = start_server(n_parallel=1)
    futures = [ref.ask(Generate(f"Job {i}", max_tokens=2000, logit_bias=NO_EOG)) for i in range(3)]
    assert ref.ask(Drain(timeout=0.3)).get(timeout=30) == 3
    for future in futures:
        with pytest.raises(EngineStopped, match="drain timed out"):
            future.get(timeout=5)
