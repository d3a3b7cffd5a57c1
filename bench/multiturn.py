"""Multi-turn chat: time to first token with the prompt caches off, on, and on with RAM.

``--conversations`` conversations share a ``--system-tokens``-token system prompt and
take ``--turns`` turns on ``--n-parallel`` slots; each turn sends every conversation's
next user message at once. With ``cache_prompt`` a slot reuses the longest cached
prefix; with the RAM cache, a conversation whose KV lost its slot gets it back from host
memory. Each mode runs in its own process.

    python bench/multiturn.py            # 16 conversations, 4 slots, 1,000-token system prompt, 6 turns
    python bench/multiturn.py --quick    # a smoke-sized run

Writes ``bench/results/multiturn.md`` and ``multiturn.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from actors import Chat, Completion, ServerActor
from bench._common import RESULTS, machine, markdown_table, percentile, pyplot, save_figure, write_result

MODES = {
    "off": {"cache_prompt": False},
    "on": {"cache_prompt": True},
    "on + RAM": {"cache_prompt": True, "prompt_cache_ram_mb": 2048},
}


def system_prompt(tokens: int) -> str:
    rule = "Always answer politely, briefly and truthfully, and never invent facts. "
    return "You are the help desk of a large library. " + rule * max(1, tokens // 14)


def converse(ref: Any, system: str, conversations: int, turns: int, max_tokens: int) -> list[Completion]:
    """``conversations`` chats sharing ``system`` take ``turns`` turns on ``ref`` (an
    engine or a pool); each turn sends every conversation's next question at once.
    Returns every Completion, in order."""
    histories = [[{"role": "system", "content": system}] for _ in range(conversations)]
    completions: list[Completion] = []
    for turn in range(turns):
        futures = []
        for i, history in enumerate(histories):
            history.append(
                {"role": "user", "content": f"Reader {i}, question {turn}: where is book {i * 7 + turn}?"}
            )
            futures.append(ref.ask(Chat(history, max_tokens=max_tokens, temp=0)))
        for history, future in zip(histories, futures, strict=True):
            completion = future.get(timeout=3600)
            completions.append(completion)
            history.append({"role": "assistant", "content": completion.text})
    return completions


def run_mode(mode: str, args: argparse.Namespace) -> list[float]:
    """One mode in this process; returns every request's TTFT in ms."""
    ref = ServerActor.start(
        n_parallel=args.n_parallel, n_ctx=args.n_ctx, n_threads=args.n_threads,
        n_ctx_per_slot=args.n_ctx // 2, **MODES[mode],
    )  # fmt: skip
    try:
        completions = converse(
            ref, system_prompt(args.system_tokens), args.conversations, args.turns, args.max_tokens
        )
    finally:
        ref.stop()
    return [c.ttft_ms for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--n-parallel", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="3 conversations, 2 slots, 120 tokens, 2 turns")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.n_parallel, args.system_tokens, args.turns, args.max_tokens = 3, 2, 120, 2, 4
        args.n_ctx = 2048
    if args.child:
        print(json.dumps(run_mode(args.child, args)))
        return
    print(machine())
    results: dict[str, list[float]] = {}
    for mode in MODES:
        command = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        print(f"  {mode:10s} TTFT p50 {percentile(results[mode], 50):8.0f} ms", flush=True)
    off = percentile(results["off"], 50)
    rows = [
        [
            mode,
            f"{percentile(t, 50):.0f}",
            f"{percentile(t, 95):.0f}",
            f"{off / percentile(t, 50):.1f}x",
        ]
        for mode, t in results.items()
    ]
    text = (
        f"# Multi-turn chat and the prompt caches\n\n{machine()}; {args.conversations} conversations on "
        f"{args.n_parallel} slots, a {args.system_tokens}-token system prompt, {args.turns} turns, "
        f"n_threads={args.n_threads}.\n\n"
        + markdown_table(["cache", "TTFT p50 ms", "TTFT p95 ms", "p50 speed-up vs off"], rows)
    )
    print()
    print(text)
    write_result("multiturn", text, args.out)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        names = list(results)
        ax.bar(names, [percentile(results[m], 50) for m in names], label="p50")
        ax.scatter(names, [percentile(results[m], 95) for m in names], color="black", zorder=3, label="p95")
        ax.set(ylabel="TTFT (ms)", title="Multi-turn chat: time to first token")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        save_figure(plt, fig, args.out / "multiturn.png")


if __name__ == "__main__":
    main()
