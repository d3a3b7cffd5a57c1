"""ServerPool with the local backend: same API, routing rule, telemetry, failure."""

from __future__ import annotations

import asyncio
import pickle
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, drain

from actors import (
    Cancel,
    Chat,
    ConfigError,
    Done,
    EngineStopped,
    EraseSlot,
    Failed,
    Generate,
    GenerateTokens,
    GetInfo,
    GetLora,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    Progress,
    QueueFull,
    ServerActor,
    ServerPool,
    SetLora,
    Stream,
    StreamChat,
    Token,
    agenerate,
    astream,
    chat,
    decide,
    generate,
    stream,
)
from actors.backend._faults import faults
from actors.scale._router import Router


@pytest.fixture
def pool(model_path: str) -> Iterator[ServerPool]:
    pool = ServerPool.start(replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1)
    yield pool
    pool.stop()
    faults.reset()
    pykka.ActorRegistry.stop_all()


def test_the_pool_answers_what_an_engine_answers(pool: ServerPool) -> None:
    assert pool.replicas == ("replica-0", "replica-1") and pool.up() == pool.replicas
    assert generate(pool, "Hello", max_tokens=3, logit_bias=NO_EOG).generated_tokens == 3
    assert pool.ask(Generate("Hi", max_tokens=2, logit_bias=NO_EOG)).get(timeout=60).generated_tokens == 2
    by_ids = GenerateTokens([1, 2, 3], max_tokens=2, logit_bias=NO_EOG)
    assert pool.ask(by_ids, block=False).get().get(timeout=60).generated_tokens == 2
    text = "".join(stream(pool, "Once upon a time", max_tokens=5, logit_bias=NO_EOG))
    assert text
    assert chat(pool, [{"role": "user", "content": "Hi"}], max_tokens=3).text is not None
    question = {"q": {"type": "score", "instructions": "How warm?", "criteria": ["cold", "warm", "hot"]}}
    assert decide(pool, "It is 35 degrees.", question, timeout=60).answers["q"].type == "score"
    assert pool.ask(GetLora()) == () and pool.ask(SetLora({})) == ()  # no adapters: none to set
    with pytest.raises(InvalidRequest, match="does not have"):
        pool.ask(SetLora({0: 1.0}))
    with pytest.raises(InvalidRequest, match="this pool has 2 replicas, each with slots of its own"):
        pool.ask(EraseSlot(slot=0))
    q: queue.Queue[Any] = queue.Queue()
    pool.tell(StreamChat([{"role": "user", "content": "Hi"}], reply_to=q, max_tokens=2, logit_bias=NO_EOG))
    assert isinstance(drain(q)[-1], Done)

    async def main() -> tuple[str, str]:
        pieces = [p async for p in astream(pool, "Async", max_tokens=3, logit_bias=NO_EOG)]
        completion = await agenerate(pool, "Async too", max_tokens=3, logit_bias=NO_EOG)
        return "".join(pieces), completion.text

    streamed, generated = asyncio.run(main())
    assert streamed and generated
    assert pool.ask(GetTokenizer()).tokenize("Hello")
    assert pool.ask(GetInfo())["n_parallel"] == 2
    stats = pool.ask(GetStats())
    assert set(stats["replicas"]) == set(pool.replicas) and stats["replicas_up"] == 2
    assert stats["n_parallel"] == 4 and stats["idle_slots"] == 4 and stats["active_slots"] == 0
    assert "n_ctx_per_slot" not in stats and stats["replicas"]["replica-0"]["n_ctx_per_slot"] == 512
    assert sum(stats["routing"].values()) == 9  # each request routed once (the decision too)
    assert pool.router.loads() == {"replica-0": 0, "replica-1": 0}  # every request accounted for


def test_bad_options_raise_before_anything_starts(model_path: str) -> None:
    with pytest.raises(ConfigError, match="replicas"):
        ServerPool.start(replicas=0, model_path=model_path)
    with pytest.raises(ConfigError, match="backend"):
        ServerPool.start(replicas=1, backend="mars", model_path=model_path)
    with pytest.raises(ConfigError, match="n_parallel"):
        ServerPool.start(replicas=2, model_path=model_path, n_parallel=0)
    with pytest.raises(ConfigError, match="name"):
        ServerPool.start(replicas=1, model_path=model_path, name="")
    with pytest.raises(ConfigError, match="max_restarts"):
        ServerPool.start(replicas=1, backend="ray", model_path=model_path, max_restarts=-1)


