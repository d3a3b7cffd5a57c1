"""Stream a completion to the terminal as it is generated.

Run: ``python examples/stream.py "Tell me a story"``.
"""

from __future__ import annotations

import argparse
import sys

from actors import ServerActor, stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Tell me a short story about a brave cat.")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()

    chat = f"<|im_start|>user\n{args.prompt}<|im_end|>\n<|im_start|>assistant\n"
    ref = ServerActor.start(n_parallel=1, n_ctx=4096)
    try:
        # Each piece is a whole number of characters; breaking out early cancels.
        for piece in stream(ref, chat, max_tokens=args.max_tokens, temp=0.7, timeout=30):
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
    finally:
        ref.stop()


if __name__ == "__main__":
    main()
