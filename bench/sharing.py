"""Prefix sharing across slots: prompt tokens computed, KV cells held and TTFT.

Three systems serve the same two workloads, each run in a fresh process:

* ``sharing``: ``ServerActor(prompt_cache_ram_mb=--ram-mb)`` (a new request copies the
  longest prefix any slot holds, by ``seq_cp``, or restores it from the RAM cache;
  shared KV cells counted once);
* ``no-sharing``: the same with ``prefix_sharing=False`` (a slot reuses only its own
  cache, and the RAM cache);
* ``llama-server``: llama.cpp's C++ server (``LLAMA_SERVER_BIN``, ``-kvu --cache-reuse 256
  --metrics``, its default 8 GiB host prompt cache), ``/completion`` over SSE.

Workloads, all greedy with end-of-generation banned, prompts sent as token ids so every
system sees the same tokens:

* ``multi-turn``: ``--conversations`` chats with one ``--system-tokens``-token system
  prompt take ``--turns`` turns each, concurrently (each conversation turn by turn,
  appending the previous answer and a new user message; ``session=`` per conversation
  for ours), on each of ``--slots`` slot counts;
* ``burst``: ``--burst`` requests with one ``--doc-tokens``-token document and different
  short questions arrive at once on ``--burst-slots`` slots.

Measured per system and workload: prompt tokens computed (ours: the sum of the
``telemetry.tick`` signal's ``prefill_tokens``; llama-server: the sum of each response's
``timings.prompt_n``, its prefill count; ``tokens_cached`` is not a reuse count but the
length of the slot's cache after the request), the unique prompt tokens (the nodes of a
prefix tree of every prompt sent), peak KV cells (ours: the tick's ``kv_cells_used``;
llama-server exposes no cell count, so the sum of ``n_prompt_tokens`` over ``/slots``,
polled every 250 ms: its slots never share cells), TTFT at the caller and wall time.

    python bench/sharing.py                       # needs LLAMA_SERVER_BIN for the peer
    python bench/sharing.py --quick               # a smoke-sized run

Writes ``bench/results/sharing.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import urllib.request  # after the line above: it imports http, which bench/http.py shadows

from actors import Done, Failed, GetTokenizer, ServerActor, StreamTokens, Token, default_model_path
from bench._common import NO_EOG, RESULTS, machine, markdown_table, percentile, run_threads, write_result
from bench._sse import SseConnection
from bench._systems import _free_port, _wait_http

SYSTEMS = ("sharing", "no-sharing", "llama-server")
Tokenize = Callable[[str, bool], list[int]]  # (text, add_special) -> token ids
# Result of one request: (ttft_ms, answer token ids, prompt tokens computed).
Reply = tuple[float, list[int], int]
Send = Callable[[int, list[int], int], Reply]  # (client, prompt tokens, max_tokens) -> Reply

_SUBJECTS = [
    "The reading room",
    "Every archive box",
    "A rare map",
    "The night porter",
    "Each index card",
    "The oldest atlas",
    "A visiting scholar",
    "The east stairwell",
    "Our catalogue",
    "The bindery",
]
_VERBS = [
    "opens at",
    "is checked before",
    "must be logged by",
    "stays closed after",
    "is dusted at",
    "is moved only at",
    "gets a new label at",
]
_TIMES = ["seven", "half past eight", "noon", "a quarter to three", "five", "nine in the evening",
          "dawn", "eleven", "midnight", "ten past four", "six sharp"]  # fmt: skip


def _text(kind: str, target: int, tokenize: Tokenize) -> tuple[str, int]:
    """Varied sentences until the text tokenizes to at least ``target`` tokens."""
    sentences, i = [f"You are the help desk of a large library; this is the {kind}."], 0
    while len(tokenize(" ".join(sentences), False)) < target:
        s, v, t = _SUBJECTS[i % 10], _VERBS[i % 7], _TIMES[i % 11]
        sentences.append(f"Rule {i + 1}: {s} {v} {t}, floor {i % 13}, desk {i % 17}.")
        i += 1
    text = " ".join(sentences)
    return text, len(tokenize(text, False))


def plan(workload: str, args: argparse.Namespace, tokenize: Tokenize) -> tuple[int, list[list[list[int]]]]:
    """The shared prefix's token count and, per client, each turn's new tokens (turn 0
    is the whole first prompt; later turns follow the previous answer)."""

    def chat(role: str, content: str) -> list[int]:
        return tokenize(f"<|im_start|>{role}\n{content}<|im_end|>\n", False)

    def ask(content: str) -> list[int]:
        return chat("user", content) + tokenize("<|im_start|>assistant\n", False)

    if workload == "burst":
        doc, _ = _text("document every question is about", args.doc_tokens, tokenize)
        prefix = tokenize("", True) + chat("system", doc)
        questions = [
            [prefix + ask(f"Question {i}: what happens at desk {i * 3 % 17}?")] for i in range(args.burst)
        ]
        return len(prefix), questions
    system, _ = _text("system prompt", args.system_tokens, tokenize)
    prefix = tokenize("", True) + chat("system", system)
    turns = []
    for c in range(args.conversations):
        first = prefix + ask(f"Reader {c}: where is book {c * 7}?")
        # The answer has no end token (EOG is banned): close the assistant turn first.
        later = [tokenize("<|im_end|>\n", False) + ask(f"Reader {c}, question {t}: and book {c * 7 + t}?")
                 for t in range(1, args.turns)]  # fmt: skip
        turns.append([first, *later])
    return len(prefix), turns


def unique_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens in the union of ``prompts`` as a prefix tree: what an ideal cache computes."""
    root: dict[int, Any] = {}
    n = 0
    for prompt in prompts:
        node = root
        for token in prompt:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                n += 1
            node = child
    return n


