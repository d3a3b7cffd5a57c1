"""Speculative decoding: the engine with and without n-gram drafts, against llama-server
with and without its ``ngram-simple`` speculation, in the same run.

Two workloads of greedy chat requests, each request its own text:

- ``grounded``: the answer copies long spans of the prompt: "repeat this code
  exactly" over a piece of this repository's source, and "rewrite this text, fixing
  any typos" over a piece of its documentation, alternating.
- ``open``: short stories on varied topics; the answer has little to copy.

At each concurrency level ``c`` clients send requests back to back until the level's
requests are done (``max(--requests, 2c)``); requests end at end-of-generation or
``--max-tokens``, so every system does the work the model chooses (the same greedy
text, up to near-ties). tok/s is generated tokens (as each server counts them) over
the level's wall time. Every run is a fresh process (in-process engines must not share
one: see bench/throughput.py), rounds are interleaved and rotate the order, and the
tables give the median over rounds.

    make bench-peers && python bench/speculative.py
    python bench/speculative.py --quick --systems engine engine-ngram   # a smoke run

The ``-draft`` systems have the default model draft for itself (``spec_type="draft"``,
llama-server's ``--spec-type draft-simple -md``): every draft is right under greedy
decoding and each costs a full pass, so they measure the mechanics, not a speed-up.
At concurrency 1 the table also gives the decoding phase's rate (tokens over the time
after each request's first token, llama-server's ``timings.predicted_ms``), which leaves
out the prompts' prefill that no drafter can shorten.

Goals (issue 16): grounded, concurrency 1: engine-ngram >= 1.5x engine and ahead of
llama-server-ngram; grounded, concurrency 8: engine-ngram >= 1.0x engine; open: never
more than 3% slower than engine. Writes ``bench/results/speculative.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from actors import GetStats, ServerActor, chat, default_model_path
from bench._common import _TOPICS, RESULTS, machine, markdown_table, run_threads, write_result
from bench._sse import SseConnection
from bench._systems import _free_port, _wait_http

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = [
    "engine", "engine-ngram", "engine-draft", "llama-server", "llama-server-ngram", "llama-server-draft"
]  # fmt: skip
# spec_type of each engine system; "draft" has the default model draft for itself (a
# test of the mechanics: every draft is right under greedy decoding, and each costs a
# full pass of the model).
ENGINE_SPEC = {"engine": None, "engine-ngram": "ngram", "engine-draft": "draft"}
LLAMA_SERVER_SPEC = {
    "llama-server": [],
    "llama-server-ngram": ["--spec-type", "ngram-simple"],
    "llama-server-draft": ["--spec-type", "draft-simple", "-md", default_model_path()],
}
WORKLOADS = ["grounded", "open"]
N_PARALLEL = 8


def _pieces(paths: list[str], size: int) -> list[str]:
    """Pieces of about ``size`` characters of these files, cut at line ends."""
    pieces = []
    for path in paths:
        lines = (ROOT / path).read_text().splitlines(keepends=True)
        piece = ""
        for line in lines:
            piece += line
            if len(piece) >= size:
                pieces.append(piece)
                piece = ""
    return pieces


def requests_of(workload: str, n: int, tag: str) -> list[list[dict[str, str]]]:
    """``n`` chat requests of ``workload``; ``tag`` shifts which pieces and topics, so
    the rounds do not all ask the same."""
    offset = sum(map(ord, tag))
    if workload == "open":
        return [
            [
                {
                    "role": "user",
                    "content": f"Write a short story about {_TOPICS[(offset + i) % len(_TOPICS)]}.",
                }
            ]
            for i in range(n)
        ]
    code = _pieces(["actors/engine/_cells.py", "actors/engine/_prefix.py", "strategies/_builtin.py"], 900)
    text = _pieces(["docs/design/memory.md", "README.md"], 800)
    out = []
    for i in range(n):
        if i % 2 == 0:
            piece = code[(offset + i) % len(code)]
            out.append([{"role": "user", "content": "Repeat this code exactly:\n\n" + piece}])
        else:
            piece = text[(offset + i) % len(text)]
            out.append([{"role": "user", "content": "Rewrite this text, fixing any typos:\n\n" + piece}])
    return out


# -- one run, in a child process ------------------------------------------------------


def _closed_loop(n_clients: int, work: list[Any], one: Any) -> float:
    """``n_clients`` threads take requests from ``work`` until none is left; the wall time."""
    lock = threading.Lock()
    left = list(work)

    def client() -> None:
        while True:
            with lock:
                if not left:
                    return
                item = left.pop(0)
            one(item)

    t0 = time.perf_counter()
    run_threads([client] * n_clients)
    return time.perf_counter() - t0


def run_engine(args: argparse.Namespace, spec: str | None, work: list[Any]) -> dict[str, Any]:
    ref = ServerActor.start(
        n_parallel=N_PARALLEL,
        n_ctx=args.n_ctx,
        n_threads=args.n_threads,
        spec_type=spec,
        draft_max=args.draft_max,
        draft_model_path=default_model_path() if spec == "draft" else None,
    )
    try:
        chat(ref, [{"role": "user", "content": "Hi"}], max_tokens=2, temp=0)
        tokens, decode_s = [0], [0.0]
        lock = threading.Lock()

        def one(messages: list[dict[str, str]]) -> None:
            done = chat(ref, messages, max_tokens=args.max_tokens, temp=0)
            with lock:
                tokens[0] += done.generated_tokens
                decode_s[0] += (done.duration_ms - done.ttft_ms) / 1000.0

        wall = _closed_loop(args.level, work, one)
        stats = ref.ask(GetStats())
        return {
            "tokens": tokens[0],
            "wall_s": wall,
            "decode_s": decode_s[0],
            "draft_tokens": stats["draft_tokens"],
            "draft_accepted": stats["draft_accepted"],
        }
    finally:
        ref.stop()


def run_llama_server(args: argparse.Namespace, spec: list[str], work: list[Any]) -> dict[str, Any]:
    port = _free_port()
    command = [
        os.environ.get("LLAMA_SERVER_BIN", str(ROOT / "bench/.peers/llama-server")),
        "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port),
        "-c", str(args.n_ctx), "-np", str(N_PARALLEL), "-b", "2048", "-ub", "512", "-kvu",
        "-t", str(args.n_threads), "-tb", str(args.n_threads), "--no-webui", "--metrics",
    ]  # fmt: skip
    if spec:
        command += [*spec, "--spec-draft-n-max", str(args.draft_max)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(port, "/health", proc)
        tokens, decode_s = [0], [0.0]
        lock = threading.Lock()

        async def ask(messages: list[dict[str, str]], max_tokens: int) -> tuple[int, float]:
            connection = SseConnection(port)
            body = {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            used, predicted_ms = 0, 0.0
            try:
                async for payload in connection.events("/v1/chat/completions", body):
                    if payload.startswith(b"{") and (b'"usage"' in payload or b'"timings"' in payload):
                        event = json.loads(payload)
                        used = (event.get("usage") or {}).get("completion_tokens", used)
                        predicted_ms = (event.get("timings") or {}).get("predicted_ms", predicted_ms)
            finally:
                await connection.close()
            return int(used), float(predicted_ms)

        asyncio.run(ask([{"role": "user", "content": "Hi"}], 2))

        def one(messages: list[dict[str, str]]) -> None:
            n, predicted_ms = asyncio.run(ask(messages, args.max_tokens))
            with lock:
                tokens[0] += n
                decode_s[0] += predicted_ms / 1000.0

        wall = _closed_loop(args.level, work, one)
        drafted, accepted = _draft_metrics(port)
        return {
            "tokens": tokens[0],
            "wall_s": wall,
            "decode_s": decode_s[0],
            "draft_tokens": drafted,
            "draft_accepted": accepted,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _draft_metrics(port: int) -> tuple[int, int]:
    """llama-server's draft counters from /metrics, where it has them (else 0, 0)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return 0, 0
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return int(values.get("llamacpp:n_drafted_total", 0)), int(
        values.get("llamacpp:n_drafted_accepted_total", 0)
    )


