"""A batch strategy of your own: shortest prompt first, with a prefill cap.

A strategy is a pure function of read-only slot views: it returns a ``BatchPlan`` and
the engine checks and applies it. This one decodes every generating slot first (like
``DecodeMaximal``), then spends at most ``max_prefill`` tokens a tick on prompts,
shortest remaining prompt first, so short questions overtake long documents.

Run: ``python examples/custom_strategy.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from actors import Generate, ServerActor
from strategies import BatchPlan, BatchStrategy, SlotPlan, SlotView


class ShortestPromptFirst(BatchStrategy):
    """Decode first; then prefill the shortest remaining prompts, ``max_prefill`` a tick."""

    def __init__(self, max_prefill: int = 256) -> None:
        self.max_prefill = max_prefill

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        decoders = sorted((v for v in slots if v.has_pending_token), key=lambda v: v.arrival)
        entries = [SlotPlan(v.seq_id, decode=True) for v in decoders[:budget]]
        left = min(budget - len(entries), self.max_prefill)
        prompts = sorted((v for v in slots if v.prefill_remaining), key=lambda v: v.prefill_remaining)
        for view in prompts:
            take = min(view.prefill_remaining, chunk_size, left)
            if take <= 0:
                break
            entries.append(SlotPlan(view.seq_id, prefill_tokens=take))
            left -= take
        return BatchPlan(tuple(entries))

    def __repr__(self) -> str:
        return f"ShortestPromptFirst(max_prefill={self.max_prefill})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    ref = ServerActor.start(n_parallel=3, n_ctx=4096, batch_strategy=ShortestPromptFirst(128))
    try:
        long_document = "Here are my notes. " + "The meeting went on and on. " * 120 + "Summary:"
        prompts = [long_document, "What is the capital of Italy? Answer:", "2 + 2 ="]
        futures = [ref.ask(Generate(p, max_tokens=args.max_tokens, temp=0)) for p in prompts]
        for future in futures:
            completion = future.get(timeout=120)
            print(
                f"{completion.prompt_tokens:5d}-token prompt: first token after "
                f"{completion.ttft_ms:6.0f} ms -> {completion.text.strip()[:60]!r}"
            )
    finally:
        ref.stop()


if __name__ == "__main__":
    main()
