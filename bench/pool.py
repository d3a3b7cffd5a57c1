"""ServerPool: the router's cost against one engine, two replicas, and prefix affinity.

Three measurements, each system in its own process (see bench/throughput.py on OpenMP):

1. **Router overhead.** ``--concurrency`` greedy streams of ``--max-tokens`` tokens on one
   engine, then on a pool of one replica (local, then Ray): the same engine behind the
   router (and, on Ray, across a process boundary with streaming generators). At
   ``n_threads=1`` and at ``n_threads=2`` (every core of this machine: then Ray's own
   daemons take CPU time from llama.cpp's threads, which a plain engine does not see).
2. **Two replicas on this machine.** A Ray pool of two replicas with ``n_threads=1``
   each, against one engine with ``n_threads=2``: both use every core. On a machine with
   more cores than one engine can use, or on two machines, replicas add up; on 2 cores
   they share them.
3. **Prefix affinity.** ``bench/multiturn.py``'s chat workload (conversations sharing a
   system prompt, several turns) on one engine with ``--slots`` slots, and on a Ray pool
   of two replicas with half the slots each: the prefix-cache hit ratio (cached prompt
   tokens / prompt tokens, from the Completions) of the pool against the engine's.

    python bench/pool.py             # c=8, 128 tokens, 2 rounds, 8 conversations x 4 turns
    python bench/pool.py --quick     # a smoke-sized run

Writes ``bench/results/pool.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from actors import ServerActor, ServerPool, default_model_path
from bench._common import RESULTS, Measurement, machine, markdown_table, prompts, write_result
from bench._systems import Engine
from bench.multiturn import converse, system_prompt

SYSTEMS = ["engine", "pool-local-1", "pool-ray-1", "pool-ray-2"]


def _init_ray() -> None:
    import ray

    ray.init(num_cpus=2, logging_level=logging.WARNING, include_dashboard=False, object_store_memory=10**8)


def start(name: str, n_parallel: int, n_ctx: int, n_threads: int) -> Any:
    """The system ``name``: a ServerActor or a ServerPool."""
    options: dict[str, Any] = {"n_parallel": n_parallel, "n_ctx": n_ctx, "n_threads": n_threads}
    if name == "engine":
        return ServerActor.start(**options)
    if name == "pool-local-1":
        return ServerPool.start(replicas=1, backend="local", **options)
    _init_ray()
    if name == "pool-ray-1":
        return ServerPool.start(replicas=1, backend="ray", **options)
    if name == "pool-ray-2":
        half = {"n_parallel": max(1, n_parallel // 2), "n_ctx": n_ctx // 2, "n_threads": 1}
        return ServerPool.start(replicas=2, backend="ray", **half)
    raise ValueError(name)


class _Started(Engine):
    """bench/_systems.py's engine driver (threads streaming through queues), on whatever
    system ``start`` makes of its name."""

    def __init__(self, name: str, n_ctx: int, n_threads: int) -> None:
        super().__init__(default_model_path(), n_ctx, n_threads)
        self.name = name

    def start(self, concurrency: int) -> None:
        self.ref = start(self.name, concurrency, self.n_ctx, self.n_threads)


def child_throughput(name: str, args: argparse.Namespace) -> dict[str, Any]:
    system = _Started(name, args.n_ctx, int(args.n_threads))
    system.start(args.concurrency)
    try:
        system.run(prompts(args.concurrency, f"warm.{args.tag}"), 2)
        m = system.run(prompts(args.concurrency, args.tag), args.max_tokens)
    finally:
        system.stop()
    return {"tokens": m.tokens, "wall_s": m.wall_s, "ttft_ms": m.ttft_ms, "itl_ms": m.itl_ms}


def child_multiturn(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """bench/multiturn.py's workload with a 280-token system prompt: prompt and cached tokens."""
    ref = start(name, args.slots, args.n_ctx, int(args.n_threads))
    try:
        completions = converse(ref, system_prompt(280), args.conversations, args.turns, args.max_tokens // 4)
    finally:
        ref.stop()
    return {
        "prompt_tokens": sum(c.prompt_tokens for c in completions),
        "cached_tokens": sum(c.prefix_cache_tokens for c in completions),
    }


def in_child(kind: str, name: str, args: argparse.Namespace, tag: str, n_threads: int) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", kind, "--system", name, "--tag", tag,
        "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
        "--n-ctx", str(args.n_ctx), "--n-threads", str(n_threads), "--slots", str(args.slots),
        "--conversations", str(args.conversations), "--turns", str(args.turns),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{name} ({kind}) failed:\n{result.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-threads", default="1,2", help="comma-separated thread counts per engine")
    parser.add_argument(
        "--slots", type=int, default=4, help="slots of the multi-turn engine (the pool: half each)"
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--quick", action="store_true", help="c=2, 8 tokens, 1 round, 2 conversations x 2 turns"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where pool.md goes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="t", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds, args.conversations, args.turns = 2, 8, 1, 2, 2
        args.n_threads = "1"
    if args.child:
        work = child_throughput if args.child == "throughput" else child_multiturn
        print(json.dumps(work(args.system, args)))
        return

    systems = args.systems.split(",")
    thread_counts = [int(n) for n in str(args.n_threads).split(",")]
    # (system, n_threads); the two-replica pool always gives each replica one thread.
    runs = [(name, nt) for nt in thread_counts for name in systems if name != "pool-ray-2"]
    if "pool-ray-2" in systems:
        runs.append(("pool-ray-2", 1))
    results: dict[tuple[str, int], Measurement] = {}
    for r in range(args.rounds):
        for name, nt in runs if r % 2 == 0 else runs[::-1]:
            data = in_child("throughput", name, args, f"{r}.{name}.{nt}", nt)
            m = Measurement(
                name, args.concurrency, data["tokens"], data["wall_s"], data["ttft_ms"], data["itl_ms"]
            )
            results.setdefault((name, nt), Measurement(name, args.concurrency)).add(m)
            print(
                f"  round {r + 1}/{args.rounds} {name:14s} n_threads={nt} {m.tokens_per_s:7.1f} tok/s",
                flush=True,
            )
    rows = []
    for (name, nt), m in results.items():
        base = results.get(("engine", max(thread_counts) if name == "pool-ray-2" else nt))
        ratio = f"{m.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        threads = "2 x 1" if name == "pool-ray-2" else str(nt)
        row = m.row()
        rows.append([row[0], threads, *row[2:], ratio])
    header = ["system", "n_threads", "tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"]
    throughput = markdown_table([*header, "vs engine (same cores)"], rows)
    print(throughput)

    hits = {}
    for name in ("engine", "pool-ray-2"):
        if name in systems:
            data = in_child("multiturn", name, args, f"mt.{name}", 1)
            hits[name] = data["cached_tokens"] / data["prompt_tokens"]
            print(f"  multi-turn {name:12s} prefix-cache hit ratio {hits[name]:.3f}", flush=True)
    affinity = ""
    if len(hits) == 2:
        ratio = hits["pool-ray-2"] / hits["engine"]
        affinity = markdown_table(
            ["system", "slots", "prefix-cache hit ratio", "vs engine"],
            [
                ["engine", str(args.slots), f"{hits['engine']:.3f}", "1.00x"],
                [
                    "pool-ray-2",
                    f"2 x {max(1, args.slots // 2)}",
                    f"{hits['pool-ray-2']:.3f}",
                    f"{ratio:.2f}x",
                ],
            ],
        )
        print(affinity)

    text = (
        f"# ServerPool\n\n{machine()}\n\n"
        f"`python bench/pool.py` with c={args.concurrency}, {args.max_tokens} tokens per request, "
        f"{args.rounds} rounds; each engine with `n_threads` as listed (the two-replica pool: 1 each, "
        f"against the engine with every core).\n\n"
        f"## Throughput\n\n{throughput}\n\n"
        f"## Prefix affinity ({args.conversations} conversations x {args.turns} turns)\n\n{affinity}\n"
    )
    path = write_result("pool", text, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
