"""Generate one completion on the default model and print it.

Run: ``python examples/generate.py`` (``make demo`` does).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import telemetry
from actors import GetStats, ServerActor, generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="Once upon a time, in a quiet village by the sea,")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()

    drawn = [-1]

    def show_progress(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        done = int(measurements["progress"] * 30)
        if measurements["load_ms"] is not None:
            sys.stderr.write(f"\rloading [{'#' * 30}] loaded in {measurements['load_ms']:.0f} ms\n")
        elif done != drawn[0]:
            drawn[0] = done
            sys.stderr.write(f"\rloading [{'#' * done}{'.' * (30 - done)}]")

    telemetry.model_load.connect(show_progress)  # a progress bar while a big model loads
    ref = ServerActor.start(n_parallel=2, n_ctx=4096)
    try:
        completion = generate(ref, args.prompt, max_tokens=args.max_tokens, temp=0.7, timeout=120)
        print(args.prompt + completion.text)
        print(
            f"\n[{completion.generated_tokens} tokens, stop: {completion.stop_reason}, "
            f"first token after {completion.ttft_ms:.0f} ms, "
            f"{completion.generated_tokens / (completion.duration_ms / 1000):.0f} tokens/s]"
        )
        print(ref.ask(GetStats()))
    finally:
        ref.stop()


if __name__ == "__main__":
    main()
