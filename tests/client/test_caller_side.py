"""The caller side under injected faults: timeouts bound the call, stopped handles answer
at once, a stop during a restart leaves nothing running, a late cancel hits nothing new.

Each test injects its fault (a stuck tick, a long prefill tick, a drained or stopped
supervisor, a slow restart, an abandoned stream collected late, a replica that dies
while draining) and asserts a bound with generous slack: never a tight wall time.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, drain, wait_until

import actors.actor._supervisor as supervisor_module
from actors import (
    Cancel,
    Done,
    Drain,
    EngineStopped,
    Failed,
    Generate,
    GetStats,
    RequestTimeout,
    ServerActor,
    ServerPool,
    Stream,
    Supervisor,
    agenerate,
    astream,
    generate,
    stream,
)
from actors.backend._faults import faults
from actors.contract import CancelExact

StartServer = Callable[..., pykka.ActorRef[Any]]
SLACK_S = 2.0  # what a bound may overshoot by on a loaded 2-core machine


@pytest.fixture(autouse=True)
def clean_faults() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event a stuck tick waits for; set at teardown so nothing stays stuck."""
    event = threading.Event()
    yield event
    event.set()
    faults.reset()


@pytest.fixture
def supervised(model_path: str) -> Iterator[Callable[..., Supervisor]]:
    started: list[Supervisor] = []

    def start(**options: Any) -> Supervisor:
        options.setdefault("n_ctx", 1024)
        options.setdefault("n_parallel", 2)
        sup = Supervisor.start(model_path=model_path, **options)
        started.append(sup)
        return sup

    yield start
    faults.reset()
    for sup in started:
        sup.stop(timeout=30)
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def pool(model_path: str) -> Iterator[ServerPool]:
    pool = ServerPool.start(replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1)
    yield pool
    faults.reset()
    pool.stop()
    pykka.ActorRegistry.stop_all()


def stick(release: threading.Event) -> threading.Event:
    """Make every tick wait for ``release``; the returned event is set once one waits."""
    stuck = threading.Event()

    def tick(n: int) -> None:
        stuck.set()
        release.wait(60)

    faults.tick = tick
    return stuck


def idle(ref: Any) -> bool:
    stats = ref.ask(GetStats())
    return bool(stats["active_slots"] == 0 and stats["queue_depth"] == 0)


def stop_reasons(recorder: Recorder, request_id: str) -> list[str]:
    return [md["stop_reason"] for _, md in recorder.of("done") if md["request_id"] == request_id]


def alive_servers() -> list[pykka.ActorRef[Any]]:
    return [ref for ref in pykka.ActorRegistry.get_by_class(ServerActor) if ref.is_alive()]


# -- item 7: a timeout bounds the whole call -------------------------------------------


def test_generate_times_out_behind_a_stuck_tick_and_is_cancelled(
    server: pykka.ActorRef[Any], release: threading.Event
) -> None:
    recorder = Recorder()
    server.ask(Generate("Keep the engine ticking", max_tokens=400, logit_bias=NO_EOG, request_id="blocker"))
    stuck = stick(release)
    assert stuck.wait(30)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        # Its admission waits in the inbox behind the stuck tick.
        generate(
            server, "Never admitted in time", max_tokens=50, logit_bias=NO_EOG, request_id="late", timeout=0.5
        )
    elapsed = time.monotonic() - t0
    print(f"generate(timeout=0.5) behind a stuck tick returned after {elapsed:.2f} s")
    assert elapsed < 0.5 + SLACK_S
    release.set()
    faults.reset()
    # Admitted once the tick ended, then cancelled by the cancel queued behind it.
    wait_until(lambda: stop_reasons(recorder, "late") == ["cancelled"], 30)
    server.tell(Cancel("blocker"))
    wait_until(lambda: idle(server), 30)


