"""How much n-gram speculation could gain here at all: a replay against this machine's
measured cost of a forward pass.

``bench/speculative.py`` measures what speculation gains; this script asks what it
could gain. It runs the engine without drafts on ``bench/speculative.py``'s workloads at
concurrency 1 (greedy, so each answer is fixed), measures the cost of a forward pass as
a line over its batch size (ticks of a speculating engine whose strategy verifies a
random number of draft tokens) and the prefill's cost per prompt token, then replays
every answer through the engine's own n-gram drafter under several policies, pricing
each simulated tick by the line:

- ``oracle``: each tick verifies exactly the draft tokens that will be accepted (no
  wasted row; no policy can do better with these drafts);
- ``perfect drafter``: every tick verifies ``draft_max`` right tokens (no drafter can
  do better on this cost line);
- ``fixed k``: always the first ``k`` draft tokens;
- ``rule``: the built-in ``strategies.add_drafts`` with the engine's acceptance
  estimate (``Acceptances``, shadows included), as the engine runs it.

Ratios are over the same answers without drafts: "decode" leaves the prompts' prefill
out, "wall" keeps it (what ``bench/speculative.py``'s tok/s sees).

    python bench/speculative_bound.py            # about 3 minutes
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import telemetry
from actors import GetTokenizer, ServerActor, chat
from actors.engine._speculative import Acceptances, DraftWant, NgramDrafter
from bench._common import RESULTS, machine, markdown_table, write_result
from bench.speculative import requests_of
from strategies import BatchPlan, DecodeCost, DecodeMaximal, SlotPlan, SlotState, SlotView, add_drafts

Answer = tuple[list[int], list[int]]  # (prompt tokens, answer tokens)


class _RandomDrafts(DecodeMaximal):
    """Verifies a random number of the draft tokens there are: ticks of every size."""

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def plan_drafts(self, slots: Any, plan: BatchPlan, budget: int, cost: DecodeCost) -> BatchPlan:
        views = {view.seq_id: view for view in slots}
        entries = []
        for e in plan.slots:
            k = self._random.randint(0, min(views[e.seq_id].draft_tokens, budget)) if e.decode else 0
            budget -= k
            entries.append(SlotPlan(e.seq_id, e.decode, e.prefill_tokens, k))
        return BatchPlan(tuple(entries))


def answers(args: argparse.Namespace, workload: str) -> list[Answer]:
    """Each request of ``workload`` alone, greedy, without drafts: prompt and answer tokens."""
    ref = ServerActor.start(n_parallel=1, n_ctx=args.n_ctx, n_threads=args.n_threads)
    try:
        tokenizer = ref.ask(GetTokenizer())
        out = []
        for messages in requests_of(workload, args.requests, "bound"):
            done = chat(ref, messages, max_tokens=args.max_tokens, temp=0)
            text = tokenizer.apply_chat_template(messages)
            out.append((tokenizer.tokenize(text, add_special=False), list(done.token_ids)))
        return out
    finally:
        ref.stop()


def cost_line(args: argparse.Namespace) -> tuple[DecodeCost, float]:
    """The forward pass's cost over its batch size (decode ticks), and prefill ms per token."""
    decode: list[tuple[int, float]] = []
    prefill: list[tuple[int, float]] = []

    def on_tick(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        if measurements["prefill_tokens"] == 0:
            decode.append((measurements["batch_size"], measurements["eval_ms"]))
        elif measurements["decode_tokens"] == 0:
            prefill.append((measurements["prefill_tokens"], measurements["eval_ms"]))

    telemetry.tick.connect(on_tick)
    ref = ServerActor.start(
        n_parallel=1,
        n_ctx=args.n_ctx,
        n_threads=args.n_threads,
        spec_type="ngram",
        batch_strategy=_RandomDrafts(),
    )
    try:
        for messages in requests_of("grounded", 4, "line"):
            chat(ref, messages, max_tokens=args.max_tokens, temp=0)
    finally:
        ref.stop()
        telemetry.tick.disconnect(on_tick)
    n = len(decode)
    mean_x = sum(x for x, _ in decode) / n
    mean_y = sum(y for _, y in decode) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in decode) / sum((x - mean_x) ** 2 for x, _ in decode)
    per_prompt_token = sum(y for _, y in prefill) / sum(x for x, _ in prefill)
    return DecodeCost(mean_y - slope * mean_x, slope), per_prompt_token


