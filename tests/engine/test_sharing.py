"""Cross-slot prefix sharing on the real model: a prefix another slot holds is copied
(``seq_cp``), never computed again; shared cells are counted once; and a sharer that
ends, is cancelled, shifts or is preempted never changes another sharer's output.

Greedy outputs are compared with an engine that shares nothing (``helpers.same_greedy``):
strictly, where this CPU's floor is zero.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, greedy_references, same_greedy, wait_until

from actors import Cancel, Completion, Done, Generate, GetStats, GetTokenizer, InvalidRequest, Stream, Token

StartServer = Callable[..., pykka.ActorRef[Any]]

SYSTEM = "You are a careful assistant who answers in full sentences and checks each fact twice. " * 12
# The references for prompt(i) are made this long once, and cut for each test.
LONGEST = 120
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?", "Count to five."]


def prompt(i: int) -> str:
    return f"{SYSTEM}\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"


def shared_tokens(ref: pykka.ActorRef[Any], a: str, b: str) -> int:
    tokenizer = ref.ask(GetTokenizer())
    ta, tb = tokenizer.tokenize(a), tokenizer.tokenize(b)
    return next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))


def first_token(ref: pykka.ActorRef[Any], text: str, max_tokens: int) -> tuple[str, queue.Queue[Any]]:
    """Start a stream and wait for its first token (its slot is busy from here)."""
    events: queue.Queue[Any] = queue.Queue()
    message = Stream(text, reply_to=events, max_tokens=max_tokens, temp=0, logit_bias=NO_EOG)
    ref.tell(message)
    assert isinstance(events.get(timeout=120), Token)
    return message.request_id, events


def finish(events: queue.Queue[Any]) -> Completion:
    while True:
        event = events.get(timeout=240)
        if isinstance(event, Done):
            return event.completion
        assert isinstance(event, Token), event


def test_a_prefix_another_slot_holds_is_copied_and_its_cells_counted_once(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=4, n_ctx=4096)
    a = ref.ask(Generate(prompt(0), max_tokens=8, temp=0, logit_bias=NO_EOG)).get(timeout=120)
    shared = shared_tokens(ref, prompt(0), prompt(1))
    assert shared > 150
    b = ref.ask(Generate(prompt(1), max_tokens=8, temp=0, logit_bias=NO_EOG)).get(timeout=120)
    assert b.prefix_cache_tokens == shared
    # Only the prompt past the shared prefix was computed for b.
    b_ticks = [m for m, md in recorder.of("tick") if m["prefill_tokens"]][1:]
    assert sum(m["prefill_tokens"] for m in b_ticks) == b.prompt_tokens - shared
    # a's slot kept its whole cache (b took another slot); the shared cells count once.
    stats = ref.ask(GetStats())
    held = sorted(s.kv_tokens for s in stats["slots"] if s.kv_tokens)
    assert held == sorted([a.prompt_tokens + 7, b.prompt_tokens + 7])
    assert stats["kv_cells_used"] == sum(held) - shared


@pytest.mark.slow
def test_sharing_from_busy_slots_gives_the_output_of_sharing_nothing(start_server: StartServer) -> None:
    prompts = [prompt(i) for i in range(4)]
    expected = greedy_references(start_server, prompts, 24, at_least=LONGEST)
    recorder = Recorder()
    ref = start_server(n_parallel=4, n_ctx=4096)
    _, events = first_token(ref, prompts[0], 24)  # generating: a donor while it runs
    futures = [ref.ask(Generate(p, max_tokens=24, temp=0, logit_bias=NO_EOG)) for p in prompts[1:]]
    got = [finish(events)] + [f.get(timeout=240) for f in futures]
    shared = shared_tokens(ref, prompts[0], prompts[1])
    assert all(c.prefix_cache_tokens >= shared for c in got[1:])
    matched = [same_greedy(e, c.token_ids) for e, c in zip(expected, got, strict=True)]
    assert sum(matched) >= 4 * 24 // 2
    # While all four ran, the shared prefix was held once, not four times.
    saved = [sum(s.kv_tokens for s in md["slots"]) - m["kv_cells_used"] for m, md in recorder.of("tick")]
    assert max(saved) >= 3 * shared


@pytest.mark.parametrize("which", ["donor", "sharer"])
def test_cancelling_one_sharer_leaves_the_other_intact(start_server: StartServer, which: str) -> None:
    expected = greedy_references(start_server, [prompt(0), prompt(1)], 48, at_least=LONGEST)
    ref = start_server(n_parallel=2, n_ctx=4096)
    donor_id, donor_events = first_token(ref, prompt(0), 48)
    sharer_id, sharer_events = first_token(ref, prompt(1), 48)
    cancelled, survivor, events = (
        (donor_id, 1, sharer_events) if which == "donor" else (sharer_id, 0, donor_events)
    )
    ref.tell(Cancel(cancelled))
    got = finish(events)
    assert got.generated_tokens == 48
    assert same_greedy(expected[survivor], got.token_ids) >= 24
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 0)


def test_a_sharer_that_shifts_leaves_the_donor_intact(start_server: StartServer) -> None:
    # Slots of 256 positions: each shifts (n_keep 0, half dropped) with the shared
    # prefix partly in the moved half, so it copies its cells out first.
    options = {"n_ctx_per_slot": 256, "n_ctx": 2048}
    max_tokens = 120
    expected = greedy_references(start_server, [prompt(0), prompt(1)], max_tokens, **options)
    recorder = Recorder()
    ref = start_server(n_parallel=2, **options)
    _, donor_events = first_token(ref, prompt(0), max_tokens)
    sharer = ref.ask(Generate(prompt(1), max_tokens=max_tokens, temp=0, logit_bias=NO_EOG))
    got = [finish(donor_events), sharer.get(timeout=240)]
    assert got[1].prefix_cache_tokens >= shared_tokens(ref, prompt(0), prompt(1))
    assert [md["event"] for _, md in recorder.of("kv_pressure")].count("context_shift") >= 2
    for e, c in zip(expected, got, strict=True):
        assert c.generated_tokens == max_tokens
        assert same_greedy(e, c.token_ids) >= 60


def test_preempting_sharers_under_kv_pressure_keeps_every_output(start_server: StartServer) -> None:
    prompts = [prompt(i) for i in range(4)]
    expected = greedy_references(start_server, prompts, LONGEST)
    recorder = Recorder()
    # Four slots of up to 512 positions, 512 cells: even sharing the prefix, they cannot all fit.
    tight = start_server(n_parallel=4, n_ctx=512, n_ctx_per_slot=512)
    futures = [tight.ask(Generate(p, max_tokens=LONGEST, temp=0, logit_bias=NO_EOG)) for p in prompts]
    got = [f.get(timeout=300) for f in futures]
    assert "preempt" in [md["event"] for _, md in recorder.of("kv_pressure")]
    assert all(c.generated_tokens == LONGEST for c in got)
    assert sum(same_greedy(e, c.token_ids) for e, c in zip(expected, got, strict=True)) >= 4 * LONGEST // 2


def test_no_prefix_is_shared_across_cache_scopes(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, n_ctx=4096)
    _, events = first_token(ref, prompt(0), 40)  # scope None, generating
    other = ref.ask(Generate(prompt(1), max_tokens=4, cache_scope="tenant-b")).get(timeout=120)
    assert other.prefix_cache_tokens == 0
    same = ref.ask(Generate(prompt(1), max_tokens=4, cache_scope="tenant-b")).get(timeout=120)
    assert same.prefix_cache_tokens > 0  # its own scope's cache is reused
    finish(events)
    assert (
        ref.ask(Generate(prompt(2), max_tokens=4, cache_scope="tenant-c"))
        .get(timeout=120)
        .prefix_cache_tokens
        == 0
    )


def test_cache_prompt_false_reuses_nothing_and_leaves_nothing(start_server: StartServer) -> None:
    ref = start_server(n_parallel=2, n_ctx=4096)
    first = ref.ask(Generate(prompt(0), max_tokens=4)).get(timeout=120)
    used = ref.ask(GetStats())["kv_cells_used"]
    private = ref.ask(Generate(prompt(0), max_tokens=4, cache_prompt=False)).get(timeout=120)
    assert private.prefix_cache_tokens == 0
    # Its cells were freed when it ended, and the other slot's cache is untouched.
    assert ref.ask(GetStats())["kv_cells_used"] == used
    again = ref.ask(Generate(prompt(0), max_tokens=4)).get(timeout=120)
    assert again.prefix_cache_tokens == first.prompt_tokens - 1
    with pytest.raises(InvalidRequest, match="cache_prompt must be a bool"):
        ref.ask(Generate("x", cache_prompt="no"))  # type: ignore[arg-type]


def test_sharing_off_reuses_only_a_slots_own_cache(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, n_ctx=4096, prefix_sharing=False)
    _, events = first_token(ref, prompt(0), 40)
    other = ref.ask(Generate(prompt(1), max_tokens=4)).get(timeout=120)
    assert other.prefix_cache_tokens == 0  # the prefix is in a busy slot: not taken
    finish(events)


def test_a_burst_on_one_prefix_computes_it_once(start_server: StartServer) -> None:
    document = "Document: " + " ".join(f"Clause {i} binds party {i % 7} to rule {i % 11}." for i in range(16))
    prompts = [f"{document}\nQuestion {i}: {QUESTIONS[i % 4]}\nAnswer:" for i in range(8)]
    computed = {}
    for sharing in (True, False):
        recorder = Recorder()
        ref = start_server(n_parallel=4, n_ctx=8192, prefix_sharing=sharing)
        futures = [ref.ask(Generate(p, max_tokens=4, temp=0)) for p in prompts]  # all at once
        got = [f.get(timeout=300) for f in futures]
        computed[sharing] = sum(m["prefill_tokens"] for m, _ in recorder.of("tick"))
        shared = shared_tokens(ref, prompts[0], prompts[1])
        ref.stop()
    assert shared > 150
    unique = shared + sum(c.prompt_tokens - shared for c in got)
    # The first request prefills the document; the others wait for it, then copy it.
    assert computed[True] <= 1.1 * unique
    assert computed[False] >= 4 * shared  # without sharing each slot computes it


def test_a_freed_slot_takes_the_next_request_of_its_session_first(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=1, n_ctx=2048)
    first = ref.ask(Generate("Alice asks about apples.", max_tokens=24, session="alice", logit_bias=NO_EOG))
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 1)
    bob = ref.ask(Generate("Bob asks about boats.", max_tokens=2, session="bob"))
    alice = ref.ask(Generate("Alice asks about apples. And pears?", max_tokens=2, session="alice"))
    low = ref.ask(Generate("Alice, later.", max_tokens=2, session="alice", priority=5))
    for f in (first, bob, alice, low):
        f.get(timeout=120)
    order = [md["request_id"] for _, md in recorder.of("start")]
    ids = [f.get().request_id for f in (first, alice, bob, low)]
    assert order == ids  # alice's second turn before bob (same priority), never before priority


def test_a_sharer_that_fails_leaves_the_other_intact(start_server: StartServer) -> None:
    from actors.backend._faults import faults

    expected = greedy_references(start_server, [prompt(0), prompt(1)], 40, at_least=LONGEST)
    ref = start_server(n_parallel=2, n_ctx=4096)
    calls = {"n": 0}

    def fail_one_sample(row: int) -> None:
        calls["n"] += 1
        if calls["n"] == 12:  # both are generating, sharing the prefix: one of them fails
            raise RuntimeError("injected sampler failure")

    faults.sample = fail_one_sample
    try:
        futures = [
            ref.ask(Generate(p, max_tokens=40, temp=0, logit_bias=NO_EOG)) for p in (prompt(0), prompt(1))
        ]
        outcomes: list[Any] = []
        for f in futures:
            try:
                outcomes.append(f.get(timeout=240))
            except Exception as e:
                outcomes.append(e)
    finally:
        faults.reset()
    failed = [i for i, o in enumerate(outcomes) if not isinstance(o, Completion)]
    assert len(failed) == 1 and "injected" in str(outcomes[failed[0]])
    survivor = 1 - failed[0]
    assert outcomes[survivor].prefix_cache_tokens > 0 or survivor == 0
    assert same_greedy(expected[survivor], outcomes[survivor].token_ids) >= 20


def test_a_history_restored_from_ram_takes_a_donors_cells_for_the_shared_prefix(
    start_server: StartServer,
) -> None:
    # The idle donor stays in the KV (cache_idle_slots would move it to RAM once the
    # restored request starts, and then no cell would be shared to count).
    ref = start_server(n_parallel=2, n_ctx=4096, prompt_cache_ram_mb=256, cache_idle_slots=False)
    recorder = Recorder()

    def ask(text: str) -> Completion:
        return ref.ask(Generate(text, max_tokens=8, temp=0, logit_bias=NO_EOG)).get(timeout=120)

    a = ask(prompt(0))  # slot 0
    ask(prompt(1))  # slot 1, copying the system prompt from slot 0
    ask(prompt(2))  # slot 0 again (least recently used): a's history goes to RAM
    follow_up = f"{prompt(0)}{a.text}\nQuestion 9: And why?\nAnswer:"
    expected = greedy_references(start_server, [follow_up], 8)[0]
    again = ask(follow_up)  # a's history comes back from RAM into slot 1
    assert "restore" in [md["event"] for _, md in recorder.of("ram_cache")]
    assert again.prefix_cache_tokens > a.prompt_tokens
    assert same_greedy(expected, again.token_ids) >= 4
    # The restored copy of the system prompt was swapped for the cells slot 0 holds.
    stats = ref.ask(GetStats())
    held = [s.kv_tokens for s in stats["slots"]]
    assert stats["kv_cells_used"] <= sum(held) - shared_tokens(ref, prompt(0), prompt(2))
