"""The KV cache as a resource, on the real model: budgets, shifts, preemption, RAM cache, scopes.

Every mechanism is reached by ordinary requests (no test hook); the signals prove it ran.
Greedy outputs under contention are compared with an uncontended run the way
test_greedy.py does: equal (where this CPU's floor is not zero: or first different at a
near-tie of the uncontended run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, same_greedy

from actors import Generate, GenerateTokens, GetStats, GetTokenizer, InvalidRequest, generate

StartServer = Callable[..., pykka.ActorRef[Any]]


def test_a_prompt_over_the_slot_budget_names_both_numbers(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, n_ctx=1024)  # 256 tokens a slot
    tokens = [1000 + i % 5000 for i in range(300)]
    with pytest.raises(InvalidRequest, match=r"300 tokens.*256"):
        ref.ask(GenerateTokens(tokens, max_tokens=4))
    truncated = GenerateTokens(tokens, max_tokens=4, truncate=True, n_keep=10, logit_bias=NO_EOG)
    kept = ref.ask(truncated).get(timeout=60)
    # llama.cpp's rule: keep n_keep, drop whole blocks of (256 - 10) // 2 = 123 tokens.
    assert kept.prompt_tokens == 10 + (300 - 10 - 123)
    assert kept.generated_tokens == 4


def test_context_shift_lets_generation_run_past_the_slot_end(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=1, n_ctx=256)
    completion = generate(ref, "Count: 1, 2, 3,", max_tokens=400, ignore_eos=True, n_keep=4)
    assert completion.generated_tokens == 400 and completion.stop_reason == "max_tokens"
    shifts = [md for _, md in recorder.of("kv_pressure") if md["event"] == "context_shift"]
    assert shifts and all(md["request_id"] == completion.request_id for md in shifts)
    # Shifted KV does not match a fresh prefill: it is never reused.
    assert ref.ask(GetStats())["kv_cells_used"] == 0


def test_without_context_shift_generation_stops_at_the_slot_end(start_server: StartServer) -> None:
    ref = start_server(n_parallel=2, n_ctx=512, context_shift=False)  # 256 a slot
    completion = generate(ref, "Count: 1, 2, 3,", max_tokens=400, ignore_eos=True)
    assert completion.stop_reason == "length"
    assert completion.prompt_tokens + completion.generated_tokens == 256


# Preemption, recomputed or restored from RAM, keeps every output: tests/engine/test_invariance.py.


def conversation(i: int, tokenizer: Any) -> list[int]:
    history = f"Conversation {i}. " + f"Person {i} says something long about topic {i}. " * 12
    return list(tokenizer.tokenize(history))


def test_ram_cache_restores_histories_that_lost_their_slot(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=2, n_ctx=4096, prompt_cache_ram_mb=256)
    plain = start_server(n_parallel=1, n_ctx=4096, cache_prompt=False)
    tokenizer = ref.ask(GetTokenizer())
    histories = [conversation(i, tokenizer) for i in range(4)]  # more conversations than slots
    for history in histories:  # turn one: each history passes through a slot
        ref.ask(GenerateTokens(history, max_tokens=4, temp=0)).get(timeout=120)
    for i, history in enumerate(histories):  # turn two: the same history and a question
        question = history + list(tokenizer.tokenize(f" Question {i}: what next?", add_special=False))
        turn = ref.ask(GenerateTokens(question, max_tokens=16, temp=0, logprobs=2)).get(timeout=120)
        assert turn.prefix_cache_tokens >= len(history) - 2, (i, turn.prefix_cache_tokens, len(history))
        fresh = plain.ask(GenerateTokens(question, max_tokens=16, temp=0, logprobs=2)).get(timeout=120)
        same_greedy(fresh, turn.token_ids)
    events = [md["event"] for _, md in recorder.of("ram_cache")]
    assert "save" in events and "restore" in events
    stats = ref.ask(GetStats())
    assert stats["ram_cache_entries"] > 0 and 0 < stats["ram_cache_bytes"] <= 256 * 1024 * 1024


def test_kv_is_never_reused_across_cache_scopes(start_server: StartServer) -> None:
    ref = start_server(n_parallel=2, n_ctx=4096, prompt_cache_ram_mb=64)
    prompt = "A shared prompt that both tenants happen to send. " * 8
    first = generate(ref, prompt, max_tokens=2, cache_scope="tenant-a")
    assert first.prefix_cache_tokens == 0
    assert generate(ref, prompt, max_tokens=2, cache_scope="tenant-b").prefix_cache_tokens == 0
    assert generate(ref, prompt, max_tokens=2).prefix_cache_tokens == 0  # None is its own pool
    assert generate(ref, prompt, max_tokens=2, cache_scope="tenant-a").prefix_cache_tokens > 0
    # Push tenant-a's KV out of both slots (into RAM), then ask as tenant-c: nothing.
    for filler in ("x " * 60, "y " * 60):
        generate(ref, filler, max_tokens=2, cache_scope="filler")
    assert generate(ref, prompt, max_tokens=2, cache_scope="tenant-c").prefix_cache_tokens == 0
    assert generate(ref, prompt, max_tokens=2, cache_scope="tenant-a").prefix_cache_tokens > 0


def test_a_session_returns_to_the_slot_that_served_it(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=2, n_ctx=2048)
    prompt = "The same opening for two sessions. " * 4
    a = ref.ask(Generate(prompt, max_tokens=8, session="alice", logit_bias=NO_EOG))
    b = ref.ask(Generate(prompt, max_tokens=8, session="bob", logit_bias=NO_EOG))
    a.get(timeout=60)
    b.get(timeout=60)
    slot_of = {md["request_id"]: md["seq_id"] for _, md in recorder.of("start")}
    bob_slot = slot_of[b.get().request_id]
    for _ in range(2):
        again = generate(ref, prompt, max_tokens=2, session="bob")
        assert {md["request_id"]: md["seq_id"] for _, md in recorder.of("start")}[
            again.request_id
        ] == bob_slot


@pytest.mark.parametrize("offload", [True, False])
def test_idle_caches_leave_the_kv_for_the_ram_cache_once_a_request_starts(
    start_server: StartServer, offload: bool
) -> None:
    # llama-server's --cache-idle-slots: a decode attends over every cell in use, so an
    # idle slot's cache is moved to RAM when another request starts; a prefix that the
    # new request shares stays in the KV, and the idle history comes back from RAM.
    recorder = Recorder()
    ref = start_server(n_parallel=4, n_ctx=4096, prompt_cache_ram_mb=64, cache_idle_slots=offload)
    shared = "An opening that two requests share, long enough to count. " * 4
    alone = shared + "Then the first one goes on alone, " * 4
    first = generate(ref, alone, max_tokens=4, temp=0, logprobs=2)
    held = ref.ask(GetStats())["kv_cells_used"]
    second = generate(ref, shared + "The second one.", max_tokens=4, temp=0)
    assert second.prefix_cache_tokens >= first.prompt_tokens // 3  # the shared opening, copied
    stats = ref.ask(GetStats())
    saved = [m["tokens"] for m, md in recorder.of("ram_cache") if md["event"] == "save"]
    if offload:
        # Only the second's cells are left, in llama.cpp's own count too.
        assert stats["kv_cells_used"] == second.prompt_tokens + second.generated_tokens - 1 < held
        assert sum(1 for n in stats["kv_positions"] if n > 0) == 1
        assert saved == [first.prompt_tokens + first.generated_tokens - 1]
    else:
        assert stats["kv_cells_used"] > held and sum(1 for n in stats["kv_positions"] if n > 0) == 2
        assert saved == []
    again = generate(ref, alone, max_tokens=4, temp=0)
    assert again.prefix_cache_tokens == first.prompt_tokens - 1  # from RAM, or its own slot
    same_greedy(first, again.token_ids)
