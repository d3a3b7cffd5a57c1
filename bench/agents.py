"""The workload agents make: many tool loops over one long shared prompt, ours against llama-server.

16 agent loops run at once over HTTP, each on its own connection. A loop is one
conversation: a shared system prompt with a catalog of 20 tools (a few thousand tokens
with the template's tool description), a question of its own, then 4 tool turns
(``tool_choice`` "required") and a final answer (``tool_choice`` "none"), each turn a
streaming ``/v1/chat/completions`` request of at most ``--max-tokens`` tokens. After
each tool turn the loop appends an assistant message calling a tool and the tool's
result, both scripted (the same for every server), so both servers are sent exactly
the same requests whatever their model writes: the comparison is of the work, not of
the 135M model's choices. Whether each required turn came back as a valid call is
counted too (ours enforces it by grammar; llama-server, on this template, may answer
in prose).

Both servers run the default model with Qwen 2.5's chat template (Hermes-style
``<tool_call>`` calls, which llama-server's parser knows) via ``--chat-template-file``
(llama-server with ``--jinja``), with the same context, slots and threads. Rounds
alternate the order. Measured per server: the wall time of all loops, TTFT p50/p95 per
turn (request sent to first streamed delta), and prompt tokens computed (the final
chunk's ``timings.prompt_n``: what a server evaluated, after its cache) against prompt
tokens sent (``usage.prompt_tokens``). Prefix sharing is where the gap should be: every
turn's prompt starts with the same few thousand tokens.

    make bench-peers && python bench/agents.py            # writes bench/results/agents.md
    python bench/agents.py --quick                        # 4 loops, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from actors import default_model_path
from bench._common import RESULTS, machine, markdown_table, percentile, write_result
from bench._sse import SseConnection
from bench._systems import _free_port, _wait_http
from bench._tools_run import template_path

PEERS = ROOT / "bench" / ".peers"
SUBJECTS = (
    "weather", "calendar", "email", "files", "search", "maps", "music", "notes", "tasks", "contacts",
    "news", "stocks", "translate", "calculator", "timer", "shopping", "recipes", "flights", "hotels",
    "payments",
)  # fmt: skip


def catalog() -> list[dict[str, Any]]:
    """20 tools, each with a description and a schema of a few parameters."""
    tools = []
    for i, subject in enumerate(SUBJECTS):
        properties = {
            "query": {"type": "string", "description": f"What to look up in {subject}, in plain words."},
            "limit": {"type": "integer", "description": "How many results to return, at most.", "minimum": 1},
            "when": {"type": "string", "description": "A date or time range, ISO 8601, when it matters."},
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"{subject}_lookup",
                    "description": (
                        f"Look things up in the user's {subject} service (tool {i}): returns matching "
                        f"{subject} records with their ids, titles, dates and a short summary of each, "
                        "sorted by relevance. Use it whenever the user asks about their "
                        f"{subject}; prefer precise queries."
                    ),
                    "parameters": {"type": "object", "properties": properties, "required": ["query"]},
                },
            }
        )
    return tools


SYSTEM = (
    "You are a careful personal assistant. You have tools for the user's services. Call a tool "
    "whenever you need data; never invent records. After the tools answer, reply in two sentences."
)
RESULT = json.dumps(
    {
        "records": [
            {"id": f"r{i}", "title": f"record {i}", "summary": "a short summary of this record"}
            for i in range(6)
        ]
    }
)


@dataclass
class Turn:
    ttft_ms: float
    prompt_tokens: int
    computed: int
    valid_call: bool | None  # None: not a tool turn


@dataclass
class Run:
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _scripted_call(loop: int, turn: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The assistant's call after tool turn ``turn`` of loop ``loop``, and its result."""
    call_id = f"call{loop:03d}x{turn}"
    name = f"{SUBJECTS[(loop + turn) % len(SUBJECTS)]}_lookup"
    arguments = json.dumps({"query": f"items for question {loop}, step {turn}", "limit": 5})
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }
    return assistant, {"role": "tool", "tool_call_id": call_id, "content": RESULT}


async def _turn(conn: SseConnection, body: dict[str, Any], tool_turn: bool) -> Turn:
    t0 = time.perf_counter()
    ttft = None
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    prompt_tokens, computed = 0, 0
    async for payload in conn.events("/v1/chat/completions", body):
        if payload == b"[DONE]":
            continue  # read the body to its end: the connection is kept for the next turn
        chunk = json.loads(payload)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if ttft is None and (
                delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
            ):
                ttft = (time.perf_counter() - t0) * 1000.0
            for call in delta.get("tool_calls") or []:
                function, index = call.get("function") or {}, int(call.get("index", 0))
                if function.get("name"):
                    names[index] = function["name"]
                arguments[index] = arguments.get(index, "") + (function.get("arguments") or "")
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
        if chunk.get("timings"):
            computed = chunk["timings"].get("prompt_n", 0)
    valid = None
    if tool_turn:
        try:  # the first call: named, and its arguments a JSON object
            valid = bool(names.get(0)) and isinstance(json.loads(arguments.get(0, "")), dict)
        except ValueError:
            valid = False
    return Turn(
        ttft if ttft is not None else (time.perf_counter() - t0) * 1000.0, prompt_tokens, computed, valid
    )