def drive(clients: list[list[list[int]]], max_tokens: int, send: Send) -> tuple[list[dict[str, Any]], float]:
    """Every client at once, each turn by turn; returns per-request records and wall s."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        prompt: list[int] = []
        for turn in clients[i]:
            prompt = prompt + turn
            ttft_ms, answer, computed = send(i, prompt, max_tokens)
            with lock:
                records.append({"prompt": prompt, "ttft_ms": ttft_ms, "computed": computed})
            prompt = prompt + answer

    t0 = time.perf_counter()
    run_threads([functools.partial(client, i) for i in range(len(clients))])
    return records, time.perf_counter() - t0


def run_ours(workload: str, slots: int, args: argparse.Namespace) -> dict[str, Any]:
    from telemetry import Subscription, tick

    ref = ServerActor.start(
        model_path=default_model_path(), n_parallel=slots, n_ctx=args.n_ctx, n_threads=args.n_threads,
        prefix_sharing=args.child == "sharing", prompt_cache_ram_mb=args.ram_mb,
    )  # fmt: skip
    try:
        tok = ref.ask(GetTokenizer(), timeout=120)
        n_prefix, clients = plan(workload, args, lambda text, special: tok.tokenize(text, special, True))

        def send(i: int, prompt: list[int], max_tokens: int) -> Reply:
            events: queue.Queue[Any] = queue.Queue()
            session = f"c{i}" if workload == "multi-turn" else None
            t_sent = time.perf_counter()
            ref.tell(StreamTokens(prompt, reply_to=events, max_tokens=max_tokens, temp=0,
                                  logit_bias=NO_EOG, session=session))  # fmt: skip
            ttft_ms: float | None = None
            while True:
                event = events.get(timeout=600)
                if isinstance(event, Token) and ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t_sent) * 1000.0
                elif isinstance(event, Done):
                    c = event.completion
                    return ttft_ms or 0.0, list(c.token_ids), c.prompt_tokens - c.prefix_cache_tokens
                elif isinstance(event, Failed):
                    raise event.error

        send(0, tok.tokenize("Warm-up: count to three.", True, True), 2)  # first-touch costs
        ticks = {"prefill": 0, "kv_peak": 0}

        def on_tick(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
            ticks["prefill"] += measurements["prefill_tokens"]
            ticks["kv_peak"] = max(ticks["kv_peak"], measurements["kv_cells_used"])

        subscription = Subscription({tick: on_tick})
        try:
            records, wall_s = drive(
                clients, args.max_tokens if workload == "multi-turn" else args.burst_tokens, send
            )
        finally:
            subscription.close()
    finally:
        ref.stop()
    return summary(records, wall_s, n_prefix, ticks["prefill"], ticks["kv_peak"], "")


def _get_json(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
    return raw.decode() if path == "/metrics" else json.loads(raw)


def _prompt_tokens_total(port: int) -> int:
    lines = _get_json(port, "/metrics").splitlines()
    return int(float(next(ln.split()[-1] for ln in lines if ln.startswith("llamacpp:prompt_tokens_total"))))


def run_llama_server(workload: str, slots: int, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    command = [
        os.environ["LLAMA_SERVER_BIN"], "-m", default_model_path(), "--host", "127.0.0.1",
        "--port", str(port), "-c", str(args.n_ctx), "-np", str(slots), "-b", str(min(args.n_ctx, 2048)),
        "-ub", "512", "-kvu", "--cache-reuse", "256", "--metrics", "-t", str(args.n_threads),
        "-tb", str(args.n_threads), "--no-webui",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_http(port, "/health", proc)

        def tokenize(text: str, special: bool) -> list[int]:
            body = {"content": text, "add_special": special, "parse_special": True}
            return list(_get_json(port, "/tokenize", body)["tokens"])

        n_prefix, clients = plan(workload, args, tokenize)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def one(prompt: list[int], max_tokens: int) -> Reply:
            conn = SseConnection(port, timeout_s=600)
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "cache_prompt": True, "return_tokens": True}  # fmt: skip
            t_sent, ttft_ms, computed = time.perf_counter(), None, 0
            answer: list[int] = []
            try:
                async for data in conn.events("/completion", body):
                    event = json.loads(data)
                    if event.get("stop"):
                        computed = int(event["timings"]["prompt_n"])
                        break
                    tokens = event.get("tokens") or []
                    if tokens and ttft_ms is None:
                        ttft_ms = (time.perf_counter() - t_sent) * 1000.0
                    answer += tokens
            finally:
                await conn.close()
            return ttft_ms or 0.0, answer, computed

        def send(i: int, prompt: list[int], max_tokens: int) -> Reply:
            return asyncio.run_coroutine_threadsafe(one(prompt, max_tokens), loop).result(timeout=900)

        send(0, tokenize("Warm-up: count to three.", True), 2)
        computed_before = _prompt_tokens_total(port)
        kv = {"peak": 0, "stop": False}

        def poll_slots() -> None:  # no KV cell count anywhere: its slots hold their own cells
            while not kv["stop"]:
                slots_json = _get_json(port, "/slots")
                kv["peak"] = max(kv["peak"], sum(s.get("n_prompt_tokens", 0) for s in slots_json))
                time.sleep(0.25)

        poller = threading.Thread(target=poll_slots, daemon=True)
        poller.start()
        try:
            records, wall_s = drive(
                clients, args.max_tokens if workload == "multi-turn" else args.burst_tokens, send
            )
        finally:
            kv["stop"] = True
            poller.join()
        loop.call_soon_threadsafe(loop.stop)
        metrics_computed = _prompt_tokens_total(port) - computed_before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    note = f"/metrics prompt_tokens_total: {metrics_computed}"
    return summary(records, wall_s, n_prefix, sum(r["computed"] for r in records), kv["peak"], note)


def summary(
    records: list[dict[str, Any]], wall_s: float, n_prefix: int, computed: int, kv_peak: int, note: str
) -> dict[str, Any]:
    prompts = [r["prompt"] for r in records]
    return {
        "requests": len(records),
        "prefix_tokens": n_prefix,
        "computed": computed,
        "computed_per_request": sum(r["computed"] for r in records),
        "unique": unique_tokens(prompts),
        "longest_prompt": max(len(p) for p in prompts),
        "kv_peak": kv_peak,
        "ttft_ms": [r["ttft_ms"] for r in records],
        "wall_s": wall_s,
        "note": note,
    }


def run_in_child(system: str, workload: str, slots: int) -> dict[str, Any]:
    """One system on one workload in a fresh process (libgomp's idle teams from an
    earlier run in the same process throttle later ones; see bench/throughput.py)."""
    command = [
        sys.executable,
        __file__,
        *sys.argv[1:],
        "--child",
        system,
        "--workload",
        f"{workload}:{slots}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{system} on {workload} ({slots} slots) failed:\n{result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one cell: token counts averaged, the KV peak is the largest, TTFTs pooled."""
    out = dict(runs[0])
    for key in ("computed", "computed_per_request", "unique", "wall_s"):
        out[key] = statistics.mean(r[key] for r in runs)
    out["kv_peak"] = max(r["kv_peak"] for r in runs)
    out["ttft_ms"] = [t for r in runs for t in r["ttft_ms"]]
    out["note"] = "; ".join(r["note"] for r in runs if r["note"])
    return out