def test_every_signal_names_its_replica(pool: ServerPool) -> None:
    recorder = Recorder()
    futures = [pool.ask(Generate(f"Topic {i}", max_tokens=3, logit_bias=NO_EOG)) for i in range(4)]
    ids = {f.get(timeout=60).request_id for f in futures}
    pool.ask(GetStats())
    starts = {md["request_id"]: md["replica"] for _, md in recorder.of("start")}
    dones = {md["request_id"]: md["replica"] for _, md in recorder.of("done")}
    assert set(starts) == set(dones) == ids and starts == dones
    assert set(dones.values()) == {"replica-0", "replica-1"}  # 4 at once: 2 each
    assert {md["replica"] for _, md in recorder.of("tick")} == {"replica-0", "replica-1"}


def test_least_loaded_spreads_and_sessions_stick(pool: ServerPool) -> None:
    queues = []
    for i in range(4):
        q: queue.Queue[Any] = queue.Queue()
        pool.tell(Stream(f"Different prompt number {i}", reply_to=q, max_tokens=30, logit_bias=NO_EOG))
        queues.append(q)
    assert pool.router.loads() == {"replica-0": 2, "replica-1": 2}
    for q in queues:
        drain(q)
    assert pool.router.loads() == {"replica-0": 0, "replica-1": 0}

    recorder = Recorder()
    before = pool.router.decisions["session"]
    ids = [
        generate(pool, f"Turn {t}", max_tokens=2, session="alice", cache_scope="team-a").request_id
        for t in range(3)
    ]
    where = {md["request_id"]: md["replica"] for _, md in recorder.of("done")}
    assert len({where[i] for i in ids}) == 1  # one replica served the whole session
    assert pool.router.decisions["session"] == before + 2  # turns 2 and 3 followed it


def test_a_long_shared_prefix_goes_where_it_was_served(pool: ServerPool) -> None:
    history = "A conversation about the history of bread baking in many countries. " * 4
    first = generate(pool, history + "Q1", max_tokens=2)
    before = pool.router.decisions["prefix"]
    second = generate(pool, history + "Q1 A1 Q2", max_tokens=2)
    assert pool.router.decisions["prefix"] == before + 1
    assert second.prefix_cache_tokens > 0.5 * second.prompt_tokens
    assert first.prefix_cache_tokens == 0
    # Another scope never matches.
    other = generate(pool, history + "Q1 A1 Q2", max_tokens=2, cache_scope="other-tenant")
    assert other.prefix_cache_tokens == 0


def test_cancel_reaches_the_replica(pool: ServerPool) -> None:
    q: queue.Queue[Any] = queue.Queue()
    message = Stream("A long story:", reply_to=q, max_tokens=400, logit_bias=NO_EOG)
    pool.tell(message)
    assert isinstance(q.get(timeout=30), Token)
    pool.tell(Cancel(message.request_id))
    assert drain(q)[-1].completion.stop_reason == "cancelled"
    # A Progress event is not the end: the request is still the pool's to cancel.
    message = Stream("A long story:", reply_to=q, max_tokens=400, logit_bias=NO_EOG, progress=True)
    pool.tell(message)
    assert isinstance(q.get(timeout=30), Progress)
    while not isinstance(q.get(timeout=30), Token):
        pass
    pool.tell(Cancel(message.request_id))
    assert drain(q)[-1].completion.stop_reason == "cancelled"
    pieces = stream(pool, "Another long story:", max_tokens=400, logit_bias=NO_EOG)
    next(pieces)
    pieces.close()  # cancels through the pool
    deadline = time.monotonic() + 10
    while pool.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.ask(GetStats())["active_slots"] == 0


