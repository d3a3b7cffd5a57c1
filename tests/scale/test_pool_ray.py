"""ServerPool on Ray: a local cluster of two simulated nodes, one small replica on each."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import NO_EOG, Recorder, drain, same_greedy, wait_until

from actors import (
    Done,
    EngineStopped,
    Failed,
    Generate,
    GetStats,
    InvalidRequest,
    ServerActor,
    ServerPool,
    Stream,
    Token,
    agenerate,
    astream,
    chat,
    generate,
    stream,
)

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.ray, pytest.mark.model, pytest.mark.subprocess]

OPTIONS: dict[str, Any] = {"n_parallel": 2, "n_ctx": 1024, "n_threads": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes on this machine (one CPU each), and this process connected to them."""
    store = 80 * 1024 * 1024
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store})
    cluster.add_node(num_cpus=1, object_store_memory=store)
    ray.init(address=cluster.address, logging_level=logging.WARNING, include_dashboard=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def pool(cluster: Cluster, model_path: str) -> Iterator[ServerPool]:
    pool = ServerPool.start(replicas=2, backend="ray", model_path=model_path, max_restarts=1, **OPTIONS)
    yield pool
    pool.stop()


def test_replicas_land_on_both_nodes(pool: ServerPool) -> None:
    nodes = {replica.node_id for replica in pool._replicas.values()}  # type: ignore[attr-defined]
    assert len(nodes) == 2
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == nodes


def test_same_answers_as_a_local_engine(pool: ServerPool, model_path: str) -> None:
    # The replicas' KV cells and batches are not the local engine's, and the greedy
    # tokens are the same all the same (up to a near-tie where a CPU's floor is not zero).
    greedy: dict[str, Any] = {"max_tokens": 12, "temp": 0, "logit_bias": NO_EOG}
    local = ServerActor.start(model_path=model_path, **OPTIONS)
    try:
        expected = {}
        for prompt in ("The capital of France is", "def fibonacci(n):"):
            expected[prompt] = generate(local, prompt, **greedy, logprobs=2)
            got = generate(pool, prompt, **greedy)
            assert got.prompt_tokens == expected[prompt].prompt_tokens
            if same_greedy(expected[prompt], got.token_ids) == got.generated_tokens:
                assert got.text == expected[prompt].text  # the same tokens: the same text
    finally:
        local.stop()
    q: queue.Queue[Any] = queue.Queue()
    pool.tell(Stream("The capital of France is", reply_to=q, **greedy))
    events = drain(q)
    streamed = events[-1].completion
    assert "".join(e.text for e in events if isinstance(e, Token)) == streamed.text
    same_greedy(expected["The capital of France is"], streamed.token_ids)
    messages = [{"role": "user", "content": "Say hi."}]
    assert chat(pool, messages, max_tokens=4, logit_bias=NO_EOG).generated_tokens == 4
    assert pool.ask(Generate("Hi", max_tokens=2, logit_bias=NO_EOG)).get(timeout=60).generated_tokens == 2

    async def main() -> tuple[str, int]:
        text = "".join([p async for p in astream(pool, "Async", max_tokens=3, logit_bias=NO_EOG)])
        return text, (await agenerate(pool, "Async too", max_tokens=3, logit_bias=NO_EOG)).generated_tokens

    text, n = asyncio.run(main())
    assert text and n == 3
    with pytest.raises(InvalidRequest):  # the replica's own error type crosses the process boundary
        generate(pool, "x", max_tokens=2, logit_bias={10**9: 1.0})
    assert pool.ask(GetStats())["active_slots"] == 0


def test_telemetry_reaches_the_driver_with_the_replica(pool: ServerPool) -> None:
    recorder = Recorder()
    queues = []
    for i in range(4):
        q: queue.Queue[Any] = queue.Queue()
        pool.tell(Stream(f"Prompt number {i}", reply_to=q, max_tokens=6, logit_bias=NO_EOG))
        queues.append(q)
    ids = {drain(q)[-1].request_id for q in queues}
    wait_until(lambda: {md["request_id"] for _, md in recorder.of("done")} >= ids, 30)
    done = {md["request_id"]: md["replica"] for _, md in recorder.of("done") if md["request_id"] in ids}
    starts = {md["request_id"]: md["replica"] for _, md in recorder.of("start") if md["request_id"] in ids}
    assert done == starts and set(done.values()) == {"replica-0", "replica-1"}
    assert {md["replica"] for _, md in recorder.of("tick")} == {"replica-0", "replica-1"}
    assert all(len(md["slots"]) == 2 for _, md in recorder.of("tick"))


def test_stats_per_replica_and_summed(pool: ServerPool) -> None:
    stats = pool.ask(GetStats())
    assert stats["replicas_up"] == 2 and set(stats["replicas"]) == {"replica-0", "replica-1"}
    assert stats["n_parallel"] == 4 == sum(s["n_parallel"] for s in stats["replicas"].values())


def test_closing_a_stream_early_frees_the_slot(pool: ServerPool) -> None:
    pieces = stream(pool, "A long story:", max_tokens=400, logit_bias=NO_EOG)
    next(pieces)
    pieces.close()
    wait_until(lambda: pool.ask(GetStats())["active_slots"] == 0, 10)


def test_a_killed_replica_fails_its_requests_and_comes_back(pool: ServerPool) -> None:
    """Last in this file: it spends the replicas' one restart (max_restarts=1)."""
    q: queue.Queue[Any] = queue.Queue()
    message = Stream("A long story:", reply_to=q, max_tokens=1000, logit_bias=NO_EOG)
    pool.tell(message)
    assert isinstance(q.get(timeout=30), Token)
    victim = pool.router.replica_of(message.request_id)
    other = next(name for name in pool.replicas if name != victim)
    t0 = time.monotonic()
    ray.kill(pool._replicas[victim].actor, no_restart=False)  # type: ignore[attr-defined]
    failed = drain(q)[-1]
    took = time.monotonic() - t0
    assert isinstance(failed, Failed) and isinstance(failed.error, EngineStopped)
    assert victim in str(failed.error)
    print(f"in-flight stream failed {took:.2f} s after ray.kill")
    # Marked down before its streams fail; back only once Ray restarted it and the model loaded.
    assert victim not in pool.up()
    recorder = Recorder()
    c = generate(pool, "Meanwhile", max_tokens=2, logit_bias=NO_EOG, timeout=30)
    wait_until(lambda: any(md["request_id"] == c.request_id for _, md in recorder.of("done")), 10)
    assert next(md["replica"] for _, md in recorder.of("done") if md["request_id"] == c.request_id) == other
    # Ray restarts it; routing resumes.
    wait_until(lambda: pool.up() == pool.replicas, 60)
    queues = []
    for i in range(4):
        q = queue.Queue()
        pool.tell(Stream(f"After {i}", reply_to=q, max_tokens=4, logit_bias=NO_EOG))
        queues.append(q)
    assert all(isinstance(drain(q)[-1], Done) for q in queues)
    wait_until(lambda: len({md["replica"] for _, md in recorder.of("done")}) == 2, 10)
    # Restarts are bounded: the second death is final, and the other replica serves on.
    ray.kill(pool._replicas[victim].actor, no_restart=False)  # type: ignore[attr-defined]
    wait_until(lambda: victim not in pool.up() or _dead(pool, victim), 30)
    time.sleep(2)
    assert pool.up() == (other,)
    assert generate(pool, "Still here", max_tokens=2, logit_bias=NO_EOG, timeout=30).generated_tokens == 2
    assert pool.ask(GetStats())["replicas"][victim] is None


def _dead(pool: ServerPool, name: str) -> bool:
    """Has the pool noticed? A request it routes there would; GetStats does."""
    pool.ask(GetStats())
    return name not in pool.up()
