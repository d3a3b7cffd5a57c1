"""Aggregate tokens/s, TTFT and inter-token latency: the engine against its peers.

For each concurrency level every system serves that many greedy requests of exactly
``--max-tokens`` tokens at once (``n_parallel`` equal to the concurrency). Systems run
interleaved, in an order that rotates every round, so machine drift cancels; each
run uses fresh prompts, so no system gets a prefix-cache hit from an earlier one.

    python bench/throughput.py                       # engine, llama-lock, bare-loop
    make bench-peers && python bench/throughput.py   # + llama-server, example-server

Peers: ``LLAMA_SERVER_BIN`` (llama.cpp's C++ server) and
``LLAMA_CPP_PYTHON_EXAMPLE_SERVER`` (the llama-cpp-python sdist's Python server);
``make bench-peers`` builds both under ``bench/.peers`` and ``make bench`` sets them.
Writes ``bench/results/throughput.md`` and ``throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Run as a script: import from the repository root, not bench/ (whose strategies.py
# would shadow the strategies package).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from actors import default_model_path
from bench._common import (
    RESULTS,
    Measurement,
    machine,
    markdown_table,
    percentile,
    prompts,
    pyplot,
    save_figure,
    write_result,
)
from bench._systems import ALL, available

HEADER = [
    "system",
    "concurrency",
    "tokens/s",
    "TTFT p50 ms",
    "TTFT p95 ms",
    "ITL p50 ms",
    "ITL p95 ms",
]


def measure(
    systems: list[str], levels: list[int], rounds: int, max_tokens: int, n_ctx: int, n_threads: int
) -> dict[tuple[str, int], Measurement]:
    results: dict[tuple[str, int], Measurement] = {}
    for c in levels:
        for r in range(rounds):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            if r % 2:
                order.reverse()
            for name in order:
                m = run_in_child(name, c, f"{c}.{r}.{name}", max_tokens, n_ctx, n_threads)
                results.setdefault((name, c), Measurement(name, c)).add(m)
                print(f"  c={c:2d} round {r + 1}/{rounds} {name:15s} {m.tokens_per_s:7.1f} tok/s", flush=True)
    return results


def run_in_child(name: str, c: int, tag: str, max_tokens: int, n_ctx: int, n_threads: int) -> Measurement:
    """Measure one system in a fresh process.

    In-process systems must not share a process: once one thread of a process has run
    llama.cpp with an OpenMP team, libgomp counts that idle team against the cores
    and throttles every later team to sleeping waits (measured here: 3x slower).
    """
    command = [
        sys.executable, __file__, "--child", name, "--levels", str(c), "--tag", tag,
        "--max-tokens", str(max_tokens), "--n-ctx", str(n_ctx), "--n-threads", str(n_threads),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{name} at concurrency {c} failed:\n{result.stderr[-3000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return Measurement(name, c, data["tokens"], data["wall_s"], data["ttft_ms"], data["itl_ms"])


def child(name: str, c: int, tag: str, max_tokens: int, n_ctx: int, n_threads: int) -> None:
    system = ALL[name](default_model_path(), n_ctx, n_threads)
    system.start(c)
    try:
        system.run(prompts(c, f"warm.{tag}"), 2)  # first-touch costs out of the timing
        m = system.run(prompts(c, tag), max_tokens)
    finally:
        system.stop()
    print(json.dumps({"tokens": m.tokens, "wall_s": m.wall_s, "ttft_ms": m.ttft_ms, "itl_ms": m.itl_ms}))


def ratios(results: dict[tuple[str, int], Measurement], levels: list[int], peers: list[str]) -> str:
    header = ["concurrency"] + [f"tok/s vs {p}" for p in peers] + [f"TTFT p50 vs {p}" for p in peers]
    rows = []
    for c in levels:
        engine = results[("engine", c)]
        row = [str(c)]
        row += [f"{engine.tokens_per_s / results[(p, c)].tokens_per_s:.2f}x" for p in peers]
        row += [
            f"{percentile(engine.ttft_ms, 50) / percentile(results[(p, c)].ttft_ms, 50):.2f}x" for p in peers
        ]
        rows.append(row)
    return markdown_table(header, rows)


def plot(
    results: dict[tuple[str, int], Measurement], systems: list[str], levels: list[int], path: Path
) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in systems:
        ms = [results[(name, c)] for c in levels]
        left.plot(levels, [m.tokens_per_s for m in ms], marker="o", label=name)
        right.plot(levels, [percentile(m.ttft_ms, 50) for m in ms], marker="o", label=name)
    left.set(xlabel="concurrent requests", ylabel="aggregate tokens/s", title="Throughput", xscale="log")
    right.set(
        xlabel="concurrent requests",
        ylabel="TTFT p50 (ms)",
        title="Time to first token",
        xscale="log",
    )
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(alpha=0.3)
    left.legend()
    save_figure(plt, fig, path, "SmolLM2-135M Q4_1, greedy; ")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--systems", default=",".join(ALL), help="comma-separated: " + ", ".join(ALL))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .png go")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, int(args.levels), args.tag, args.max_tokens, args.n_ctx, args.n_threads)
        return

    levels = [int(x) for x in args.levels.split(",")]
    systems = available([s for s in args.systems.split(",") if s])
    if "engine" not in systems:
        parser.error("the engine must be one of the systems")
    print(f"{machine()}; n_threads={args.n_threads}, max_tokens={args.max_tokens}, rounds={args.rounds}")
    results = measure(systems, levels, args.rounds, args.max_tokens, args.n_ctx, args.n_threads)

    table = markdown_table(HEADER, [results[(s, c)].row() for c in levels for s in systems])
    peers = [s for s in systems if s != "engine"]
    text = (
        f"# Throughput\n\n{machine()}; SmolLM2-135M-Instruct Q4_1, greedy, {args.max_tokens} tokens "
        f"per request, n_threads={args.n_threads}, n_ctx={args.n_ctx}, {args.rounds} interleaved rounds.\n\n"
        f"{table}\n## Engine / peer\n\n{ratios(results, levels, peers)}"
    )
    print()
    print(text)
    write_result("throughput", text, args.out)
    plot(results, systems, levels, args.out / "throughput.png")


if __name__ == "__main__":
    main()