async def _loop(
    port: int, loop: int, tag: str, args: argparse.Namespace, tools: list[dict[str, Any]], run: Run
) -> None:
    conn = SseConnection(port, timeout_s=args.timeout)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"[{tag}.{loop}] Please check my {SUBJECTS[loop % 20]} and plan my week.",
        },
    ]
    try:
        for turn in range(args.turns + 1):
            tool_turn = turn < args.turns
            body = {
                "model": "bench",
                "messages": messages,
                "tools": tools,
                "tool_choice": "required" if tool_turn else "none",
                "parallel_tool_calls": False,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            run.turns.append(await _turn(conn, body, tool_turn))
            if tool_turn:
                messages += list(_scripted_call(loop, turn))
    except Exception as e:  # counted, and the loop stops
        run.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        await conn.close()


async def _all(port: int, tag: str, args: argparse.Namespace) -> Run:
    run, tools = Run(), catalog()
    t0 = time.perf_counter()
    await asyncio.gather(*(_loop(port, i, tag, args, tools, run) for i in range(args.loops)))
    run.wall_s = time.perf_counter() - t0
    return run


class Server:
    """One server process with the shared flags."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name, self.port = name, _free_port()
        common = [
            "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(self.port),
            "-c", str(args.n_ctx), "-np", str(args.loops),
            "-t", str(args.n_threads), "-tb", str(args.n_threads),
            "-b", "2048", "-ub", "512", "-kvu", "--chat-template-file", str(template_path()),
        ]  # fmt: skip
        if name == "ours":
            command = [str(Path(sys.executable).parent / "llama-cpp-actors"), "serve", *common]
        else:
            command = [os.environ["LLAMA_SERVER_BIN"], *common, "--jinja", "--no-webui"]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(self.port, "/health", self.proc)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def _summary(runs: list[Run]) -> dict[str, float]:
    turns = [t for run in runs for t in run.turns]
    tool_turns = [t for t in turns if t.valid_call is not None]
    sent = sum(t.prompt_tokens for t in turns)
    computed = sum(t.computed for t in turns)
    return {
        "wall": statistics.median(run.wall_s for run in runs),
        "ttft50": percentile([t.ttft_ms for t in turns], 50),
        "ttft95": percentile([t.ttft_ms for t in turns], 95),
        "sent": sent / len(runs),
        "computed": computed / len(runs),
        "valid": sum(1 for t in tool_turns if t.valid_call) / max(len(tool_turns), 1),
        "errors": sum(len(run.errors) for run in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loops", type=int, default=16, help="agent loops at once (and slots)")
    parser.add_argument("--turns", type=int, default=4, help="tool turns per loop (then one answer)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one turn may take")
    parser.add_argument("--n-ctx", type=int, default=16 * 8192)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument(
        "--servers", nargs="+", default=["ours", "llama-server"], choices=["ours", "llama-server"]
    )
    parser.add_argument("--quick", action="store_true", help="4 loops, 2 turns, 1 round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.loops, args.turns, args.rounds = 4, 2, 1
    if "llama-server" in args.servers and not os.environ.get("LLAMA_SERVER_BIN"):
        binary = PEERS / "llama-server"
        if binary.exists():
            os.environ["LLAMA_SERVER_BIN"] = str(binary)
        else:
            print("llama-server: LLAMA_SERVER_BIN is not set (make bench-peers builds it); skipped")
            args.servers = [s for s in args.servers if s != "llama-server"]
    runs: dict[str, list[Run]] = {name: [] for name in args.servers}
    for r in range(args.rounds):
        order = args.servers if r % 2 == 0 else list(reversed(args.servers))
        for name in order:
            server = Server(name, args)
            try:
                run = asyncio.run(_all(server.port, f"{r}.{name}", args))
            finally:
                server.stop()
            runs[name].append(run)
            s = _summary([run])
            print(
                f"round {r + 1}/{args.rounds} {name:12s} wall {run.wall_s:6.1f} s"
                f"  TTFT p50 {s['ttft50']:6.0f} ms  p95 {s['ttft95']:6.0f} ms"
                f"  computed {s['computed']:7.0f} of {s['sent']:7.0f} prompt tokens"
                f"  valid calls {s['valid']:.0%}  errors {s['errors']:.0f}",
                flush=True,
            )
            for error in run.errors[:3]:
                print(f"  error: {error}", flush=True)
    summaries = {name: _summary(r) for name, r in runs.items() if r}
    header = [
        "server",
        "wall s",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "prompt tokens sent",
        "computed",
        "valid calls",
        "errors",
    ]
    rows = [
        [
            name,
            f"{s['wall']:.1f}",
            f"{s['ttft50']:.0f}",
            f"{s['ttft95']:.0f}",
            f"{s['sent']:.0f}",
            f"{s['computed']:.0f}",
            f"{s['valid']:.0%}",
            f"{s['errors']:.0f}",
        ]
        for name, s in summaries.items()
    ]
    text = (
        f"# Agent loops\n\n{machine()}; SmolLM2-135M-Instruct Q4_1 with Qwen 2.5's chat template; "
        f"{args.loops} loops at once, each {args.turns} tool turns (`tool_choice` required) and an answer, "
        f"on a system prompt with a catalog of {len(SUBJECTS)} tools; at most {args.max_tokens} tokens per "
        f"turn, greedy; scripted calls and results between turns, so every server gets the same requests; "
        f"n_ctx={args.n_ctx}, {args.loops} slots, n_threads={args.n_threads}; median wall time of "
        f"{args.rounds} rounds, TTFT and tokens over all turns (tokens per round).\n\n"
        + markdown_table(header, rows)
    )
    if {"ours", "llama-server"} <= summaries.keys():
        ours, peer = summaries["ours"], summaries["llama-server"]
        text += (
            f"\nOurs / llama-server: wall time {ours['wall'] / peer['wall']:.2f}x, TTFT p50 "
            f"{ours['ttft50'] / peer['ttft50']:.2f}x, p95 {ours['ttft95'] / peer['ttft95']:.2f}x, prompt "
            f"tokens computed {ours['computed'] / max(peer['computed'], 1):.2f}x.\n"
        )
    print()
    print(text)
    write_result("agents", text, args.out)


if __name__ == "__main__":
    main()