def test_a_crashed_replica_fails_its_requests_and_the_other_serves(pool: ServerPool) -> None:
    q: queue.Queue[Any] = queue.Queue()
    message = Stream("A long story:", reply_to=q, max_tokens=400, logit_bias=NO_EOG)
    pool.tell(message)
    assert isinstance(q.get(timeout=30), Token)
    victim = pool.router.replica_of(message.request_id)
    assert victim is not None
    # Only the victim has work, so only its tick runs the hook.
    faults.tick = lambda n: (_ for _ in ()).throw(RuntimeError("tick crashed"))
    failed = drain(q)[-1]
    faults.reset()
    assert isinstance(failed, Failed) and isinstance(failed.error, EngineStopped)
    assert victim in str(failed.error)
    # Meanwhile (restart under way or done) requests are served.
    served = [generate(pool, f"Meanwhile {i}", max_tokens=2, logit_bias=NO_EOG, timeout=30) for i in range(3)]
    assert all(c.generated_tokens == 2 for c in served)
    deadline = time.monotonic() + 10
    while len(pool.up()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.up() == pool.replicas  # restarted by its supervisor
    assert pool.router.loads() == {"replica-0": 0, "replica-1": 0}


def test_a_stopped_pool_refuses(model_path: str) -> None:
    pool = ServerPool.start(replicas=1, model_path=model_path, n_parallel=1, n_ctx=512)
    futures = [pool.ask(Generate("Long", max_tokens=300, logit_bias=NO_EOG)) for _ in range(3)]
    pool.stop()
    for future in futures:
        with pytest.raises(EngineStopped):
            future.get(timeout=10)
    with pytest.raises(EngineStopped):
        generate(pool, "after", max_tokens=2)


def test_request_messages_pickle() -> None:
    chat_message = Chat(
        [{"role": "user", "content": "x"}], logit_bias={1: 1.0}, json_schema={"type": "object"}
    )
    for message in (Generate("x", stop=["a"], session="s"), GenerateTokens([1, 2]), chat_message):
        assert pickle.loads(pickle.dumps(message)) == message


def test_the_router_rule() -> None:
    router = Router(["a", "b"], capacity=4, min_blocks=8, slack=1)
    long = "x" * 16 * 12
    m1 = Generate(long + "one")
    assert router.choose(m1, ["a", "b"]) == "a"  # least loaded, then fewest sent
    assert router.choose(Generate("short"), ["a", "b"]) == "b"
    assert router.choose(Generate(long + "two"), ["a", "b"]) == "a"  # affinity (load 1 <= 1 + slack)
    assert router.choose(Generate(long + "three"), ["a", "b"]) == "a"  # load 2 <= 1 + slack
    assert router.choose(Generate(long + "four"), ["a", "b"]) == "b"  # a is over the slack
    assert router.choose(Generate(long), ["b"]) == "b"  # only b is up
    with pytest.raises(EngineStopped):
        router.choose(Generate("x"), [])
    router.finished(m1.request_id)
    router.finished(m1.request_id)  # idempotent
    assert router.loads() == {"a": 2, "b": 3}
    assert router.decisions == {"session": 0, "prefix": 3, "least_loaded": 3}
    assert router.choose(Generate("x" * 100), ["a", "b"]) == "a"  # 6 blocks: too short for affinity
    again = Generate("in flight", request_id="twice")
    router.choose(again, ["a", "b"])
    with pytest.raises(InvalidRequest, match="already in use"):
        router.choose(again, ["a", "b"])  # a reused id would corrupt the loads


def test_a_full_replica_loses_affinity_to_one_with_a_free_slot() -> None:
    router = Router(["a", "b"], capacity=2, slack=5)
    history = "a conversation that has gone on for a while " * 4
    assert router.choose(Generate(history + "1"), ["a", "b"]) == "a"
    assert router.choose(Generate(history + "2"), ["a", "b"]) == "a"  # a free slot there
    assert router.choose(Generate(history + "3"), ["a", "b"]) == "b"  # a is full, b is not
    assert router.choose(Generate(history + "4"), ["a", "b"]) == "b"  # both remember it: the less loaded


def _multiturn_hit_ratio(ref: Any, conversations: int = 4, turns: int = 3) -> float:
    """Conversations sharing a system prompt, every turn sent at once: cached / prompt tokens."""
    system = "You are the help desk of a large library. Answer briefly and never invent facts. " * 3
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    prompt = cached = 0
    for turn in range(turns):
        futures = []
        for i, history in enumerate(histories):
            history.append(
                {"role": "user", "content": f"Reader {i}, question {turn}: where is book {i + turn}?"}
            )
            futures.append(ref.ask(Chat(history, max_tokens=8, temp=0)))
        for history, future in zip(histories, futures, strict=True):
            completion = future.get(timeout=120)
            prompt += completion.prompt_tokens
            cached += completion.prefix_cache_tokens
            history.append({"role": "assistant", "content": completion.text})
    return cached / prompt


@pytest.mark.timeout(300)
def test_prefix_affinity_keeps_the_hit_ratio_of_one_engine(model_path: str) -> None:
    engine = ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=2048, n_threads=1)
    try:
        single = _multiturn_hit_ratio(engine)
    finally:
        engine.stop()
    pool = ServerPool.start(replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1)
    try:
        pooled = _multiturn_hit_ratio(pool)
        decisions = pool.router.decisions
    finally:
        pool.stop()
    print(f"prefix-cache hit ratio: one engine {single:.3f}, pool of 2 {pooled:.3f} ({decisions})")
    assert single > 0.3  # the workload does reuse
    assert pooled >= 0.9 * single