def replay(items: list[Answer], policy: str, cost: DecodeCost, draft_max: int) -> float:
    """Simulated decoding ms of every answer under ``policy``."""
    total = 0.0
    for prompt, out in items:
        drafter, owner, acceptances = NgramDrafter(), object(), Acceptances()
        t = 1  # out[0] came with the prefill; out[t - 1] is pending
        while t < len(out):
            limit = min(draft_max, len(out) - t - 1)
            draft = drafter.propose([DraftWant(0, owner, prompt, out[:t], limit)])[0] if limit > 0 else None
            tokens = draft.tokens if draft is not None else []
            right = 0
            while right < len(tokens) and tokens[right] == out[t + right]:
                right += 1
            if policy == "oracle":
                k = right
            elif policy == "perfect":
                k = right = min(draft_max, len(out) - t - 1)
            elif policy.startswith("fixed"):
                k = min(int(policy.split()[1]), len(tokens))
            else:  # the rule
                k = 0
                if tokens and draft is not None:
                    view = SlotView(
                        seq_id=0, state=SlotState.GENERATING, has_pending_token=True, prefill_remaining=0,
                        generated_tokens=t, arrival=0, draft_tokens=len(tokens),
                        draft_acceptance=acceptances.of(draft.kind).rate,
                    )  # fmt: skip
                    plan = add_drafts([view], BatchPlan((SlotPlan(0, True, 0, 0),)), 1 << 20, cost)
                    k = plan.slots[0].draft_tokens
                    if k:
                        acceptances.of(draft.kind).verified(k, min(right, k))
                    else:  # the first token checked against the next one, for free (a shadow)
                        acceptances.of(draft.kind).verified(1, int(right > 0))
            accepted = min(right, k)
            total += cost.batch_ms(1 + k)
            t += accepted + 1
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--draft-max", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for speculative_bound.md")
    args = parser.parse_args()
    cost, prefill_ms = cost_line(args)
    print(
        f"a pass: {cost.fixed_ms:.1f} ms + {cost.per_token_ms:.1f} ms a token; "
        f"a prompt token {prefill_ms:.1f} ms"
    )
    policies = ["oracle", "perfect", "rule", *(f"fixed {k}" for k in (1, 2, 4, 8, 16))]
    rows = []
    for workload in ("grounded", "open"):
        items = answers(args, workload)
        plain = sum(cost.batch_ms(1) * (len(out) - 1) for _, out in items)
        prefill = sum(len(prompt) for prompt, _ in items) * prefill_ms
        for policy in policies:
            ms = replay(items, policy, cost, args.draft_max)
            rows.append(
                [workload, policy, f"{plain / ms:.2f}x", f"{(plain + prefill) / (ms + prefill):.2f}x"]
            )
            print("  ", *rows[-1], flush=True)
    text = (
        f"# Speculative decoding: what n-gram drafts could gain\n\n{machine()}; SmolLM2-135M-Instruct Q4_1, "
        f"n_threads={args.n_threads}; {args.requests} greedy answers per workload of up to {args.max_tokens} "
        f"tokens; a forward pass costs {cost.fixed_ms:.1f} ms + {cost.per_token_ms:.1f} ms a token, a prompt "
        f"token {prefill_ms:.1f} ms. Ratios over the same answers without drafts, at concurrency 1.\n\n"
        + markdown_table(["workload", "policy", "decode", "wall (with the prefill)"], rows)
    )
    print("\n" + text)
    write_result("speculative_bound", text, args.out)


if __name__ == "__main__":
    main()
