"""Soak: many callers, mixed requests, random cancels; outcomes, telemetry balance and RSS.

``--threads`` caller threads send generate and stream requests of random lengths (some
cancelled early, some refused by a full queue) to one engine (``n_parallel=8``,
``max_queue=32``) until ``--requests`` were sent or ``--minutes`` passed. It checks that
every request had exactly one outcome, that telemetry starts and ends balance, that no
slot stays busy, and reports RSS after warm-up and at the end. Exits 1 on a violation or
on RSS growth of ``--max-rss-growth`` (5%) or more.

    python bench/soak.py --requests 1000          # the issue's load test at full size
    python bench/soak.py --minutes 30             # a long soak
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import telemetry
from actors import EngineError, GetStats, ServerActor, generate, stream
from bench._common import machine


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Balance:
    """Counts request starts and ends from the signals (engine thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.starts: set[str] = set()
        self.ends: collections.Counter[str] = collections.Counter()
        telemetry.request_start.connect(self.on_start, weak=False)
        telemetry.request_done.connect(self.on_end, weak=False)
        telemetry.request_exception.connect(self.on_end, weak=False)

    def on_start(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.starts.add(metadata["request_id"])

    def on_end(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.ends[metadata["request_id"]] += 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=None, help="run this long instead of --requests")
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24, help="the longest request")
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument(
        "--max-rss-growth", type=float, default=0.05, help="fail at this RSS growth after warm-up"
    )
    args = parser.parse_args()

    balance = Balance()
    ref = ServerActor.start(n_parallel=8, max_queue=32, n_ctx=4096, n_threads=args.n_threads)
    outcomes: dict[str, str] = {}
    lock = threading.Lock()
    sent = 0
    deadline = None if args.minutes is None else time.monotonic() + args.minutes * 60
    rss: dict[str, float] = {}

    def next_id() -> str | None:
        nonlocal sent
        with lock:
            if (deadline is None and sent >= args.requests) or (
                deadline is not None and time.monotonic() > deadline
            ):
                return None
            sent += 1
            if sent == min(200, args.requests // 5 or 1):
                rss["warm"] = rss_mb()
            return f"soak-{sent}"

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        while (request_id := next_id()) is not None:
            n = rng.randint(1, args.max_tokens)
            try:
                if rng.random() < 0.5:
                    result = generate(
                        ref, f"Note {request_id}:", max_tokens=n, request_id=request_id
                    ).stop_reason
                else:
                    pieces = stream(ref, f"Note {request_id}:", max_tokens=n, request_id=request_id)
                    result = "streamed"
                    for i, _ in enumerate(pieces):
                        if i > 0 and rng.random() < 0.1:
                            pieces.close()  # type: ignore[attr-defined]
                            result = "closed early"
                            break
            except EngineError as e:
                result = type(e).__name__
            with lock:
                if request_id in outcomes:
                    raise AssertionError(f"{request_id} ended twice")
                outcomes[request_id] = result

    print(machine())
    t0 = time.monotonic()
    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    stats = ref.ask(GetStats())
    rss["end"] = rss_mb()  # with the engine still loaded, as after warm-up
    ref.stop()

    problems = []
    if len(outcomes) != sent:
        problems.append(f"{sent} sent but {len(outcomes)} outcomes")
    doubled = [r for r, n in balance.ends.items() if n != 1]
    if doubled or set(balance.ends) != balance.starts:
        problems.append(
            f"telemetry unbalanced: {len(balance.starts)} starts, {sum(balance.ends.values())} ends"
        )
    if stats["active_slots"] or stats["queue_depth"]:
        problems.append(f"engine not idle afterwards: {stats}")
    growth = rss["end"] / rss.get("warm", rss["end"]) - 1
    if growth >= args.max_rss_growth:
        problems.append(f"RSS grew {growth:.1%}")
    print(f"{sent} requests in {elapsed:.0f} s from {args.threads} threads ({sent / elapsed:.1f}/s)")
    for name, count in collections.Counter(outcomes.values()).most_common():
        print(f"  {name:14s} {count}")
    warm = rss.get("warm", float("nan"))
    print(f"RSS after warm-up {warm:.0f} MB, at the end {rss['end']:.0f} MB ({growth:+.1%})")
    print("telemetry: starts", len(balance.starts), "ends", sum(balance.ends.values()))
    if problems:
        print("FAILED:", "; ".join(problems))
        raise SystemExit(1)
    print("OK: every request had exactly one outcome")


if __name__ == "__main__":
    main()