def child(args: argparse.Namespace) -> None:
    work = requests_of(args.workload, args.requests, args.tag)
    if args.child in ENGINE_SPEC:
        result = run_engine(args, ENGINE_SPEC[args.child], work)
    else:
        result = run_llama_server(args, LLAMA_SERVER_SPEC[args.child], work)
    print(json.dumps(result))


def run_in_child(
    args: argparse.Namespace, system: str, workload: str, level: int, tag: str
) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", system, "--workload", workload, "--level", str(level),
        "--requests", str(max(args.requests, 2 * level)), "--tag", tag, "--max-tokens", str(args.max_tokens),
        "--n-ctx", str(args.n_ctx), "--n-threads", str(args.n_threads), "--draft-max", str(args.draft_max),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{system} {workload} c={level} failed:\n{result.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


# -- the report -------------------------------------------------------------------------


def _rate(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["tokens"] / r["wall_s"] for r in runs)


def _decode_rate(runs: list[dict[str, Any]]) -> float:
    """Tokens per second of the requests' generation phase (after the first token), as
    llama-server's ``timings.predicted_per_second``: the prompts' prefill left out."""
    return statistics.median(r["tokens"] / r["decode_s"] for r in runs if r.get("decode_s"))


def _acceptance(runs: list[dict[str, Any]]) -> str:
    drafted = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["draft_accepted"] for r in runs)
    return f"{accepted / drafted:.2f} of {drafted / len(runs):.0f}" if drafted else "-"


