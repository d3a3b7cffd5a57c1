"""The HTTP face against llama-server and the llama-cpp-python example server.

Three servers, each its own process started here, on the default model with the same
context, slots and threads: ours (``llama-cpp-actors serve``), llama.cpp's C++
``llama-server`` and the llama-cpp-python sdist's example server. One async load
generator drives them: at each concurrency level ``c`` clients, each with its own
connection, send streaming requests back to back (no client-side queue), half to
``/v1/chat/completions`` and half to ``/v1/completions``, until the level's requests
are done. Rounds are interleaved: each round runs every server once per level, in an
order that rotates between rounds; the tables give the median over rounds.

Every request is greedy with ``max_tokens`` tokens and end-of-generation disabled, so
every server does the same work: ``ignore_eos`` for ours and llama-server, which honour
it; a -100 ``logit_bias`` on SmolLM2's end-of-generation tokens for the example server,
which has no ``ignore_eos``. Tokens are counted from ``usage.completion_tokens`` where
the server sends it (``stream_options.include_usage``), else one per SSE event that
carries text, so tok/s is on the tokens actually generated. TTFT and inter-token
latency come from SSE event arrival times.

The HTTP layer's cost: at ``--cost-concurrency`` (8) ours serves the same completion
requests over HTTP as the in-process engine does in a child process (``bench/_systems``'
``Engine``, as ``bench/throughput.py`` measures it), interleaved in the same rounds.

    make bench-peers && python bench/http.py          # all three, levels 1 4 8 16 32
    python bench/http.py --quick --servers ours       # a one-round smoke run

Peers: ``LLAMA_SERVER_BIN`` and ``LLAMA_CPP_PYTHON_EXAMPLE_SERVER``, by default
``bench/.peers/llama-server`` and ``bench/.peers/example_server.py`` (``make
bench-peers``); a missing peer is skipped. Writes ``bench/results/http.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/ (whose strategies.py
# would shadow the strategies package).
ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from actors import default_model_path
from actors.http._cli import parse
from bench._common import EOG_IDS, RESULTS, machine, markdown_table, percentile, prompts, write_result
from bench._sse import SseConnection
from bench._systems import Engine, ExampleServer, LlamaServer, System, _free_port, _wait_http
from bench._tools_run import add_tools, decode_rate, template_path

PEERS = ROOT / "bench" / ".peers"
SERVERS = ("ours", "llama-server", "example-server")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class Ours(System):
    """``llama-cpp-actors serve`` with the flags bench/_systems' LlamaServer passes."""

    name = "ours"
    extra: tuple[str, ...] = ()  # --ours-flags

    @classmethod
    def flags(cls, model_path: str, n_ctx: int, n_parallel: int, n_threads: int, port: int) -> list[str]:
        """``serve``'s arguments: the flags bench/_systems' LlamaServer passes."""
        return [
            "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
            "-np", str(n_parallel), "-b", str(min(n_ctx, 2048)), "-ub", "512", "-kvu",
            "-t", str(n_threads), "-tb", str(n_threads), *cls.extra,
        ]  # fmt: skip

    def start(self, concurrency: int) -> None:
        self.port = _free_port()
        serve = str(Path(sys.executable).parent / "llama-cpp-actors")
        flags = self.flags(self.model_path, self.n_ctx, concurrency, self.n_threads, self.port)
        command = [serve, "serve", *flags]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(self.port, "/health", self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _peer_env() -> None:
    """Default the peers' variables to bench/.peers (this process only)."""
    for var, path in (
        ("LLAMA_SERVER_BIN", PEERS / "llama-server"),
        ("LLAMA_CPP_PYTHON_EXAMPLE_SERVER", PEERS / "example_server.py"),
    ):
        if not os.environ.get(var) and path.exists():
            os.environ[var] = str(path)


def available(requested: list[str]) -> list[str]:
    _peer_env()
    names = []
    for name in requested:
        var = {"llama-server": "LLAMA_SERVER_BIN", "example-server": "LLAMA_CPP_PYTHON_EXAMPLE_SERVER"}.get(
            name
        )
        if var and not (os.environ.get(var) and Path(os.environ[var]).exists()):
            print(f"{name}: {var} is not set or missing (make bench-peers builds it); skipped")
            continue
        names.append(name)
    return names


def body_for(server: str, path: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "bench",
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if server == "example-server":
        body["logit_bias"] = {str(t): -100 for t in EOG_IDS}  # it has no ignore_eos
    else:
        body["ignore_eos"] = True
    if server in ("ours+tools", "ours+plain"):  # the same prompt; "plain" parses nothing
        return add_tools(body, "auto" if server == "ours+tools" else "none")
    return body


@dataclass
class Run:
    """One server at one level in one round."""

    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    per_request: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


async def _one(conn: SseConnection, path: str, body: dict[str, Any]) -> tuple[float, list[float], int]:
    """Send one streaming request; (t_sent, arrivals of events with text, tokens)."""
    arrivals: list[float] = []
    usage: int | None = None
    done = False
    t_sent = time.perf_counter()
    key = "delta" if path == CHAT else None
    async for data in conn.events(path, body):
        if data == b"[DONE]":
            done = True
            continue
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or ():
            text = choice.get("delta", {}).get("content") if key else choice.get("text")
            if text:
                arrivals.append(time.perf_counter())
    if not done:
        raise RuntimeError(f"{path}: the stream ended without data: [DONE] after {len(arrivals)} events")
    if not arrivals:
        raise RuntimeError(f"{path}: no event carried text")
    return t_sent, arrivals, usage if usage is not None else len(arrivals)


async def _level(server: str, port: int, c: int, n: int, tag: str, max_tokens: int, paths: list[str]) -> Run:
    texts = prompts(n, tag)
    todo = list(range(n))
    run = Run()
    t_start = time.perf_counter()
    t_end = t_start

    async def client() -> None:
        nonlocal t_end
        conn = SseConnection(port)
        try:
            while todo:
                i = todo.pop(0)
                path = paths[i % len(paths)]
                try:
                    t_sent, arrivals, tokens = await _one(
                        conn, path, body_for(server, path, texts[i], max_tokens)
                    )
                except (OSError, TimeoutError, asyncio.IncompleteReadError, RuntimeError, ValueError) as e:
                    run.errors.append(f"{type(e).__name__}: {e}"[:400])
                    continue
                run.tokens += tokens
                run.per_request.append(tokens)
                run.ttft_ms.append((arrivals[0] - t_sent) * 1000.0)
                run.itl_ms += [(b - a) * 1000.0 for a, b in itertools.pairwise(arrivals)]
                t_end = max(t_end, arrivals[-1])
        finally:
            await conn.close()

    await asyncio.gather(*(client() for _ in range(c)))
    run.wall_s = t_end - t_start
    return run


def level(server: str, port: int, c: int, n: int, tag: str, max_tokens: int, paths: list[str]) -> Run:
    return asyncio.run(_level(server, port, c, n, tag, max_tokens, paths))


def engine_in_child(args: argparse.Namespace, c: int, n: int, tag: str) -> Run:
    """The in-process engine, in a fresh process (see bench/throughput.py's run_in_child)."""
    command = [
        sys.executable, __file__, "--child-engine", "--tag", tag, "--levels", str(c),
        "--requests", str(n), "--n-parallel", str(args.n_parallel), "--max-tokens", str(args.max_tokens),
        "--n-ctx", str(args.n_ctx), "--n-threads", str(args.n_threads), f"--ours-flags={args.ours_flags}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"engine at concurrency {c} failed:\n{result.stderr[-3000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return Run(data["tokens"], data["wall_s"], data["ttft_ms"], data["itl_ms"])


def child_engine(args: argparse.Namespace) -> None:
    """Waves of ``c`` requests at once, as many as the HTTP clients send at that level."""
    c = args.levels[0]
    engine = Engine(default_model_path(), args.n_ctx, args.n_threads)
    # The engine `serve` builds from the flags Ours passes (its RAM cache included).
    plan = parse(["serve", *Ours.flags(default_model_path(), args.n_ctx, args.n_parallel, args.n_threads, 0)])
    engine.options = dict(plan.server_options)
    engine.start(args.n_parallel)
    run = Run()
    try:
        engine.run(prompts(c, f"warm.{args.tag}"), 2)
        texts = prompts(args.requests, args.tag)
        for i in range(0, len(texts), c):
            m = engine.run(texts[i : i + c], args.max_tokens)
            run.tokens += m.tokens
            run.wall_s += m.wall_s
            run.ttft_ms += m.ttft_ms
            run.itl_ms += m.itl_ms
    finally:
        engine.stop()
    print(
        json.dumps({"tokens": run.tokens, "wall_s": run.wall_s, "ttft_ms": run.ttft_ms, "itl_ms": run.itl_ms})
    )


def start_servers(names: list[str], args: argparse.Namespace) -> dict[str, System]:
    classes: dict[str, type[System]] = {
        "ours": Ours,
        "llama-server": LlamaServer,
        "example-server": ExampleServer,
    }
    started: dict[str, System] = {}
    try:
        for name in names:
            system = classes[name](default_model_path(), args.n_ctx, args.n_threads)
            t0 = time.perf_counter()
            system.start(args.n_parallel)
            started[name] = system
            # First-touch costs out of the timing.
            warm = level(name, system.port, 2, 2, f"warm.{name}", 2, [CHAT, COMPLETIONS])
            print(f"{name}: up in {time.perf_counter() - t0:.1f} s, warm-up errors: {warm.errors or 'none'}")
    except BaseException:
        stop_servers(started)
        raise
    return started


def stop_servers(started: dict[str, System]) -> None:
    for name, system in started.items():
        try:
            system.stop()
        except Exception as e:  # the others must still stop
            print(f"{name}: stop failed: {e!r}")


def requests_at(args: argparse.Namespace, c: int) -> int:
    return max(args.requests, 2 * c)


def measure(
    started: dict[str, System],
    args: argparse.Namespace,
    paths: list[str],
    results: dict[tuple[str, int], list[Run]],
    cost: dict[str, list[Run]],
) -> None:
    """Fill ``results`` and ``cost`` run by run, so an interrupted run keeps what it measured."""
    names = [name for name in started if name != "ours+template"]  # that one only serves the tools run
    for r in range(args.rounds):
        for c in args.levels:
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                time.sleep(1.0)  # let the previous server's threads go idle
                n = requests_at(args, c)
                run = level(name, started[name].port, c, n, f"{r}.{c}.{name}", args.max_tokens, paths)
                results.setdefault((name, c), []).append(run)
                print(
                    f"  round {r + 1}/{args.rounds} c={c:2d} {name:15s} {run.tokens_per_s:7.1f} tok/s"
                    f"  TTFT p50 {percentile(run.ttft_ms, 50):6.0f} ms  errors {len(run.errors)}",
                    flush=True,
                )
        tools_server = started.get("ours+template")
        if tools_server is not None:
            c, n = args.tools_concurrency, requests_at(args, args.tools_concurrency)
            for which in ("ours+plain", "ours+tools") if r % 2 == 0 else ("ours+tools", "ours+plain"):
                time.sleep(1.0)
                run = level(which, tools_server.port, c, n, f"tools.{r}", args.max_tokens, [CHAT])
                cost[which].append(run)
                print(
                    f"  round {r + 1}/{args.rounds} tools c={c} {which:10s} {run.tokens_per_s:7.1f} tok/s"
                    f"  decode {decode_rate(run):6.1f} tok/s  errors {len(run.errors)}",
                    flush=True,
                )
        if "ours" in started and args.cost_concurrency:
            c, n = args.cost_concurrency, requests_at(args, args.cost_concurrency)
            tag = f"cost.{r}"  # the same prompts for both: they share no cache
            for which in ("engine", "ours") if r % 2 == 0 else ("ours", "engine"):
                time.sleep(1.0)
                if which == "engine":
                    run = engine_in_child(args, c, n, tag)
                else:
                    run = level("ours", started["ours"].port, c, n, tag, args.max_tokens, [COMPLETIONS])
                cost[which].append(run)
                print(
                    f"  round {r + 1}/{args.rounds} cost c={c} {which:8s} {run.tokens_per_s:7.1f} tok/s",
                    flush=True,
                )


def _med(runs: list[Run], metric: Any) -> float:
    values = [metric(run) for run in runs]
    values = [v for v in values if v == v]  # NaN when a run had no successful request
    return statistics.median(values) if values else float("nan")


def summary(runs: list[Run]) -> dict[str, float]:
    return {
        "tok/s": _med(runs, lambda r: r.tokens_per_s),
        "ttft50": _med(runs, lambda r: percentile(r.ttft_ms, 50)),
        "ttft95": _med(runs, lambda r: percentile(r.ttft_ms, 95)),
        "itl50": _med(runs, lambda r: percentile(r.itl_ms, 50)),
        "itl95": _med(runs, lambda r: percentile(r.itl_ms, 95)),
        "tokens/req": _med(runs, lambda r: statistics.mean(r.per_request) if r.per_request else float("nan")),
        "errors": sum(len(r.errors) for r in runs),
        "requests": sum(len(r.per_request) + len(r.errors) for r in runs),
    }


HEADER = [
    "server", "concurrency", "tokens/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms",
    "tokens/request", "errors",
]  # fmt: skip


def report(
    results: dict[tuple[str, int], list[Run]],
    cost: dict[str, list[Run]],
    names: list[str],
    args: argparse.Namespace,
) -> str:
    s = {key: summary(runs) for key, runs in results.items()}
    rows = [
        [
            name,
            str(c),
            f"{v['tok/s']:.1f}",
            f"{v['ttft50']:.0f}",
            f"{v['ttft95']:.0f}",
            f"{v['itl50']:.1f}",
            f"{v['itl95']:.1f}",
            f"{v['tokens/req']:.1f}",
            f"{v['errors']:.0f} / {v['requests']:.0f}",
        ]
        for c in args.levels
        for name in names
        if (v := s.get((name, c)))
    ]
    endpoints = " and ".join(args.paths) + (" (alternating)" if len(args.paths) > 1 else "")
    text = (
        f"# HTTP servers\n\n{machine()}; SmolLM2-135M-Instruct Q4_1, greedy, {args.max_tokens} tokens per "
        f"request (end-of-generation disabled), streaming {endpoints}; every server with n_ctx={args.n_ctx}, "
        f"{args.n_parallel} slots (unified KV), n_threads={args.n_threads}; max({args.requests}, 2 x c) "
        f"requests per level from c clients, each with its own connection; median of {args.rounds} "
        f"interleaved rounds.\n\n{markdown_table(HEADER, rows)}"
    )
    peers = [p for p in ("llama-server", "example-server") if p in names]
    if "ours" in names and peers:
        header = ["concurrency"]
        for p in peers:
            header += [f"tok/s ours / {p}", f"TTFT p50 ours / {p}"]
        header.append("goal (c >= 4: tok/s >= 1.0x, TTFT p50 <= 1.0x llama-server)")
        rows = []
        for c in args.levels:
            if ("ours", c) not in s or any((p, c) not in s for p in peers):
                continue
            ours, row = s[("ours", c)], [str(c)]
            for p in peers:
                row += [
                    f"{ours['tok/s'] / s[(p, c)]['tok/s']:.2f}x",
                    f"{ours['ttft50'] / s[(p, c)]['ttft50']:.2f}x",
                ]
            if c < 4 or "llama-server" not in peers:
                row.append("-")
            else:
                ls = s[("llama-server", c)]
                met = ours["tok/s"] >= ls["tok/s"] and ours["ttft50"] <= ls["ttft50"]
                row.append("met" if met else "not met")
            rows.append(row)
        text += f"\n## Ours / peer\n\n{markdown_table(header, rows)}"
    if cost["engine"] and cost["ours"]:
        engine, http = summary(cost["engine"]), summary(cost["ours"])
        ratio = http["tok/s"] / engine["tok/s"]
        rows = [
            [
                "engine (in-process)",
                f"{engine['tok/s']:.1f}",
                f"{engine['ttft50']:.0f}",
                f"{engine['itl50']:.1f}",
            ],
            ["ours over HTTP", f"{http['tok/s']:.1f}", f"{http['ttft50']:.0f}", f"{http['itl50']:.1f}"],
        ]
        text += (
            f"\n## The HTTP layer's cost\n\nConcurrency {args.cost_concurrency}, the same "
            f"{requests_at(args, args.cost_concurrency)} completion requests per round (waves of "
            f"{args.cost_concurrency} in-process, {args.cost_concurrency} clients over HTTP "
            "/v1/completions).\n\n"
            + markdown_table(["system", "tokens/s", "TTFT p50 ms", "ITL p50 ms"], rows)
            + f"\nHTTP / in-process tok/s: {ratio:.3f}x, a cost of {(1 - ratio) * 100:.1f}% "
            "(goal: at most 3%).\n"
        )
    if cost.get("ours+plain") and cost.get("ours+tools"):
        plain, tools = cost["ours+plain"], cost["ours+tools"]
        rows = [
            [
                label,
                f"{_med(runs, lambda r: r.tokens_per_s):.1f}",
                f"{_med(runs, decode_rate):.1f}",
                f"{summary(runs)['itl50']:.1f}",
                f"{summary(runs)['errors']:.0f}",
            ]
            for label, runs in (("tool_choice none", plain), ("tool_choice auto", tools))
        ]
        itl = summary(tools)["itl50"] / summary(plain)["itl50"]
        rate = _med(tools, lambda r: r.tokens_per_s) / _med(plain, lambda r: r.tokens_per_s)
        text += (
            f"\n## Streaming with tools\n\nOurs with Qwen 2.5's chat template (Hermes-style "
            f"`<tool_call>` format), concurrency {args.tools_concurrency}, the same streaming chat "
            "requests with one tool described in the prompt, `tool_choice` none (nothing parsed) and "
            "auto (the reply parser and the lazy grammar's trigger run on every token; the model calls "
            "nothing on these prompts), alternating within each round.\n\n"
            + markdown_table(["requests", "tokens/s", "decode tok/s", "ITL p50 ms", "errors"], rows)
            + f"\nauto / none: ITL p50 {itl:.3f}x, tokens/s {rate:.3f}x (goal: ITL p50 at most 1.03x). "
            "The decode rate (tokens after each request's first over its inter-token time) is a mean, "
            "moved by a few long gaps; the median ITL is the per-token cost.\n"
        )
    errors = [(name, c, e) for (name, c), runs in results.items() for run in runs for e in run.errors]
    if errors:
        text += "\n## Errors (first 10)\n\n" + "".join(f"- {n} c={c}: `{e}`\n" for n, c, e in errors[:10])
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="concurrency levels")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--requests", type=int, default=32, help="requests per level: max(this, 2 x c)")
    parser.add_argument("--endpoint", choices=("both", "chat", "completions"), default="both")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-parallel", type=int, help="slots for every server (default: the top level)")
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--cost-concurrency", type=int, default=8, help="0: skip the HTTP-cost comparison")
    parser.add_argument(
        "--tools-concurrency", type=int, default=8, help="0: skip the streaming-with-tools comparison"
    )
    parser.add_argument("--quick", action="store_true", help="one round, c=1 and 4, few short requests")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where http.md goes")
    parser.add_argument("--ours-flags", default="", help="more flags for ours, e.g. '--loop-nice 0' (an A/B)")
    parser.add_argument("--child-engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    Ours.extra = tuple(args.ours_flags.split())
    if args.quick:
        args.levels, args.rounds, args.requests, args.max_tokens, args.cost_concurrency = [1, 4], 1, 4, 8, 4
        args.tools_concurrency = min(args.tools_concurrency, 4)
    args.n_parallel = args.n_parallel or max(args.levels)
    if args.child_engine:
        child_engine(args)
        return
    args.paths = {"both": [CHAT, COMPLETIONS], "chat": [CHAT], "completions": [COMPLETIONS]}[args.endpoint]
    names = available(args.servers)
    if not names:
        parser.error("no server to measure")
    print(f"{machine()}; levels {args.levels}, {args.rounds} rounds, max_tokens={args.max_tokens}")
    started = start_servers(names, args)
    results: dict[tuple[str, int], list[Run]] = {}
    cost: dict[str, list[Run]] = {"engine": [], "ours": [], "ours+plain": [], "ours+tools": []}
    if "ours" in started and args.tools_concurrency:
        with_template = Ours(default_model_path(), args.n_ctx, args.n_threads)
        extra = Ours.extra
        Ours.extra = (*extra, "--chat-template-file", str(template_path()))
        try:
            with_template.start(args.n_parallel)
        finally:
            Ours.extra = extra
        started["ours+template"] = with_template
    # Ctrl-C or SIGTERM stops the run and reports what it measured, also when started
    # in the background (where a shell leaves SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    interrupted = False
    try:
        measure(started, args, args.paths, results, cost)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: reporting what was measured")
    finally:
        stop_servers(started)
    if interrupted:
        args.levels = [c for c in args.levels if any((n, c) in results for n in names)]
        names = [n for n in names if any((n, c) in results for c in args.levels)]
        args.rounds = f"{max((len(v) for v in results.values()), default=0)} (interrupted)"
    text = report(results, cost, names, args)
    print()
    print(text)
    write_result("http", text, args.out)


if __name__ == "__main__":
    main()