def test_generate_times_out_against_an_engine_stuck_after_admission(
    server: pykka.ActorRef[Any], release: threading.Event
) -> None:
    recorder = Recorder()
    stick(release)  # the request is admitted, then its first tick never ends
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        generate(server, "Stuck", max_tokens=50, logit_bias=NO_EOG, request_id="stuck", timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + SLACK_S
    release.set()
    faults.reset()
    wait_until(lambda: stop_reasons(recorder, "stuck") == ["cancelled"], 30)
    wait_until(lambda: idle(server), 30)


def test_generate_times_out_behind_a_long_prefill_tick(start_server: StartServer) -> None:
    # One request's whole prompt in one tick: seconds on a loaded 2-core machine.
    ref = start_server(n_parallel=2, n_ctx=4096, n_batch=2048, chunk_size=2048)
    recorder = Recorder()
    ticks: list[float] = []
    in_tick = threading.Event()

    def tick(n: int) -> None:
        ticks.append(time.monotonic())
        in_tick.set()

    faults.tick = tick
    q: queue.Queue[Any] = queue.Queue()
    ref.tell(Stream("word " * 400, reply_to=q, max_tokens=1))
    assert in_tick.wait(30)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        generate(
            ref, "Behind the prefill", max_tokens=50, logit_bias=NO_EOG, request_id="behind", timeout=0.5
        )
    elapsed = time.monotonic() - t0
    assert isinstance(drain(q, timeout=120)[-1], Done)
    prefill_s = ticks[1] - ticks[0] if len(ticks) > 1 else time.monotonic() - ticks[0]
    print(f"generate(timeout=0.5) behind a {prefill_s:.1f} s prefill tick returned after {elapsed:.2f} s")
    assert elapsed < 0.5 + SLACK_S
    wait_until(lambda: stop_reasons(recorder, "behind") == ["cancelled"], 60)
    wait_until(lambda: idle(ref), 30)


def test_stream_and_agenerate_time_out_against_a_stuck_engine(
    server: pykka.ActorRef[Any], release: threading.Event
) -> None:
    recorder = Recorder()
    stick(release)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        list(stream(server, "Stuck stream", max_tokens=50, request_id="s1", timeout=0.5))
    assert time.monotonic() - t0 < 0.5 + SLACK_S

    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await agenerate(server, "Stuck async", max_tokens=50, request_id="a1", timeout=0.5)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 0.5 + SLACK_S
    release.set()
    faults.reset()
    wait_until(lambda: stop_reasons(recorder, "s1") == ["cancelled"], 30)
    wait_until(lambda: stop_reasons(recorder, "a1") == ["cancelled"], 30)
    wait_until(lambda: idle(server), 30)


def test_agenerate_timeout_bounds_the_whole_await(server: pykka.ActorRef[Any]) -> None:
    # Tokens keep coming, so a per-event timeout would never fire.
    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await agenerate(server, "A long essay", max_tokens=2000, logit_bias=NO_EOG, timeout=1.0)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 1.0 + SLACK_S
    wait_until(lambda: idle(server), 30)


# -- item 7: a supervisor that will not come back answers at once ----------------------


@pytest.mark.parametrize("how", ["drain", "stop_actor", "stop"])
def test_a_stopped_supervisor_refuses_at_once(supervised: Callable[..., Supervisor], how: str) -> None:
    sup = supervised()
    assert generate(sup, "Warm", max_tokens=2, logit_bias=NO_EOG, timeout=30).generated_tokens == 2
    if how == "drain":
        assert sup.drain(Drain(), timeout=30) == 0
    elif how == "stop_actor":
        sup.actor_ref.stop()
    else:
        sup.stop()
    wait_until(lambda: not sup.is_alive(), 10)
    t0 = time.monotonic()
    with pytest.raises(EngineStopped):
        generate(sup, "After", max_tokens=2)
    with pytest.raises(EngineStopped):
        list(stream(sup, "After", max_tokens=2))
    with pytest.raises(EngineStopped):
        asyncio.run(agenerate(sup, "After", max_tokens=2))
    with pytest.raises(EngineStopped):
        sup.ask(GetStats())
    assert time.monotonic() - t0 < SLACK_S
    assert sup.current() is None and sup.restarts == 0


def test_a_drain_through_the_supervisor_waits_for_the_work(supervised: Callable[..., Supervisor]) -> None:
    sup = supervised()
    q: queue.Queue[Any] = queue.Queue()
    sup.tell(Stream("Finish me", reply_to=q, max_tokens=8, logit_bias=NO_EOG))
    assert sup.drain(Drain(timeout=60), timeout=60) == 0
    assert isinstance(drain(q, timeout=5)[-1], Done)
    assert not sup.is_alive()


def test_a_restart_under_way_is_waited_for_at_most_the_timeout(
    supervised: Callable[..., Supervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_module, "_FIRST_BACKOFF_S", 10.0)
    monkeypatch.setattr(supervisor_module, "_MAX_BACKOFF_S", 10.0)
    sup = supervised(max_restarts=3, max_seconds=60)
    first = sup.actor_ref
    faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("tick crashed"))
    with pytest.raises(EngineStopped):
        generate(sup, "Crash it", max_tokens=2, timeout=30)
    faults.reset()
    wait_until(lambda: not first.is_alive(), 10)
    assert sup.is_alive()  # restarting, in a 10 s backoff
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        generate(sup, "During the backoff", max_tokens=2, timeout=0.5)
    with pytest.raises(RequestTimeout):
        sup.ref(0.2)

    async def main() -> float:
        ticks = 0

        async def probe() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(probe())
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await agenerate(sup, "Async, during the backoff", max_tokens=2, timeout=0.5)
        elapsed = time.monotonic() - t0
        task.cancel()
        assert ticks > 5  # the loop kept running while the restart was awaited
        return elapsed

    assert asyncio.run(main()) < 0.5 + SLACK_S
    assert time.monotonic() - t0 < 2 * (0.5 + SLACK_S)


# -- item 11: stop() during a restart leaves nothing running ---------------------------


def test_stop_during_the_backoff_starts_no_engine(
    supervised: Callable[..., Supervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor_module, "_FIRST_BACKOFF_S", 1.0)
    sup = supervised(max_restarts=3, max_seconds=60)
    first = sup.actor_ref
    faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("tick crashed"))
    with pytest.raises(EngineStopped):
        generate(sup, "Crash it", max_tokens=2, timeout=30)
    faults.reset()
    wait_until(lambda: not first.is_alive(), 10)
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < SLACK_S  # the backoff's wait is woken, not slept out
    time.sleep(1.5)  # past the backoff
    assert alive_servers() == [] and sup.restarts == 0
    with pytest.raises(EngineStopped, match="stopped"):
        generate(sup, "After", max_tokens=2, timeout=5)


def test_stop_while_the_new_engine_starts_stops_it_too(
    supervised: Callable[..., Supervisor], monkeypatch: pytest.MonkeyPatch
) -> None:
    starting, go = threading.Event(), threading.Event()

    class SlowStart:
        """ServerActor, whose restart blocks until the test has called stop()."""

        @staticmethod
        def start(*options: Any, **changes: Any) -> pykka.ActorRef[Any]:
            starting.set()
            go.wait(30)
            return ServerActor.start(*options, **changes)

    sup = supervised(max_restarts=3, max_seconds=60)
    first = sup.actor_ref
    monkeypatch.setattr(supervisor_module, "ServerActor", SlowStart)
    faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("tick crashed"))
    with pytest.raises(EngineStopped):
        generate(sup, "Crash it", max_tokens=2, timeout=30)
    faults.reset()
    assert starting.wait(10)  # the monitor is inside the restart's start
    threading.Timer(0.3, go.set).start()  # the start completes after stop() began
    sup.stop()  # blocks until the monitor is done: the new engine is stopped too
    assert not first.is_alive()
    assert alive_servers() == []
    assert sup.current() is None and sup.restarts == 0


