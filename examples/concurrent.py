"""Eight caller threads share one engine; compare with a lock around ``llama_cpp.Llama``.

Every caller asks for the same number of tokens (end-of-generation tokens are banned
on both sides, so the work is equal). Prints the per-tick decode batch sizes the
engine reached, aggregate tokens/s of both set-ups measured in this run, and the ratio.

Run: ``python examples/concurrent.py`` (``--threads``, ``--max-tokens``, ``--n-threads``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import telemetry
from actors import ServerActor, default_model_path, generate

PROMPTS = [
    "Once upon a time, a dragon",
    "The history of the printing press",
    "Ten tips for a good night's sleep:",
    "Dear diary, today I",
    "The recipe for a perfect pancake",
    "In the year 3000, cities",
    "A letter to my younger self:",
    "The rules of chess are",
]


def run_threads(n: int, work: Any) -> float:
    """Run ``work(i)`` in ``n`` threads at once; returns the wall time in seconds."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - t0


def engine_tokens_per_s(n_callers: int, max_tokens: int, n_threads: int) -> tuple[float, list[int]]:
    decode_batches: list[int] = []

    def on_tick(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        decode_batches.append(measurements["decode_tokens"])

    telemetry.tick.connect(on_tick)
    ref = ServerActor.start(n_parallel=n_callers, n_ctx=4096, n_threads=n_threads)
    try:
        eog = {0: float("-inf"), 2: float("-inf"), 4: float("-inf")}
        generated = [0] * n_callers

        def call(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            completion = generate(ref, prompt, max_tokens=max_tokens, temp=0, logit_bias=eog)
            generated[i] = completion.generated_tokens

        wall = run_threads(n_callers, call)
        return sum(generated) / wall, decode_batches
    finally:
        ref.stop()
        telemetry.tick.disconnect(on_tick)


def locked_llama_tokens_per_s(n_callers: int, max_tokens: int, n_threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(default_model_path(), n_ctx=4096, n_threads=n_threads, verbose=False)
    lock = threading.Lock()
    generated = [0] * n_callers

    def call(i: int) -> None:
        prompt = llm.tokenize(PROMPTS[i % len(PROMPTS)].encode(), add_bos=True, special=True)
        with lock:  # what users do today: one request at a time
            for n, _token in enumerate(llm.generate(prompt, temp=0.0), start=1):
                if n == max_tokens:  # EOG does not stop it: the same work as the engine
                    break
        generated[i] = max_tokens

    wall = run_threads(n_callers, call)
    return sum(generated) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=8, help="concurrent callers")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-threads", type=int, default=None, help="llama.cpp threads, both sides")
    args = parser.parse_args()
    from actors.backend._options import default_n_threads

    n_threads = args.n_threads or default_n_threads()
    print(f"{args.threads} callers x {args.max_tokens} tokens, n_threads={n_threads}")
    engine_tps, batches = engine_tokens_per_s(args.threads, args.max_tokens, n_threads)
    locked_tps = locked_llama_tokens_per_s(args.threads, args.max_tokens, n_threads)
    decode_ticks = [b for b in batches if b]
    print(
        f"engine: {engine_tps:6.1f} tokens/s; decode batch per tick: max {max(decode_ticks)}, "
        f"median {statistics.median(decode_ticks):.0f}, over {len(decode_ticks)} ticks"
    )
    print(f"Llama behind a lock: {locked_tps:6.1f} tokens/s")
    print(f"ratio engine / locked Llama: {engine_tps / locked_tps:.2f}x")


if __name__ == "__main__":
    main()
