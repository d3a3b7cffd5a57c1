"""A live one-line status of the engine, built from its telemetry signals alone.

Starts a load of concurrent streams and prints, on one line that rewrites itself,
the latest tick (batch composition, eval time), active slots, queue depth, requests
done and aggregate tokens/s. Receivers run in the engine thread, so they only store
numbers; the printing happens in the main thread.

Run: ``python examples/telemetry_status.py`` (``--requests``, ``--max-tokens``).
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from typing import Any

import telemetry
from actors import ServerActor, stream


class Status:
    """Latest numbers from the signals; receivers are cheap (they run in the engine)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ticks = 0
        self.last_tick: dict[str, Any] = {}
        self.started = 0
        self.done = 0
        self.failed = 0
        self.generated = 0
        self.t0 = time.monotonic()
        # blinker holds receivers weakly; a Subscription holds them until close().
        self.subscription = telemetry.Subscription(
            {
                telemetry.tick: self.on_tick,
                telemetry.request_start: self.on_start,
                telemetry.request_done: self.on_done,
                telemetry.request_exception: self.on_exception,
            }
        )

    def close(self) -> None:
        self.subscription.close()

    def on_tick(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.ticks += 1
            self.last_tick = measurements
            self.generated += measurements["decode_tokens"]

    def on_start(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.started += 1

    def on_done(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.done += 1

    def on_exception(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.failed += 1

    def line(self) -> str:
        with self.lock:
            t = self.last_tick
            rate = self.generated / max(time.monotonic() - self.t0, 1e-9)
            if not t:
                return "waiting for the first tick..."
            return (
                f"tick {self.ticks:5d} | batch {t['batch_size']:4d} "
                f"({t['decode_tokens']} decode + {t['prefill_tokens']} prefill) | "
                f"slots {t['active_slots']} | queue {t['queue_depth']:2d} | "
                f"eval {t['eval_ms']:5.1f} ms | done {self.done}/{self.started} | "
                f"failed {self.failed} | {rate:5.1f} decoded tok/s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    status = Status()
    ref = ServerActor.start(n_parallel=4, n_ctx=4096)
    errors: queue.Queue[BaseException] = queue.Queue()

    def consume(i: int) -> None:
        try:
            for _piece in stream(ref, f"Fact number {i} about the ocean:", max_tokens=args.max_tokens):
                pass
        except BaseException as e:  # reported below, in the main thread
            errors.put(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(args.requests)]
    try:
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            sys.stdout.write("\r" + status.line())
            sys.stdout.flush()
            time.sleep(0.1)
        print("\r" + status.line())
    finally:
        ref.stop()
        status.close()
    if not errors.empty():
        raise SystemExit(f"a request failed: {errors.get()!r}")


if __name__ == "__main__":
    main()