# -- item 13: a late cancel hits nothing new ------------------------------------------


def test_an_abandoned_stream_collected_late_spares_a_newer_request(server: pykka.ActorRef[Any]) -> None:
    pieces = stream(server, "Once upon a time", max_tokens=4, logit_bias=NO_EOG, request_id="reused")
    assert next(pieces)
    wait_until(lambda: idle(server), 30)  # it ended; its iterator is still open
    newer = server.ask(Generate("A newer request", max_tokens=40, logit_bias=NO_EOG, request_id="reused"))
    del pieces
    gc.collect()  # the abandoned iterator's finally runs now, cancelling its own request only
    completion = newer.get(timeout=60)
    assert completion.stop_reason == "max_tokens" and completion.generated_tokens == 40
    # The window is real: a plain Cancel with the id does hit the newer request.
    newest = server.ask(Generate("The newest", max_tokens=400, logit_bias=NO_EOG, request_id="reused"))
    server.tell(Cancel("reused"))
    assert newest.get(timeout=60).stop_reason == "cancelled"


def test_an_abandoned_async_stream_spares_a_newer_request(server: pykka.ActorRef[Any]) -> None:
    async def main() -> Any:
        pieces = astream(server, "Once upon a time", max_tokens=4, logit_bias=NO_EOG, request_id="reused-a")
        assert await pieces.__anext__()
        wait_until(lambda: idle(server), 30)
        newer = server.ask(
            Generate("A newer request", max_tokens=40, logit_bias=NO_EOG, request_id="reused-a")
        )
        await pieces.aclose()  # type: ignore[attr-defined]  # what the loop does to an abandoned one
        await asyncio.sleep(0.2)  # any finalizer the loop scheduled runs now
        return await asyncio.get_running_loop().run_in_executor(None, lambda: newer.get(timeout=60))

    completion = asyncio.run(main())
    assert completion.stop_reason == "max_tokens" and completion.generated_tokens == 40


def test_a_cancel_exact_with_another_message_is_ignored(server: pykka.ActorRef[Any]) -> None:
    message = Generate("Run on", max_tokens=30, logit_bias=NO_EOG, request_id="exact")
    future = server.ask(message)
    server.tell(
        CancelExact("exact", Generate("Run on", max_tokens=30, logit_bias=NO_EOG, request_id="exact"))
    )
    assert future.get(timeout=60).stop_reason == "max_tokens"
    own = Generate("Run on", max_tokens=400, logit_bias=NO_EOG, request_id="exact")
    future = server.ask(own)
    server.tell(CancelExact("exact", own))
    assert future.get(timeout=60).stop_reason == "cancelled"


