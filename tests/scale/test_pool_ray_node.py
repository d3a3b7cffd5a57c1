"""A Ray pool loses a node: the requests there fail at once, the rest go on, and the
replica comes back on a node that joins. Its own cluster: nodes come and go here."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import NO_EOG, Recorder, drain, wait_until

from actors import Done, EngineStopped, Failed, ServerPool, Stream, Token, generate

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.ray, pytest.mark.model, pytest.mark.subprocess]

STORE = 80 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE})
    ray.init(address=cluster.address, logging_level=logging.WARNING, include_dashboard=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_lost_node_fails_its_requests_and_its_replica_returns_elsewhere(
    cluster: Cluster, model_path: str
) -> None:
    worker = cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()
    options: dict[str, Any] = {"n_parallel": 2, "n_ctx": 1024, "n_threads": 1}
    pool = ServerPool.start(replicas=2, backend="ray", model_path=model_path, max_restarts=2, **options)
    try:
        replicas = pool._replicas  # type: ignore[attr-defined]
        lost = next(name for name, r in replicas.items() if r.node_id == worker.node_id)
        kept = next(name for name in replicas if name != lost)
        queues: list[queue.Queue[Any]] = []
        messages = []
        for i in range(2):  # least loaded: one on each replica
            q: queue.Queue[Any] = queue.Queue()
            message = Stream(f"A long story {i}:", reply_to=q, max_tokens=120, logit_bias=NO_EOG)
            pool.tell(message)
            queues.append(q)
            messages.append(message)
        for q in queues:
            assert isinstance(q.get(timeout=30), Token)
        on_lost = next(i for i, m in enumerate(messages) if pool.router.replica_of(m.request_id) == lost)

        t0 = time.monotonic()
        cluster.remove_node(worker)  # the node and every process on it are gone
        failed = drain(queues[on_lost])[-1]
        print(f"stream on the lost node failed {time.monotonic() - t0:.2f} s after the node went")
        assert isinstance(failed, Failed) and isinstance(failed.error, EngineStopped)
        assert lost in str(failed.error)
        assert isinstance(drain(queues[1 - on_lost])[-1], Done)  # the other replica's stream finished
        assert pool.up() == (kept,)  # no CPU for it anywhere: it waits for a node

        recorder = Recorder()
        completion = generate(pool, "Meanwhile", max_tokens=3, logit_bias=NO_EOG, timeout=60)
        assert completion.generated_tokens == 3
        done = lambda: {md["request_id"]: md["replica"] for _, md in recorder.of("done")}  # noqa: E731
        wait_until(lambda: completion.request_id in done(), 10)
        assert set(done().values()) == {kept}

        fresh = cluster.add_node(num_cpus=1, object_store_memory=STORE)  # Ray restarts it there
        wait_until(lambda: pool.up() == pool.replicas, 120)
        assert replicas[lost].node_id == fresh.node_id
        for i in range(4):
            after = generate(pool, f"After {i}", max_tokens=2, logit_bias=NO_EOG, timeout=60)
            assert after.generated_tokens == 2
        wait_until(lambda: set(done().values()) == set(pool.replicas), 10)
    finally:
        pool.stop()


def test_stopping_a_ray_pool_fails_its_streams(cluster: Cluster, model_path: str) -> None:
    pool = ServerPool.start(replicas=1, backend="ray", model_path=model_path, n_parallel=1, n_ctx=512)
    q: queue.Queue[Any] = queue.Queue()
    pool.tell(Stream("A long story:", reply_to=q, max_tokens=400, logit_bias=NO_EOG))
    assert isinstance(q.get(timeout=30), Token)
    pool.stop()
    failed = drain(q)[-1]
    assert isinstance(failed, Failed) and isinstance(failed.error, EngineStopped)
    assert "stopped" in str(failed.error)
