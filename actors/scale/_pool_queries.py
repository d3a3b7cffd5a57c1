"""Questions a ServerPool puts to all its replicas at once: their stats, summed, and a
drain (callers' threads)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from actors.contract import Drain, EngineStopped, GetStats, RequestTimeout
from actors.scale._replica import Replica, ReplicaDown

__all__ = ["drain_replicas", "pool_stats"]

_log = logging.getLogger("llama_cpp_actors.pool")

# GetStats keys that are one replica's settings, not loads: never summed.
_PER_REPLICA = frozenset({"n_batch", "n_ctx_per_slot"})
# GetStats keys holding one entry per slot: every replica's, one after the other.
_CONCATENATED = frozenset({"slots", "kv_positions"})


def pool_stats(replicas: Iterable[Replica], timeout: float | None) -> dict[str, Any]:
    """Each replica's GetStats (None when down, in ``"replicas"``) and their sums: a
    replica's settings are not summed, per-slot tuples are concatenated in replica
    order, and the acceptance rate is that of the sums."""
    per: dict[str, dict[str, Any] | None] = {}
    for replica in replicas:
        try:
            per[replica.name] = replica.call(GetStats(), timeout) if replica.up() else None
        except ReplicaDown:
            per[replica.name] = None
    totals: dict[str, Any] = {}
    for stats in per.values():
        for key, value in (stats or {}).items():
            if key in _CONCATENATED:  # every replica's, in replica order
                totals[key] = totals.get(key, ()) + value
            elif key not in _PER_REPLICA:
                totals[key] = totals.get(key, 0) + value
    drafted = totals.get("draft_tokens", 0)
    if "draft_acceptance_rate" in totals:  # a ratio: of the sums, not a sum
        totals["draft_acceptance_rate"] = totals.get("draft_accepted", 0) / drafted if drafted else 0.0
    totals["replicas"] = per
    totals["replicas_up"] = sum(1 for s in per.values() if s is not None)
    return totals


def drain_replicas(
    replicas: Iterable[Replica], message: Drain, timeout: float | None
) -> tuple[dict[str, int], list[str]]:
    """Drain every replica at once: each one's unfinished count, and the replicas whose
    drain outlived ``timeout`` (their requests in flight count as unfinished).

    A replica that is down, or dies while draining, has nothing left to count (its
    requests got ``EngineStopped`` when it died).

    Raises:
        Exception: the first unexpected error of a replica's drain.
    """
    results: dict[str, int] = {}
    late: list[str] = []
    errors: list[BaseException] = []

    def drain(replica: Replica) -> None:
        try:
            results[replica.name] = int(replica.call(message, timeout))
        except (ReplicaDown, EngineStopped) as e:
            if not isinstance(e, ReplicaDown):
                _log.warning("%s stopped while draining: %s", replica.name, e)
        except RequestTimeout:
            late.append(replica.name)
        except Exception as e:
            errors.append(e)

    threads = [
        threading.Thread(target=drain, args=(r,), name=f"{r.name}-drain", daemon=True) for r in replicas
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, late
