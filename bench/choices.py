"""n completions of one prompt against one completion of it: prefill and first tokens.

One engine (4 slots), one prompt of about ``--prompt-tokens`` tokens, alternating: a
single completion, then ``n=4`` completions, each with ``cache_prompt=False`` so every
run prefills the prompt from nothing. Measured from the caller: the time to the first
token (of the single completion; of every choice, the slowest counted), and from the
``tick`` signal the prompt tokens computed. Goal (issue 15): the prompt computed once
for all n choices, and every choice's first token within 1.2x of the single one's.

    python bench/choices.py            # writes bench/results/choices.md
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import telemetry
from actors import Done, GetTokenizer, ServerActor, StreamTokens, Token, default_model_path
from bench._common import NO_EOG, RESULTS, machine, markdown_table, write_result


def first_tokens(ref: Any, prompt: list[int], n: int) -> list[float]:
    """Seconds from the tell to the first Token of each choice."""
    events: queue.Queue[Any] = queue.Queue()
    t0 = time.perf_counter()
    ref.tell(
        StreamTokens(
            prompt, reply_to=events, n=n, max_tokens=8, temp=0.8, cache_prompt=False, logit_bias=NO_EOG
        )
    )
    first: dict[int, float] = {}
    ends = 0
    while ends < n:
        event = events.get(timeout=300)
        if isinstance(event, Token):
            first.setdefault(event.index, time.perf_counter() - t0)
        elif isinstance(event, Done):
            ends += 1
        else:
            raise RuntimeError(f"unexpected {event!r}")
    return [first[i] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    ref = ServerActor.start(model_path=default_model_path(), n_parallel=args.n, n_ctx=8192, n_threads=2)
    computed: list[int] = []

    def on_tick(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        computed.append(measurements["prefill_tokens"])

    telemetry.tick.connect(on_tick)
    try:
        tokenizer = ref.ask(GetTokenizer())
        text = " ".join(f"Line {i} of the shared prompt says something plain." for i in range(400))
        prompt = list(tokenizer.tokenize(text))[: args.prompt_tokens]
        first_tokens(ref, prompt, 1)  # warm-up
        single: list[float] = []
        many: list[float] = []
        per_run: dict[int, list[int]] = {1: [], args.n: []}
        for _ in range(args.rounds):
            for n, into in ((1, single), (args.n, many)):
                computed.clear()
                into.append(max(first_tokens(ref, prompt, n)))
                per_run[n].append(sum(computed))
    finally:
        telemetry.tick.disconnect(on_tick)
        ref.stop()
    t1, tn = statistics.median(single) * 1000, statistics.median(many) * 1000
    rows = [
        ["1", f"{t1:.0f}", str(statistics.median(per_run[1]))],
        [str(args.n), f"{tn:.0f}", str(statistics.median(per_run[args.n]))],
    ]
    text = (
        f"# n completions of one prompt\n\n{machine()}; {len(prompt)}-token prompt, {args.n} slots, "
        f"median of {args.rounds} rounds, no prompt cache between runs.\n\n"
        + markdown_table(["n", "first token of the slowest choice, ms", "prompt tokens computed"], rows)
        + f"\nTime to every choice's first token / a single completion's: {tn / t1:.2f}x (goal: at most "
        f"1.2x); prompt tokens computed for n={args.n}: {statistics.median(per_run[args.n])} "
        f"(the prompt: {len(prompt)}).\n"
    )
    print(text)
    write_result("choices", text, args.out)


if __name__ == "__main__":
    main()
