"""A live dashboard of the engine, built from its telemetry signals alone.

Runs a load generator (caller threads streaming chats of varied length) against a
ServerActor and shows, with ``rich``, what the engine does: every slot (state, request,
prompt and generated tokens, tokens/s, KV cells), the queue, KV usage, aggregate
tokens/s over time and TTFT percentiles. ``--png FILE`` runs the same load without the
live view and saves a matplotlib figure of the run instead.

The receivers run in the engine thread, so they only append numbers under a lock; all
drawing happens in the main thread. Slots are keyed by ``metadata.get("replica")`` too,
so the same board shows every engine of a ``ServerPool``.

Run: ``python examples/dashboard.py`` (needs the ``dashboard`` extra: rich, matplotlib);
``--requests``, ``--concurrency``, ``--max-tokens``, ``--n-parallel``, ``--png FILE``;
``--replicas 2`` (``--backend ray``) watches a ServerPool instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder comes first on sys.path, and its concurrent.py would
# shadow the standard library's concurrent.futures, which Ray imports (and Ray hands the
# driver's sys.path to its workers).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import bisect
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import telemetry
from actors import EngineHandle, ServerActor, ServerPool, stream_chat

TOPICS = ["the ocean", "volcanoes", "bread", "the moon", "bees", "rivers", "chess", "glass"]
WINDOW_S = 1.0  # tok/s is counted per window of this many seconds


@dataclass
class SlotRow:
    """What the board knows of one slot, from the latest tick."""

    sample: telemetry.SlotSample
    rate: float = 0.0  # generated tokens/s of its current request
    t_first: float = 0.0  # when the board first saw the request generating
    first_count: int = 0


@dataclass
class Board:
    """Numbers from the signals. Receivers (engine thread) append; readers copy."""

    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: dict[tuple[str, int], SlotRow] = field(default_factory=dict)
    last_tick: dict[str, Any] = field(default_factory=dict)  # the latest tick of any engine
    latest: dict[str, dict[str, Any]] = field(default_factory=dict)  # each engine's latest tick
    ticks: int = 0
    started: int = 0
    done: int = 0
    failed: int = 0
    generated_by_window: list[int] = field(default_factory=list)  # tokens sampled per window
    queue_by_window: list[int] = field(default_factory=list)  # max queue depth per window
    active_by_window: list[int] = field(default_factory=list)  # max active slots per window
    ttfts_ms: list[float] = field(default_factory=list)  # sorted

    def __post_init__(self) -> None:
        self._subscription = telemetry.Subscription(
            {
                telemetry.tick: self.on_tick,
                telemetry.request_start: self.on_start,
                telemetry.request_done: self.on_done,
                telemetry.request_exception: self.on_exception,
            }
        )

    def close(self) -> None:
        self._subscription.close()

    def _window(self, now: float) -> int:
        index = int((now - self.t0) / WINDOW_S)
        for series in (self.generated_by_window, self.queue_by_window, self.active_by_window):
            series.extend([0] * (index + 1 - len(series)))
        return index

    # -- receivers: engine thread ------------------------------------------------

    def on_tick(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        now = time.monotonic()
        replica = str(metadata.get("replica") or "")
        with self.lock:
            self.ticks += 1
            self.last_tick = measurements
            self.latest[replica] = measurements
            w = self._window(now)
            self.queue_by_window[w] = max(self.queue_by_window[w], measurements["queue_depth"])
            self.active_by_window[w] = max(self.active_by_window[w], measurements["active_slots"])
            for sample in metadata["slots"]:
                key = (replica, sample.seq_id)
                row = self.slots.get(key)
                if row is None or row.sample.request_id != sample.request_id:
                    row = self.slots[key] = SlotRow(sample, t_first=now, first_count=sample.generated_tokens)
                    new = sample.generated_tokens
                else:
                    new = sample.generated_tokens - row.sample.generated_tokens
                    row.sample = sample
                self.generated_by_window[w] += max(new, 0)
                elapsed = now - row.t_first
                row.rate = (sample.generated_tokens - row.first_count) / elapsed if elapsed > 0 else 0.0

    def on_start(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.started += 1

    def on_done(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        now = time.monotonic()
        with self.lock:
            self.done += 1
            # The tick that sampled a request's last token shows its slot idle already.
            row = self.slots.get((str(metadata.get("replica") or ""), metadata["seq_id"]))
            seen = (
                row.sample.generated_tokens if row and row.sample.request_id == metadata["request_id"] else 0
            )
            self.generated_by_window[self._window(now)] += measurements["generated_tokens"] - seen
            if measurements["generated_tokens"]:
                bisect.insort(self.ttfts_ms, measurements["ttft_ms"])

    def on_exception(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.failed += 1

    # -- readers: main thread ------------------------------------------------------

    def percentile(self, q: float) -> float | None:
        with self.lock:
            values = list(self.ttfts_ms)
        if not values:
            return None
        return values[min(len(values) - 1, int(q / 100.0 * len(values)))]


def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as block characters, scaled to their maximum."""
    blocks = " ▁▂▃▄▅▆▇█"
    tail = list(values)[-width:]
    top = max(tail, default=0) or 1
    return "".join(blocks[round(v / top * (len(blocks) - 1))] for v in tail)