def test_a_full_replica_passes_the_request_on(model_path: str) -> None:
    """A session pins requests to one replica; when it is full they go to the other."""
    pool = ServerPool.start(replicas=2, model_path=model_path, n_parallel=1, n_ctx=512, max_queue=0)
    try:
        first: queue.Queue[Any] = queue.Queue()
        long = Stream("A long story:", reply_to=first, max_tokens=300, session="s", logit_bias=NO_EOG)
        pool.tell(long)
        assert isinstance(first.get(timeout=30), Token)
        home = pool.router.replica_of(long.request_id)
        sessions = pool.router.decisions["session"]
        # The session's replica has no slot and no queue: the stream and the ask go elsewhere.
        second: queue.Queue[Any] = queue.Queue()
        pool.tell(Stream("Another:", reply_to=second, max_tokens=3, session="s", logit_bias=NO_EOG))
        assert isinstance(drain(second)[-1], Done)
        completion = generate(pool, "And a third:", max_tokens=3, session="s", logit_bias=NO_EOG)
        assert completion.generated_tokens == 3
        assert pool.router.decisions["session"] >= sessions + 1  # sent home first, then passed on
        assert pool.router.replica_of(long.request_id) == home
        # With both full, the refusal reaches the caller.
        blocker: queue.Queue[Any] = queue.Queue()
        pool.tell(Stream("Block:", reply_to=blocker, max_tokens=300, logit_bias=NO_EOG))
        assert isinstance(blocker.get(timeout=30), Token)
        refused: queue.Queue[Any] = queue.Queue()
        pool.tell(Stream("Refused:", reply_to=refused, max_tokens=3, logit_bias=NO_EOG))
        last = drain(refused)[-1]
        assert isinstance(last, Failed) and isinstance(last.error, QueueFull)
        with pytest.raises(QueueFull):
            pool.ask(Generate("Refused too", max_tokens=3))
        assert sum(pool.router.loads().values()) == 2
    finally:
        pool.stop()


@pytest.mark.timeout(300)
def test_a_loaded_pool_gives_every_request_one_outcome(model_path: str) -> None:
    """12 threads x 6 requests (generate, streams closed early, sessions) on 2 x 2 slots
    with short queues: each ends once (a result, a cancel or QueueFull), nothing is left."""
    pool = ServerPool.start(
        replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1, max_queue=2
    )
    outcomes: dict[str, list[str]] = {}
    lock = threading.Lock()

    def record(key: str, outcome: str) -> None:
        with lock:
            outcomes.setdefault(key, []).append(outcome)

    def caller(t: int) -> None:
        for i in range(6):
            key = f"{t}.{i}"
            try:
                if i % 3 == 0:
                    generate(pool, f"Caller {t} asks {i}", max_tokens=6, logit_bias=NO_EOG, timeout=120)
                elif i % 3 == 1:
                    pieces = stream(
                        pool, f"Caller {t} streams {i}", max_tokens=40, logit_bias=NO_EOG, timeout=120
                    )
                    next(pieces)
                    pieces.close()  # cancels
                else:
                    chat(
                        pool,
                        [{"role": "user", "content": f"Hi {i}"}],
                        max_tokens=4,
                        session=f"s{t}",
                        timeout=120,
                    )
                record(key, "ok")
            except QueueFull:
                record(key, "full")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(12)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(thread.is_alive() for thread in threads)
        assert len(outcomes) == 72 and all(len(v) == 1 for v in outcomes.values())
        print({o: sum(v == [o] for v in outcomes.values()) for o in ("ok", "full")})
        assert sum(v == ["ok"] for v in outcomes.values()) >= 24
        deadline = time.monotonic() + 10
        while pool.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = pool.ask(GetStats())
        assert stats["active_slots"] == 0 and stats["queue_depth"] == 0
        assert pool.router.loads() == {"replica-0": 0, "replica-1": 0}
    finally:
        pool.stop()
