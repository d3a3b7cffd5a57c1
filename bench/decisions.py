"""One decision of 8 questions against 8 separate chat requests for one token each.

A state of about ``--state-tokens`` tokens and 8 typed questions (noul, choice, score),
three ways, measured from the caller in the same run:

- **decide**: one ``Decide`` (the state prefilled once, every question's own part
  decoded over its shared cells, the answers read from the logits);
- **8 chats, engine**: what a client does without a decisions API: 8 concurrent
  ``Chat`` requests of the same rendered question, ``max_tokens=1``, ``logprobs=20``
  (our engine still shares the state between them: each waits for the first's prefill);
- **8 chats, llama-server**: the same 8 requests to llama-server's
  ``/v1/chat/completions`` (this build has no ``/v1/systemone``), 8 slots, unified KV.

Every round uses a state no cache holds (its first line differs). Reported: the median
wall time and the prompt tokens computed (our ``tick`` signal's prefill tokens;
llama-server's ``timings.prompt_n``).

    python bench/decisions.py            # writes bench/results/decisions.md
    LLAMA_SERVER_BIN=bench/.peers/llama-server python bench/decisions.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import httpx

import telemetry
from actors import Chat, GetTokenizer, Question, ServerActor, decide, default_model_path
from actors.engine._decisions import question_text
from bench._common import RESULTS, machine, markdown_table, write_result
from bench._systems import _free_port, _wait_http

QUESTIONS: dict[str, Any] = {
    "billing": {"type": "noul", "instructions": "Is the ticket about billing?"},
    "outage": {"type": "noul", "instructions": "Does the ticket report an outage?"},
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": ["billing", "support", "engineering"],
    },
    "tone": {
        "type": "choice",
        "instructions": "The customer's tone?",
        "criteria": ["calm", "annoyed", "angry"],
    },
    "product": {
        "type": "choice",
        "instructions": "Which product?",
        "criteria": ["app", "web", "api", "other"],
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent?",
        "criteria": ["low", "medium", "high", "critical"],
    },
    "value": {"type": "score", "instructions": "Customer value?", "criteria": ["free", "pro", "enterprise"]},
}


def state_text(tokenizer: Any, n_tokens: int, round_id: int) -> str:
    """A support history of about ``n_tokens`` tokens whose first line is the round's."""
    lines = [f"Ticket {round_id}: the customer writes about order {round_id * 7 + 3}."]
    i = 0
    while len(tokenizer.tokenize("\n".join(lines))) < n_tokens:
        lines.append(f"Message {i}: the payment page showed an error and the card was charged, order {i}.")
        i += 1
    return "\n".join(lines)


def chat_contents(state: str) -> list[str]:
    return [f"{state}\n\n{question_text(Question.of(q))}" for q in QUESTIONS.values()]


def run_decide(ref: Any, state: str) -> float:
    t0 = time.perf_counter()
    decide(ref, state, QUESTIONS, timeout=600)
    return time.perf_counter() - t0


def run_chats(ref: Any, state: str) -> float:
    futures = []
    t0 = time.perf_counter()
    for content in chat_contents(state):
        message = Chat([{"role": "user", "content": content}], max_tokens=1, logprobs=20, temp=0)
        futures.append(ref.ask(message, block=False))
    for future in futures:
        future.get(timeout=600).get(timeout=600)
    return time.perf_counter() - t0


def run_llama_server(port: int, state: str) -> tuple[float, int]:
    computed = []

    def one(content: str) -> None:
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 20,
            "temperature": 0,
        }
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        response = httpx.post(url, json=body, timeout=600)
        computed.append(response.json()["timings"]["prompt_n"])

    threads = [threading.Thread(target=one, args=(c,)) for c in chat_contents(state)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0, sum(computed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    n_slots, n_ctx = 8, 8 * 2048
    model = default_model_path()
    ref = ServerActor.start(model_path=model, n_parallel=n_slots, n_ctx=n_ctx, n_threads=2)
    computed: list[int] = []

    def on_tick(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        computed.append(measurements["prefill_tokens"])

    telemetry.tick.connect(on_tick)
    times: dict[str, list[float]] = {"decide": [], "chats": [], "llama-server": []}
    tokens: dict[str, list[int]] = {"decide": [], "chats": [], "llama-server": []}
    tokenizer = ref.ask(GetTokenizer())
    # Every state made now, while the tokenizer is loaded: a round's first line is its own.
    states = {r: state_text(tokenizer, args.state_tokens, r) for r in range(-2, 2 * args.rounds)}
    states.update({1000 + r: state_text(tokenizer, args.state_tokens, 1000 + r) for r in range(args.rounds)})
    n_state = len(tokenizer.tokenize(states[0]))
    try:
        run_decide(ref, states[-1])  # warm-up
        for r in range(args.rounds):
            for name, run in (("decide", run_decide), ("chats", run_chats)):
                computed.clear()
                times[name].append(run(ref, states[r * 2 + (name == "chats")]))
                tokens[name].append(sum(computed))
    finally:
        telemetry.tick.disconnect(on_tick)
        ref.stop()
    binary = os.environ.get("LLAMA_SERVER_BIN")
    if binary:
        port = _free_port()
        command = [
            binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
            "-np", str(n_slots), "-b", "2048", "-ub", "512", "-kvu", "-t", "2", "-tb", "2", "--no-webui",
        ]  # fmt: skip
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(port, "/health", proc)
            run_llama_server(port, states[-2])  # warm-up
            for r in range(args.rounds):
                wall, n = run_llama_server(port, states[1000 + r])
                times["llama-server"].append(wall)
                tokens["llama-server"].append(n)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    labels = {
        "decide": "one Decide, 8 questions",
        "chats": "8 chats (max_tokens=1, logprobs), our engine",
        "llama-server": "8 chats (max_tokens=1, logprobs), llama-server",
    }
    rows = []
    base = statistics.median(times["decide"])
    for name, label in labels.items():
        if not times[name]:
            continue
        wall = statistics.median(times[name])
        rows.append(
            [label, f"{wall * 1000:.0f}", str(int(statistics.median(tokens[name]))), f"{wall / base:.2f}x"]
        )
    text = (
        f"# Decisions: one request of 8 questions\n\n{machine()}; a {n_state}-token state, 8 questions "
        f"(3 noul, 3 choice, 2 score), {n_slots} slots, median of {args.rounds} rounds, no cache between "
        "rounds.\n\n" + markdown_table(["how", "wall ms", "prompt tokens computed", "time / decide"], rows)
    )
    print(text)
    write_result("decisions", text, args.out)


if __name__ == "__main__":
    main()
