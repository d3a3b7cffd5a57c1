"""Chat with the model's own template, then ask for JSON, stop strings and logprobs.

Run: ``python examples/chat.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from actors import GetTokenizer, ServerActor, Tokenizer, chat, generate, stream_chat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args()

    ref = ServerActor.start(n_parallel=2, n_ctx=4096)
    try:
        # A two-turn conversation; the second turn reuses the first turn's KV cache.
        messages = [{"role": "user", "content": "Give me one tip for learning to cook."}]
        print("user: Give me one tip for learning to cook.\nassistant: ", end="")
        pieces = []
        for piece in stream_chat(ref, messages, max_tokens=args.max_tokens):
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces.append(piece)
        reply = "".join(pieces)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And a second one?"},
        ]
        second = chat(ref, messages, max_tokens=args.max_tokens)
        print(f"\nuser: And a second one?\nassistant: {second.text}")
        print(f"[second turn reused {second.prefix_cache_tokens} of {second.prompt_tokens} prompt tokens]")

        # Structured output: every completion parses and follows the schema.
        person = chat(
            # Bounded fields (a sampled integer could run on for 120 tokens) and room to end.
            ref,
            [{"role": "user", "content": "Invent a person."}],
            max_tokens=200,
            json_schema=PERSON,
        )
        print("json:", json.loads(person.text))

        # Stop strings: the text ends just before the first match.
        listing = generate(ref, "Shopping list:\n1.", max_tokens=60, temp=0, stop=["\n3."])
        print(f"stop at {listing.stop_string!r}: {listing.text!r}")

        # Log-probabilities of each token and its two likeliest alternatives.
        answer = generate(ref, "The capital of France is", max_tokens=3, temp=0, logprobs=2)
        for entry in answer.logprobs or ():
            alternatives = ", ".join(f"{t.text!r} {t.logprob:.2f}" for t in entry.top)
            print(f"{entry.text!r:>10} {entry.logprob:6.2f}   [{alternatives}]")

        # Tokenize in this thread, without a round trip through the engine.
        tokenizer: Tokenizer = ref.ask(GetTokenizer(), block=True)  # block=True: typed as the answer
        print("tokens:", tokenizer.tokenize("Hello, world!"))
    finally:
        ref.stop()


if __name__ == "__main__":
    main()