def report(results: dict[tuple[str, str, int], list[dict[str, Any]]], args: argparse.Namespace) -> str:
    rows = []
    for workload in args.workloads:
        for level in args.levels:
            for system in args.systems:
                runs = results.get((system, workload, level))
                if runs:
                    tokens = statistics.median(r["tokens"] for r in runs)
                    rows.append(
                        [
                            workload,
                            str(level),
                            system,
                            f"{_rate(runs):.1f}",
                            f"{_decode_rate(runs):.1f}" if level == 1 else "-",
                            f"{tokens:.0f}",
                            _acceptance(runs),
                        ]
                    )
    text = (
        f"# Speculative decoding\n\n{machine()}; SmolLM2-135M-Instruct Q4_1, greedy chat requests up to "
        f"{args.max_tokens} tokens (ending at end-of-generation), {N_PARALLEL} slots, n_ctx={args.n_ctx}, "
        f"n_threads={args.n_threads}, draft_max={args.draft_max} (llama-server: --spec-type ngram-simple "
        f"or draft-simple, --spec-draft-n-max {args.draft_max}); the -draft systems have the model draft for "
        f"itself (every draft right, each a full pass: the mechanics, not a speed-up); "
        f"max({args.requests}, 2 x c) requests per level from c "
        f"closed-loop clients; median of {args.rounds} interleaved rounds, each run a fresh process.\n\n"
        + markdown_table(
            [
                "workload",
                "concurrency",
                "system",
                "tokens/s",
                "decode tokens/s (c=1)",
                "tokens",
                "drafts accepted (of drafted per run)",
            ],
            rows,
        )
    )

    def ratio(a: str, b: str, workload: str, level: int, rate: Any = _rate) -> str:
        x, y = results.get((a, workload, level)), results.get((b, workload, level))
        return f"{rate(x) / rate(y):.2f}x" if x and y else "-"

    columns = [
        ("engine-ngram / engine", "engine-ngram", "engine", _rate),
        ("decoding only (c=1)", "engine-ngram", "engine", _decode_rate),
        ("engine-ngram / llama-server-ngram", "engine-ngram", "llama-server-ngram", _rate),
        ("llama-server-ngram / llama-server", "llama-server-ngram", "llama-server", _rate),
        ("engine-draft / engine", "engine-draft", "engine", _rate),
        ("llama-server-draft / llama-server", "llama-server-draft", "llama-server", _rate),
    ]
    ratio_rows = [
        [workload, str(level)]
        + [
            ratio(a, b, workload, level, rate) if rate is _rate or level == 1 else "-"
            for _, a, b, rate in columns
        ]
        for workload in args.workloads
        for level in args.levels
    ]
    if any(cell != "-" for row in ratio_rows for cell in row[2:]):
        text += "\n## Ratios\n\n" + markdown_table(
            ["workload", "concurrency", *(name for name, *_ in columns)], ratio_rows
        )
        text += (
            "\nGoals: grounded at concurrency 1 at least 1.5x the engine and ahead of llama-server-ngram; "
            "grounded at concurrency 8 at least 1.0x the engine; open-ended never below 0.97x the engine.\n"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=WORKLOADS)
    parser.add_argument("--levels", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="requests per level at least (2 x c at c)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="one round, levels 1 and 2, short answers")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for speculative.md")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--level", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.levels, args.rounds, args.requests, args.max_tokens = [1, 2], 1, 2, 48
    server_bin = Path(os.environ.get("LLAMA_SERVER_BIN", str(ROOT / "bench/.peers/llama-server")))
    if not server_bin.exists():
        args.systems = [s for s in args.systems if not s.startswith("llama-server")]
        print(f"no llama-server at {server_bin} (make bench-peers): measuring the engine only")
    print(
        f"{machine()}; systems {args.systems}, workloads {args.workloads}, levels {args.levels}", flush=True
    )
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    try:
        for r in range(args.rounds):
            for workload in args.workloads:
                for level in args.levels:
                    order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
                    for system in order:
                        data = run_in_child(args, system, workload, level, f"{r}")
                        results.setdefault((system, workload, level), []).append(data)
                        print(
                            f"  round {r + 1}/{args.rounds} {workload:8s} c={level} {system:18s} "
                            f"{data['tokens'] / data['wall_s']:6.1f} tok/s  {data['tokens']} tokens  "
                            f"drafts {data['draft_accepted']}/{data['draft_tokens']}",
                            flush=True,
                        )
    finally:
        text = report(results, args)
        print("\n" + text)
        if results:
            write_result("speculative", text, args.out)


if __name__ == "__main__":
    main()