def _p50(r: dict[str, Any]) -> float:
    return percentile(r["ttft_ms"], 50)


def _mean(r: dict[str, Any]) -> float:
    return float(statistics.mean(r["ttft_ms"]))


def report(
    results: dict[tuple[str, str], dict[str, Any]], cells: dict[str, int], systems: list[str], args: Any
) -> str:
    """The markdown page: per-system rows, sharing / peer ratios and the issue's goals;
    ``cells`` maps each workload's label to its slot count."""
    header = ["system", "workload", "requests", "computed", "unique", "computed / unique", "peak KV cells",
              "TTFT p50 ms", "TTFT p95 ms", "TTFT mean ms", "wall s"]  # fmt: skip
    rows = []
    for cell in cells:
        for s in systems:
            r = results[(s, cell)]
            kv = str(r["kv_peak"]) if s != "llama-server" else f"~{r['kv_peak']} (Σ /slots)"
            rows.append([s, cell, str(r["requests"]), f"{r['computed']:.0f}", f"{r['unique']:.0f}",
                         f"{r['computed'] / r['unique']:.2f}", kv, f"{_p50(r):.0f}",
                         f"{percentile(r['ttft_ms'], 95):.0f}", f"{_mean(r):.0f}",
                         f"{r['wall_s']:.1f}"])  # fmt: skip
    peers = [s for s in systems if s != "sharing"]
    ratio_rows = []
    for cell in cells:
        ours = results[("sharing", cell)]
        row = [cell]
        for key in ("computed", "kv_peak", "wall_s"):
            # llama-server's KV is polled from /slots: a poll that missed the busy
            # moments (below the prefix itself) says nothing.
            row += [
                f"{ours[key] / theirs[key]:.2f}x"
                if theirs[key] and (key != "kv_peak" or theirs[key] >= theirs["prefix_tokens"])
                else "n/a"
                for theirs in (results[(p, cell)] for p in peers)
            ]
        row += [f"{_p50(results[(p, cell)]) / _p50(ours):.1f}x" for p in peers]
        row += [f"{_mean(results[(p, cell)]) / _mean(ours):.1f}x" for p in peers]
        ratio_rows.append(row)
    ratio_header = ["workload"]
    for what in ("computed", "peak KV", "wall"):
        ratio_header += [f"{what} vs {p}" for p in peers]
    ratio_header += [f"TTFT p50 speed-up vs {p}" for p in peers]
    ratio_header += [f"TTFT mean speed-up vs {p}" for p in peers]

    goals = []
    for cell in cells:
        r = results[("sharing", cell)]
        ratio = r["computed"] / r["unique"]
        goals.append(
            [f"{cell}: computed within 1.1x of unique", f"{ratio:.2f}x", "yes" if ratio <= 1.1 else "no"]
        )
        slots = cells[cell]
        tokens = args.max_tokens if cell.startswith("multi-turn") else args.burst_tokens
        bound = r["prefix_tokens"] + slots * (r["longest_prompt"] - r["prefix_tokens"] + tokens)
        goals.append([f"{cell}: shared prefix counted once (peak KV <= prefix + {slots} tails = {bound})",
                      str(r["kv_peak"]), "yes" if r["kv_peak"] <= bound else "no"])  # fmt: skip
    for cell in [c for c in cells if c.startswith("burst")]:
        for p in peers:
            speedup = _p50(results[(p, cell)]) / _p50(results[("sharing", cell)])
            goals.append(
                [f"{cell}: TTFT p50 >= 4x lower than {p}", f"{speedup:.1f}x", "yes" if speedup >= 4 else "no"]
            )
    prefixes = {cell: results[(systems[0], cell)]["prefix_tokens"] for cell in cells}
    notes = "".join(
        f"- {s}, {c}: {results[(s, c)]['note']}\n" for c in cells for s in systems if results[(s, c)]["note"]
    )
    setting = (
        f"{machine()}; SmolLM2-135M-Instruct Q4_1, greedy, EOG banned, n_threads={args.n_threads}, "
        f"n_ctx={args.n_ctx}, {args.rounds} round(s). Multi-turn: {args.conversations} conversations x "
        f"{args.turns} turns, {args.max_tokens} tokens per answer; burst: {args.burst} requests, "
        f"{args.burst_tokens} tokens each. Shared prefix (exact, with chat markup): "
        + ", ".join(f"{c}: {n} tokens" for c, n in prefixes.items())
    )
    return (
        f"# Prefix sharing across slots\n\n{setting}.\n\n"
        "'computed' is prompt tokens prefilled (ours: tick prefill_tokens; llama-server: "
        "timings.prompt_n); 'unique' counts a prefix tree of every prompt sent, previous answers "
        "included, which the systems already hold from generating them, so below 1.0 is possible. "
        "In multi-turn, more conversations than slots queue for a slot: TTFT is mostly that wait, "
        "and its p50 depends on how turns take turns (a system that keeps some conversations on "
        "their slots gives them a low p50 and the others a high p95); the mean counts every wait.\n\n"
        + markdown_table(header, rows)
        + "\n## sharing / peer\n\n"
        + markdown_table(ratio_header, ratio_rows)
        + "\n## Goals\n\n"
        + markdown_table(["goal", "measured", "met"], goals)
        + (f"\n## Cross-checks\n\n{notes}" if notes else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    parser.add_argument(
        "--rounds", type=int, default=1, help="fresh-process runs per cell, in rotating order"
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--slots", default="4,8", help="multi-turn slot counts")
    parser.add_argument("--max-tokens", type=int, default=32, help="per multi-turn answer")
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--burst-slots", type=int, default=8)
    parser.add_argument("--burst-tokens", type=int, default=16)
    parser.add_argument("--n-ctx", type=int, default=16384)
    parser.add_argument(
        "--ram-mb",
        type=float,
        default=2048,
        help="ours' RAM prompt cache (llama-server keeps its 8 GiB default)",
    )
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="3 conversations x 2 turns, short prefixes, 2 slots"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.slots, args.max_tokens = 3, 2, 120, "2", 4
        args.burst, args.doc_tokens, args.burst_slots, args.burst_tokens, args.n_ctx = 4, 160, 2, 4, 2048
    if args.child:
        workload, slots = args.workload.split(":")
        run = run_llama_server if args.child == "llama-server" else run_ours
        print(json.dumps(run(workload, int(slots), args)))
        return

    systems = [s for s in args.systems.split(",") if s]
    if "sharing" not in systems or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems: a subset of {', '.join(SYSTEMS)} that includes sharing")
    if "llama-server" in systems and not os.environ.get("LLAMA_SERVER_BIN"):
        print("llama-server: LLAMA_SERVER_BIN is not set (make bench-peers builds it); skipped")
        systems.remove("llama-server")
    jobs = [("multi-turn", int(n)) for n in args.slots.split(",")] + [("burst", args.burst_slots)]
    cells = {f"{w} x{n} slots": n for w, n in jobs}
    print(machine())
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (workload, slots), cell in zip(jobs, cells, strict=True):
        for r in range(args.rounds):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for s in order:
                out = run_in_child(s, workload, slots)
                runs.setdefault((s, cell), []).append(out)
                p50 = percentile(out["ttft_ms"], 50)
                print(f"  {cell:22s} round {r + 1}/{args.rounds} {s:13s} computed {out['computed']:6d} / "
                      f"unique {out['unique']:6d}, TTFT p50 {p50:7.0f} ms", flush=True)  # fmt: skip
    text = report({k: pool(v) for k, v in runs.items()}, cells, systems, args)
    print()
    print(text)
    write_result("sharing", text, args.out)


if __name__ == "__main__":
    main()
