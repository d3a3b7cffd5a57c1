"""Fairness: how much one tenant's hostile request slows another tenant's stream.

A stream of greedy tokens runs while a second caller keeps submitting a costly
request: (a) a 1 MB prompt, (b) a JSON Schema with a 20,000-value enum, (c) a
500-value enum (a grammar that parses but costs ~200 ms a token). The number that
matters is the largest gap between two tokens of the running stream; it is compared
with the same stream run alone, in the same process (median over rounds). The goal
is under 2x. Also measured, for information: (d) a 1 MB prompt with ``truncate=True``,
which is admitted: its prefill shares ticks with the stream, ``chunk_size`` tokens a
tick, the documented price of any long prompt.

Over HTTP (``--http``, ``bench/_fairness_http.py``): one ``serve`` process, a victim
client alone and beside an attacker: 2,100 silent connections, a client looping
``/v1/embeddings``, four requests with as many choices as slots, a 3.9 MB text piece.

Run ``python bench/fairness.py`` (``--quick`` for a smoke run, ``--http`` for the HTTP
scenarios too).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/ (whose http.py would
# shadow the standard library's http, which httpx imports).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import queue

from actors import Done, EngineError, Failed, ServerActor, Stream, Token, generate
from bench._common import NO_EOG, RESULTS, machine, markdown_table, median, write_result

Submit = Callable[[Any], None]


def _one_mb(ref: Any) -> None:
    generate(ref, "All work and no play makes Jack a dull boy. " * 23_000, max_tokens=1)


def _one_mb_truncated(ref: Any) -> None:
    generate(ref, "All work and no play makes Jack a dull boy. " * 23_000, max_tokens=1, truncate=True)


def _enum(n: int) -> Submit:
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(n)]}

    def submit(ref: Any) -> None:
        generate(ref, "Pick one:", max_tokens=8, json_schema=schema)

    return submit


SCENARIOS: dict[str, Submit | None] = {
    "alone": None,
    "1 MB prompt": _one_mb,
    "20k-value enum": _enum(20_000),
    "500-value enum": _enum(500),
    "1 MB prompt, truncate=True (admitted)": _one_mb_truncated,
}


def max_gap_ms(ref: Any, max_tokens: int, submit: Submit | None) -> tuple[float, int, int]:
    """The stream's largest inter-token gap (ms), and how many submissions were refused / ran."""
    events: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    counts = {"refused": 0, "ran": 0}

    def hostile() -> None:
        while not stop.is_set():
            try:
                assert submit is not None
                submit(ref)
                counts["ran"] += 1
            except EngineError:
                counts["refused"] += 1

    ref.tell(Stream("Count slowly from one to a thousand:", reply_to=events, max_tokens=max_tokens,
                    temp=0, logit_bias=NO_EOG))  # fmt: skip
    times: list[float] = []
    thread = None
    while True:
        event = events.get(timeout=120)
        if isinstance(event, Token):
            times.append(time.perf_counter())
            if len(times) == 4 and submit is not None:  # the stream is decoding: attack now
                thread = threading.Thread(target=hostile, daemon=True)
                thread.start()
        elif isinstance(event, Done | Failed):
            break
    stop.set()
    if thread is not None:
        thread.join()
    gaps = [(b - a) * 1000.0 for a, b in itertools.pairwise(times[4:])]
    return max(gaps), counts["refused"], counts["ran"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 24 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--http", action="store_true", help="the HTTP scenarios too (a serve process)")
    parser.add_argument("--http-only", action="store_true", help="the HTTP scenarios alone")
    args = parser.parse_args()
    if args.http_only:
        write_result("fairness_http", _http_table(), args.out)
        return
    if args.quick:
        args.max_tokens, args.rounds = 24, 1
    ref = ServerActor.start(n_parallel=4, n_ctx=8192)
    try:
        generate(ref, "Warm up", max_tokens=4)
        gaps: dict[str, list[float]] = {name: [] for name in SCENARIOS}
        tally: dict[str, list[int]] = {name: [0, 0] for name in SCENARIOS}
        for _ in range(args.rounds):  # interleaved, so a noisy moment hits every scenario alike
            for name, submit in SCENARIOS.items():
                gap, refused, ran = max_gap_ms(ref, args.max_tokens, submit)
                gaps[name].append(gap)
                tally[name][0] += refused
                tally[name][1] += ran
    finally:
        ref.stop()
    alone = median(gaps["alone"])
    rows = []
    for name in SCENARIOS:
        ratio = median(gaps[name]) / alone
        goal = "" if name == "alone" or "admitted" in name else ("yes" if ratio < 2.0 else "**no**")
        rows.append([name, f"{median(gaps[name]):.1f}", f"{ratio:.2f}x", str(tally[name][0]),
                     str(tally[name][1]), goal])  # fmt: skip
        print(f"{name:40s} max gap {median(gaps[name]):7.1f} ms  {ratio:5.2f}x alone")
    header = ["while another caller sends", "max gap ms", "vs alone", "refused", "ran", "under 2x"]
    text = (
        f"# Fairness: the largest inter-token gap of a running stream\n\n{machine()}\n\n"
        f"{args.max_tokens} greedy tokens, median over {args.rounds} rounds; a second caller keeps "
        "submitting the request named while the stream decodes.\n\n" + markdown_table(header, rows)
    )
    path = write_result("fairness", text, args.out)
    print(f"wrote {path}")
    if args.http:
        print(f"wrote {write_result('fairness_http', _http_table(), args.out)}")


def _http_table() -> str:
    from bench._fairness_http import run_scenarios

    rows = run_scenarios()
    header = ["while another client sends", "the victim", "alone", "under pressure", "ratio", "goal met"]
    return (
        f"# Fairness over HTTP: what one client's pressure costs another\n\n{machine()}\n\n"
        "`llama-cpp-actors serve -t 1 -c 2048 -np 4`; goals: served within the header timeout (10 s) "
        "and a little; a stream at least half as fast; a 5-token answer within one 256-token choice "
        "(under 30 s); /health under 100 ms.\n\n" + markdown_table(header, rows)
    )


if __name__ == "__main__":
    main()
