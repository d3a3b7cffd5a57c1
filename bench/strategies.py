"""Batch strategies under a mixed load: long-running decodes while long prompts arrive.

Four requests decode for the whole run while a new ``--prompt-tokens`` prompt arrives
every ``--interval`` seconds. For each strategy we report the arrivals' time to first
token and the running decodes' inter-token latency (p50/p95), measured in the same run
one strategy after the other (interleaved over ``--rounds``).

    python bench/strategies.py            # 1,500-token prompts every second
    python bench/strategies.py --quick    # a smoke-sized run

Writes ``bench/results/strategies.md`` and ``strategies.png``.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/ (whose strategies.py
# would shadow the strategies package).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import strategies
from actors import Cancel, Done, Failed, GenerateTokens, ServerActor, StreamTokens, Token
from bench._common import (
    NO_EOG,
    RESULTS,
    machine,
    markdown_table,
    percentile,
    pyplot,
    save_figure,
    write_result,
)

CANDIDATES: dict[str, strategies.BatchStrategy] = {
    "DecodeMaximal": strategies.DecodeMaximal(),
    "PrefillPriority": strategies.PrefillPriority(),
    "Balanced": strategies.Balanced(),
}
if hasattr(strategies, "Adaptive"):
    CANDIDATES["Adaptive"] = strategies.Adaptive()


def _tokens(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 19000 for i in range(n)]


def run_one(
    strategy: strategies.BatchStrategy, args: argparse.Namespace, tag: int
) -> tuple[list[float], list[float]]:
    """One mixed-load run; returns (arrival TTFTs, background inter-token gaps) in ms."""
    ref = ServerActor.start(
        n_parallel=4 + args.arrivals,
        n_ctx=args.n_ctx,
        n_threads=args.n_threads,
        batch_strategy=strategy,
    )
    gaps: list[float] = []
    window = threading.Event()
    background = []
    try:
        consumers = []
        for i in range(4):
            q: queue.Queue[Any] = queue.Queue()
            message = StreamTokens(
                _tokens(tag * 100 + i, 32),
                reply_to=q,
                max_tokens=args.n_ctx,
                temp=0,
                logit_bias=NO_EOG,
            )
            ref.tell(message)
            background.append(message.request_id)

            def consume(q: queue.Queue[Any] = q) -> None:
                last = None
                while True:
                    event = q.get(timeout=600)
                    if isinstance(event, Done | Failed):
                        return
                    now = time.perf_counter()
                    if isinstance(event, Token) and last is not None and window.is_set():
                        gaps.append((now - last) * 1000.0)
                    last = now

            thread = threading.Thread(target=consume)
            thread.start()
            consumers.append(thread)
        time.sleep(1.0)  # the four are decoding
        window.set()
        futures = []
        for k in range(args.arrivals):
            prompt = _tokens(tag * 100 + 10 + k, args.prompt_tokens)
            futures.append(ref.ask(GenerateTokens(prompt, max_tokens=4, temp=0, logit_bias=NO_EOG)))
            time.sleep(args.interval)
        ttfts = [f.get(timeout=900).ttft_ms for f in futures]
        window.clear()
        for request_id in background:
            ref.tell(Cancel(request_id))
        for thread in consumers:
            thread.join(timeout=60)
    finally:
        ref.stop()
    return ttfts, gaps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--arrivals", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument("--strategies", default=",".join(CANDIDATES))
    parser.add_argument("--quick", action="store_true", help="200-token prompts, 2 arrivals")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.arrivals, args.interval, args.n_ctx = 200, 2, 0.3, 4096
    names = args.strategies.split(",")
    print(machine())
    ttft: dict[str, list[float]] = {n: [] for n in names}
    itl: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t, g = run_one(CANDIDATES[name], args, tag=r * 10 + names.index(name))
            ttft[name] += t
            itl[name] += g
            print(
                f"  round {r + 1} {name:16s} TTFT p50 {percentile(t, 50):7.0f} ms  "
                f"ITL p50 {percentile(g, 50):6.1f} p95 {percentile(g, 95):7.1f} ms",
                flush=True,
            )
    rows = [
        [
            n,
            f"{percentile(ttft[n], 50):.0f}",
            f"{percentile(ttft[n], 95):.0f}",
            f"{percentile(itl[n], 50):.1f}",
            f"{percentile(itl[n], 95):.1f}",
        ]
        for n in names
    ]
    text = (
        f"# Strategies under mixed load\n\n{machine()}; 4 running decodes, a {args.prompt_tokens}-token "
        f"prompt every {args.interval} s ({args.arrivals} in all), n_threads={args.n_threads}, n_batch 2048, "
        f"chunk_size 512.\n\n"
        + markdown_table(
            ["strategy", "arrivals TTFT p50 ms", "TTFT p95 ms", "decode ITL p50 ms", "ITL p95 ms"],
            rows,
        )
    )
    print()
    print(text)
    write_result("strategies", text, args.out)
    plt = pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        x = range(len(names))
        left.bar(x, [percentile(ttft[n], 50) for n in names])
        left.set(title="arrivals: TTFT p50 (ms)")
        right.bar(x, [percentile(itl[n], 95) for n in names])
        right.set(title="running decodes: ITL p95 (ms)")
        for ax in (left, right):
            ax.set_xticks(list(x), names, rotation=15)
            ax.grid(alpha=0.3, axis="y")
        save_figure(plt, fig, args.out / "strategies.png")


if __name__ == "__main__":
    main()
