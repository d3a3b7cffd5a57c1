"""Per-tick engine overhead against active slots and prompt length, with fitted slopes.

Overhead is a tick's wall time (tick signal to tick signal while only decode ticks
run) minus its ``eval_ms`` (the ``llama_decode`` call): the Python the engine runs per
tick (planning, batch layout, sampling calls, streaming, telemetry). It must stay flat
in prompt length and grow at most linearly with active slots.

    python bench/scaling.py            # slots 1..32, prompts 128..8000 tokens
    python bench/scaling.py --quick    # a smoke-sized run

Writes ``bench/results/scaling.md`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/ (whose strategies.py
# would shadow the strategies package).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import telemetry
from actors import GenerateTokens, ServerActor
from bench._common import NO_EOG, RESULTS, machine, markdown_table, pyplot, save_figure, write_result


class TickClock:
    """Records (t, eval_ms, decode_tokens, prefill_tokens) per tick, in the engine thread."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float, int, int]] = []
        self.lock = threading.Lock()
        telemetry.tick.connect(self.on_tick, weak=False)

    def on_tick(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.lock:
            self.ticks.append(
                (
                    time.perf_counter(),
                    measurements["eval_ms"],
                    measurements["decode_tokens"],
                    measurements["prefill_tokens"],
                )
            )

    def close(self) -> None:
        telemetry.tick.disconnect(self.on_tick)

    def overhead_ms(self, decode_tokens: int) -> float:
        """Median of (tick interval - eval_ms) over consecutive pure-decode ticks of that size."""
        with self.lock:
            ticks = list(self.ticks)
        samples = [
            (t1 - t0) * 1000.0 - eval1
            for (t0, _e0, d0, p0), (t1, eval1, d1, p1) in itertools.pairwise(ticks)
            if d0 == d1 == decode_tokens and p0 == p1 == 0
        ]
        return statistics.median(samples) if samples else float("nan")


def run(
    n_parallel: int, n_active: int, prompt_tokens: int, max_tokens: int, n_ctx: int, n_threads: int
) -> float:
    clock = TickClock()
    ref = ServerActor.start(n_parallel=n_parallel, n_ctx=n_ctx, n_threads=n_threads)
    try:
        # Token prompts of an exact length; every slot its own, so no prefix reuse.
        futures = [ref.ask(_token_prompt(i, prompt_tokens, max_tokens)) for i in range(n_active)]
        for future in futures:
            future.get(timeout=600)
    finally:
        ref.stop()
        clock.close()
    return clock.overhead_ms(n_active)


def _token_prompt(seed: int, n: int, max_tokens: int) -> GenerateTokens:
    # Ordinary word tokens of SmolLM2's vocabulary (ids 1000..20000), varied per slot.
    tokens = [1000 + (seed * 7919 + i * 104729) % 19000 for i in range(n)]
    return GenerateTokens(tokens, max_tokens=max_tokens, temp=0, logit_bias=NO_EOG)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,2,4,8,16,32")
    parser.add_argument("--prompt-lengths", default="128,512,2048,8000")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="slots 1,2; prompts 64,256; 12 tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.slots, args.prompt_lengths, args.max_tokens = "1,2", "64,256", 12
    slots = [int(x) for x in args.slots.split(",")]
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    print(machine())

    by_slots = []
    for n in slots:
        overhead = run(max(slots), n, 32, args.max_tokens, 8192, args.n_threads)
        by_slots.append(overhead)
        print(f"  {n:3d} active slots, 32-token prompts: {overhead:.3f} ms/tick", flush=True)
    by_length = []
    for length in lengths:
        overhead = run(1, 1, length, args.max_tokens, 8192, args.n_threads)
        by_length.append(overhead)
        print(f"  1 slot, {length:5d}-token prompt: {overhead:.3f} ms/tick", flush=True)

    slot_slope = slope([float(s) for s in slots], by_slots)
    length_slope = slope([x / 1000 for x in lengths], by_length)
    text = (
        f"# Per-tick engine overhead\n\n{machine()}; n_threads={args.n_threads}; overhead = tick "
        f"interval - eval_ms over pure decode ticks (median).\n\n"
        + markdown_table(
            ["active slots", "overhead ms/tick"],
            [[str(s), f"{o:.3f}"] for s, o in zip(slots, by_slots, strict=True)],
        )
        + "\n"
        + markdown_table(
            ["prompt tokens", "overhead ms/tick"],
            [[str(n), f"{o:.3f}"] for n, o in zip(lengths, by_length, strict=True)],
        )
        + f"\nFitted slopes: {slot_slope * 1000:.1f} µs per active slot; "
        f"{length_slope * 1000:.2f} µs per 1,000 prompt tokens.\n"
    )
    print()
    print(text)
    write_result("scaling", text, args.out)
    plt = pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        left.plot(slots, by_slots, marker="o")
        left.set(
            xlabel="active slots",
            ylabel="overhead ms / tick",
            title=f"{slot_slope * 1000:.0f} µs per slot",
        )
        right.plot(lengths, by_length, marker="o")
        right.set(
            xlabel="prompt tokens",
            ylabel="overhead ms / tick",
            title=f"{length_slope * 1000:.1f} µs per 1k tokens",
        )
        right.set_ylim(bottom=0)
        left.set_ylim(bottom=0)
        for ax in (left, right):
            ax.grid(alpha=0.3)
        save_figure(plt, fig, args.out / "scaling.png")


if __name__ == "__main__":
    main()