# -- the pool ----------------------------------------------------------------------------


def test_pool_admission_behind_stuck_replicas_times_out(pool: ServerPool, release: threading.Event) -> None:
    recorder = Recorder()
    blockers = [queue.Queue[Any]() for _ in pool.replicas]
    for i, q in enumerate(blockers):  # one per replica (least loaded), so every replica ticks
        pool.tell(Stream(f"Blocker {i}", reply_to=q, max_tokens=400, logit_bias=NO_EOG, request_id=f"b{i}"))
    assert set(pool.router.loads().values()) == {1}
    stuck = stick(release)
    assert stuck.wait(30)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout):
        generate(pool, "Late", max_tokens=50, logit_bias=NO_EOG, request_id="late", timeout=0.5)
    with pytest.raises(RequestTimeout):
        list(stream(pool, "Late stream", max_tokens=50, logit_bias=NO_EOG, request_id="late-s", timeout=0.5))
    elapsed = time.monotonic() - t0
    print(f"two pool calls with timeout=0.5 behind stuck replicas returned after {elapsed:.2f} s")
    assert elapsed < 2 * (0.5 + SLACK_S)
    release.set()
    faults.reset()
    wait_until(lambda: stop_reasons(recorder, "late") == ["cancelled"], 30)
    wait_until(lambda: stop_reasons(recorder, "late-s") == ["cancelled"], 30)
    for i in range(len(blockers)):
        pool.tell(Cancel(f"b{i}"))
    wait_until(lambda: idle(pool), 30)
    wait_until(lambda: set(pool.router.loads().values()) == {0}, 10)
    assert pool._sent == {}


def test_pool_an_abandoned_stream_spares_a_newer_request(pool: ServerPool) -> None:
    pieces = stream(pool, "Once upon a time", max_tokens=4, logit_bias=NO_EOG, request_id="reused-p")
    assert next(pieces)
    wait_until(lambda: idle(pool) and pool.router.replica_of("reused-p") is None, 30)
    q: queue.Queue[Any] = queue.Queue()
    pool.tell(Stream("A newer request", reply_to=q, max_tokens=40, logit_bias=NO_EOG, request_id="reused-p"))
    del pieces
    gc.collect()
    last = drain(q)[-1]
    assert isinstance(last, Done) and last.completion.stop_reason == "max_tokens"
    # The caller's own exact cancel does reach the replica through the relayed copy.
    own = Stream("Cancel me", reply_to=q, max_tokens=400, logit_bias=NO_EOG, request_id="reused-p")
    pool.tell(own)
    pool.tell(CancelExact("reused-p", own))
    assert drain(q)[-1].completion.stop_reason == "cancelled"
    wait_until(lambda: pool._sent == {}, 10)


def test_pool_drain_survives_a_replica_that_dies_while_draining(pool: ServerPool) -> None:
    queues = [queue.Queue[Any]() for _ in pool.replicas]
    for i, q in enumerate(queues):  # one per replica (least loaded)
        pool.tell(Stream(f"Long {i}", reply_to=q, max_tokens=100, logit_bias=NO_EOG, request_id=f"long{i}"))
    victim = pool.router.replica_of("long0")
    assert victim is not None and pool.router.replica_of("long1") != victim
    result: list[Any] = []
    t0 = time.monotonic()
    drainer = threading.Thread(target=lambda: result.append(pool.ask(Drain(), timeout=90)))
    drainer.start()
    time.sleep(0.5)
    actor = pool._replicas[victim].supervisor.current()  # type: ignore[attr-defined]
    assert actor is not None
    actor.stop(block=False)  # dies while draining
    drainer.join(120)
    print(f"the pool's drain returned after {time.monotonic() - t0:.1f} s")
    assert not drainer.is_alive() and isinstance(result[0], int)
    victim_end, other_end = (drain(q, timeout=30)[-1] for q in queues)
    assert isinstance(victim_end, Failed) and isinstance(victim_end.error, EngineStopped)
    assert isinstance(other_end, Done)
    assert alive_servers() == []


def test_pool_drain_outliving_its_timeout_stops_the_pool(pool: ServerPool, release: threading.Event) -> None:
    q: queue.Queue[Any] = queue.Queue()
    pool.tell(Stream("Long", reply_to=q, max_tokens=300, logit_bias=NO_EOG, request_id="long"))
    stuck = stick(release)
    assert stuck.wait(30)
    threading.Timer(2.0, release.set).start()  # the stuck replica can be stopped after that
    t0 = time.monotonic()
    unfinished = pool.ask(Drain(), timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + SLACK_S + 5  # plus the stop of a stuck replica
    assert unfinished == 1
    release.set()
    assert isinstance(drain(q, timeout=30)[-1].error, EngineStopped)