def render(board: Board, title: str) -> Any:
    """One frame: a header, the slots table, throughput over time, TTFT percentiles."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    with board.lock:
        rows = sorted(board.slots.items())
        tick = dict(board.last_tick)
        engines = list(board.latest.values())  # one per replica of a pool
        rates = list(board.generated_by_window[:-1])  # the current window is still filling
        queue_now = sum(t["queue_depth"] for t in engines)
        header = (
            f"[b]{title}[/b]   {time.monotonic() - board.t0:6.1f} s   ticks {board.ticks}   "
            f"started {board.started}   done {board.done}   failed {board.failed}   "
            f"queue {queue_now}"
        )
    kv = ""
    if tick:
        used = sum(t["kv_cells_used"] for t in engines)
        total = sum(t["kv_cells_total"] for t in engines)
        kv = (
            f"\nlast tick: {tick['batch_size']} tokens ({tick['decode_tokens']} decode + "
            f"{tick['prefill_tokens']} prefill), eval {tick['eval_ms']:.1f} ms   "
            f"KV {used}/{total} cells ({used / total:.0%})"
        )

    slots = Table(title="slots", expand=True)
    for name in ("replica", "slot", "state", "request", "prompt", "generated", "tok/s", "KV"):
        slots.add_column(name, justify="left" if name in ("state", "request", "replica") else "right")
    colour = {"idle": "dim", "prefilling": "yellow", "generating": "green"}
    for (replica, seq_id), row in rows:
        s = row.sample
        busy = s.request_id is not None
        slots.add_row(
            replica or "-",
            str(seq_id),
            f"[{colour.get(s.state, '')}]{s.state}[/]",
            (s.request_id or "")[:12],
            str(s.prompt_tokens) if busy else "",
            str(s.generated_tokens) if busy else "",
            f"{row.rate:.1f}" if busy and s.state == "generating" else "",
            str(s.kv_tokens),
        )

    current = rates[-1] / WINDOW_S if rates else 0.0
    peak = max(rates, default=0) / WINDOW_S
    throughput = Panel(
        f"{sparkline(rates, 60)}\nnow {current:.1f} tok/s   peak {peak:.1f} tok/s   "
        f"(one column per {WINDOW_S:.0f} s)",
        title="aggregate tokens/s",
    )
    ttft = Table(title="time to first token", expand=True)
    for name in ("n", "p50", "p90", "p99", "max"):
        ttft.add_column(name, justify="right")
    p = [board.percentile(q) for q in (50, 90, 99, 100)]
    ttft.add_row(str(len(board.ttfts_ms)), *("-" if v is None else f"{v:.0f} ms" for v in p))
    return Group(Panel(header + kv), slots, throughput, ttft)


def run_load(
    ref: EngineHandle, requests: int, concurrency: int, max_tokens: int, seed: int
) -> list[BaseException]:
    """``requests`` streams from ``concurrency`` caller threads; returns the errors."""
    rng = random.Random(seed)
    jobs = [
        (rng.choice(TOPICS), rng.randint(1, 6), rng.randint(max_tokens // 2, max_tokens))
        for _ in range(requests)
    ]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def caller() -> None:
        while True:
            with lock:
                if not jobs:
                    return
                topic, repeat, n = jobs.pop()
            context = "Here is some context you may use. " * (2 * repeat)
            messages = [{"role": "user", "content": f"{context}\nTell me about {topic}."}]
            try:
                for _piece in stream_chat(ref, messages, max_tokens=n, temp=0.7):
                    pass
            except BaseException as e:  # reported by the caller of run_load
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def save_png(board: Board, path: str) -> None:
    """A figure of the run: tokens/s, queue depth and active slots per window; TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with board.lock:
        rates = [g / WINDOW_S for g in board.generated_by_window]
        queue_depth = list(board.queue_by_window)
        active = list(board.active_by_window)
        ttfts = [t / 1000.0 for t in board.ttfts_ms]
    t = [i * WINDOW_S for i in range(len(rates))]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8), constrained_layout=True)
    top.step(t, rates, where="post", color="tab:green")
    top.set_ylabel("generated tok/s")
    top.set_title("llama-cpp-actors: a run seen through its telemetry signals")
    middle.step(t, active, where="post", label="active slots (max per window)")
    middle.step(t, queue_depth, where="post", linestyle="--", label="queue depth (max per window)")
    middle.set_xlabel("time since start (s)")
    middle.legend()
    if ttfts:
        bottom.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post")
    bottom.set_xlabel("time to first token (s)")
    bottom.set_ylabel("fraction of requests")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-parallel", type=int, default=4, help="slots per engine")
    parser.add_argument(
        "--replicas", type=int, default=1, help="more than 1: a ServerPool of that many engines"
    )
    parser.add_argument("--backend", choices=["local", "ray"], default="local", help="the pool's backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", metavar="FILE", help="save a figure of the run instead of the live view")
    args = parser.parse_args()

    board = Board()
    options: dict[str, Any] = {"n_parallel": args.n_parallel, "n_ctx": 512 * args.n_parallel}
    ref: EngineHandle
    if args.replicas > 1:
        # Several engines share this machine's cores: one llama.cpp thread each.
        ref = ServerPool.start(replicas=args.replicas, backend=args.backend, n_threads=1, **options)
    else:
        ref = ServerActor.start(**options)
    engines = (
        f"{args.replicas} x {args.n_parallel} slots ({args.backend} pool)"
        if args.replicas > 1
        else f"{args.n_parallel} slots"
    )
    title = f"llama-cpp-actors: {args.requests} requests, {args.concurrency} callers, {engines}"
    load = threading.Thread(
        target=lambda: errors.extend(
            run_load(ref, args.requests, args.concurrency, args.max_tokens, args.seed)
        ),
        daemon=True,
    )
    errors: list[BaseException] = []
    try:
        load.start()
        if args.png:
            load.join()
            save_png(board, args.png)
            print(f"saved {args.png}: {board.done} done, {board.failed} failed")
        else:
            from rich.live import Live

            with Live(render(board, title), refresh_per_second=4) as live:
                while load.is_alive():
                    load.join(0.25)
                    live.update(render(board, title))
                live.update(render(board, title))
    finally:
        ref.stop()
        board.close()
    if errors:
        raise SystemExit(f"a request failed: {errors[0]!r}")


if __name__ == "__main__":
    main()
