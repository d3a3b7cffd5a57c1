"""Questions a ModelManager puts to all its models' engines at once: their stats
within one deadline, and a drain (callers' threads).

A pool answers in the asking thread, so each engine gets a plain thread (an example
script's own ``concurrent.py`` would shadow ``concurrent.futures``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from actors.contract import Drain, EngineStopped, GetStats
from actors.scale._eviction import in_flight
from actors.scale._models import model_state
from actors.scale._pool import ServerPool

__all__ = ["drain_pools", "models_stats"]


def models_stats(snapshot: dict[str, Any], wait: float) -> dict[str, Any]:
    """The manager's ``snapshot`` with each model's state and the stats of the engines
    that are ready, asked all at once within ``wait`` seconds (a busy engine answers
    after its tick; one that does not answer in time has none this time)."""
    pools = {
        name: info["pool"]
        for name, info in snapshot["models"].items()
        if info["pool"] is not None and info["pool"].gave_up() is None
    }
    deadline = time.monotonic() + wait
    answers: dict[str, Any] = {}

    def ask(name: str, pool: ServerPool) -> None:
        with contextlib.suppress(Exception):  # a busy or loading engine: no stats this time
            answers[name] = pool.ask(GetStats(), timeout=wait)

    threads = [threading.Thread(target=ask, args=item, daemon=True) for item in pools.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    got = dict(answers)  # a late answer lands in answers, not in what is read
    for name, info in snapshot["models"].items():
        pool = info.pop("pool")
        engine = got.get(name)
        info["engine"] = engine
        # An engine that answered has loaded (the manager may not know it yet).
        info["state"] = model_state(pool, info["ready"] or engine is not None)
        if info["state"] == "failed":
            info["last_error"] = pool.gave_up()
        info["in_flight"] = 0 if pool is None else in_flight(pool)
    return snapshot


def drain_pools(pools: list[ServerPool], message: Drain) -> int:
    """Drain every pool at once: the requests that did not finish, in all."""
    results = [0] * len(pools)

    def drain(index: int, pool: ServerPool) -> None:
        with contextlib.suppress(EngineStopped):
            results[index] = int(pool.ask(message))

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(pools)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(results)
