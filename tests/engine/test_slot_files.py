"""Slot files on the scripted backend: a slot saved by one engine and restored by another
is reused as a prefix and changes no token; a file of another model, KV layout or adapter,
a damaged or oversized one, and a busy slot are refused with the reason; a session's KV is
found in its slot or in the RAM cache, and erased from both. On the default model, a
restored slot's prefix gives a fresh run's log-probabilities, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_backend import FakeBackend, solo
from helpers import same_numbers
from test_engine_fake import engine, prompt, result, run, submit

from actors import GenerateTokens, GetStats, GetTokenizer
from actors.backend import KvIdentity
from actors.contract import EngineError, EraseSlot, InvalidRequest, RestoreSlot, SaveSlot, SlotFile

pytestmark = pytest.mark.timeout(60)


def filled(backend: FakeBackend | None = None, **config: Any) -> tuple[Any, list[int], int]:
    """An engine that has run one request on a 48-token prompt: the engine, the prompt,
    and the slot that holds it."""
    e = engine(backend or FakeBackend(n_ctx=512), **config)
    system = prompt(5, 48)
    result_of = submit(e, [*system, 3, 4], max_tokens=4)
    run(e)
    result(result_of)
    (slot,) = [s.seq_id for s in e.slots if s.cached]
    return e, system, slot


def test_a_saved_slot_restored_by_another_engine_is_reused_and_changes_no_token(tmp_path: Path) -> None:
    e, system, slot = filled()
    path = str(tmp_path / "slot.bin")
    saved = e.save_slot(SaveSlot(path, slot=slot))
    held = len(e.slots[slot].cached)
    assert isinstance(saved, SlotFile) and saved.slot == slot and saved.n_tokens == held == 50 + 3
    assert saved.n_bytes == Path(path).stat().st_size and saved.ms >= 0

    backend = FakeBackend(n_ctx=512)
    other = engine(backend)
    restored = other.restore_slot(RestoreSlot(path, slot=2))
    assert (restored.slot, restored.n_tokens, restored.n_bytes) == (2, held, saved.n_bytes)
    assert backend.kv.tokens_of(2) == e.slots[slot].cached == other.slots[2].cached
    rows_before = sum(len(rows) for rows in backend.rows.passes)
    asked = [*system, 9, 9, 9]
    got = submit(other, asked, max_tokens=4)
    run(other)
    assert result(got).prefix_cache_tokens == len(system)
    assert sum(len(rows) for rows in backend.rows.passes) - rows_before == 3 + 3  # 3 prompt rows, 3 decodes
    assert list(result(got).token_ids) == solo(backend.model, asked, 4)


def test_a_file_of_another_model_kv_layout_or_adapter_is_refused_and_the_slot_kept(tmp_path: Path) -> None:
    e, _, slot = filled(FakeBackend(n_ctx=512, adapters=["a"]))
    path = str(tmp_path / "slot.bin")
    e.save_slot(SaveSlot(path, slot=slot))
    other, _, kept = filled()
    backend = other.backend
    held = list(other.slots[kept].cached)
    cases = {
        "another model": KvIdentity("another", (1, 1), ("fake:a",)),
        "its KV cache is K f16, V f16, this context's K q8_0, V f16": KvIdentity(
            "fake-model", (8, 1), ("fake:a",)
        ),
        "this server's adapter 0 is another file": KvIdentity("fake-model", (1, 1), ("fake:b",)),
    }
    for reason, identity in cases.items():
        backend.kv_identity = identity  # type: ignore[attr-defined]
        with pytest.raises(InvalidRequest, match=reason):
            other.restore_slot(RestoreSlot(path, slot=kept))
        assert other.slots[kept].cached == held  # a refused file never touches the slot
    # The file's own adapter set is the scope: the base model's KV restores without it.
    e2, _, slot2 = filled()
    e2.save_slot(SaveSlot(path, slot=slot2))
    backend.kv_identity = KvIdentity("fake-model", (1, 1), ())  # type: ignore[attr-defined]
    assert other.restore_slot(RestoreSlot(path)).n_tokens == len(e2.slots[slot2].cached)


def test_a_damaged_oversized_or_foreign_file_is_refused_before_llama_cpp_reads_it(tmp_path: Path) -> None:
    e, _, slot = filled()
    path = tmp_path / "slot.bin"
    e.save_slot(SaveSlot(str(path), slot=slot))
    good = path.read_bytes()

    def refused(data: bytes, reason: str, **config: Any) -> None:
        bad = tmp_path / "bad.bin"
        bad.write_bytes(data)
        with pytest.raises(InvalidRequest, match=reason):
            engine(FakeBackend(n_ctx=512), **config).restore_slot(RestoreSlot(str(bad)))

    refused(good[:-1], "truncated or altered")
    refused(good[:-1] + bytes([good[-1] ^ 1]), "do not match their digest")
    refused(b"GGUF" + good[4:], "not a llama-cpp-actors slot file")
    refused(good, "more than this context's KV can hold", kv_file_max_bytes=16)
    refused(good, r"more than a slot's context \(32\)", n_ctx_per_slot=32)
    with pytest.raises(InvalidRequest, match="no such file"):
        e.restore_slot(RestoreSlot(str(tmp_path / "missing.bin")))
    with pytest.raises(EngineError, match="cannot write the slot file"):
        e.save_slot(SaveSlot(str(tmp_path / "no-such-folder" / "x.bin"), slot=slot))


def test_a_busy_slot_is_refused_and_an_erased_one_is_computed_again(tmp_path: Path) -> None:
    e = engine(FakeBackend(n_ctx=512))
    asked = prompt(7, 40)
    first = submit(e, asked, max_tokens=4)
    e.step()
    (busy,) = [s.seq_id for s in e.slots if s.request is not None]
    path = str(tmp_path / "slot.bin")
    for message in (SaveSlot(path, slot=busy), RestoreSlot(path, slot=busy), EraseSlot(slot=busy)):
        with pytest.raises(InvalidRequest, match=f"slot {busy} is busy"):
            getattr(
                e,
                {"SaveSlot": "save_slot", "RestoreSlot": "restore_slot"}.get(
                    type(message).__name__, "erase_slot"
                ),
            )(message)
    with pytest.raises(InvalidRequest, match="there is no slot 4: this engine has slots 0 to 3"):
        e.erase_slot(EraseSlot(slot=4))
    run(e)
    result(first)
    assert e.erase_slot(EraseSlot(slot=busy)) == 40 + 3
    assert not e.slots[busy].cached and e.backend.kv.pos_max(busy) == -1  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest, match="holds no tokens"):
        e.save_slot(SaveSlot(path, slot=busy))
    again = submit(e, asked, max_tokens=4)
    run(e)
    assert result(again).prefix_cache_tokens == 0


def test_a_session_is_saved_from_the_ram_cache_restored_for_it_and_erased(tmp_path: Path) -> None:
    e = engine(FakeBackend(n_ctx=512), ram_budget_bytes=1 << 20)
    chat = prompt(3, 60)
    first = submit(e, chat, max_tokens=4, session="alice", cache_scope="acme")
    run(e)
    said = list(result(first).token_ids)
    other = submit(e, prompt(9, 40), max_tokens=2)  # its start moves idle caches to RAM
    run(e)
    result(other)
    assert not any(s.session == "alice" and s.cached for s in e.slots)
    path = str(tmp_path / "alice.bin")
    with pytest.raises(InvalidRequest, match="no KV of session 'alice' \\(cache_scope None\\)"):
        e.save_slot(SaveSlot(path, session="alice"))
    saved = e.save_slot(SaveSlot(path, session="alice", cache_scope="acme"))
    assert saved.slot is None and saved.n_tokens == 60 + 3

    backend = FakeBackend(n_ctx=512)
    fresh = engine(backend)
    restored = fresh.restore_slot(RestoreSlot(path))
    assert fresh.slots[restored.slot].session == "alice"  # type: ignore[index]
    nxt = [*chat, *said[:3], 5, 6]  # the next turn: what the slot holds, and more
    turn = submit(fresh, nxt, max_tokens=3, session="alice", cache_scope="acme")
    stranger = submit(fresh, nxt, max_tokens=3)  # another cache scope reuses nothing
    run(fresh)
    assert result(turn).prefix_cache_tokens == 60 + 3
    assert result(stranger).prefix_cache_tokens == 0
    assert list(result(turn).token_ids) == solo(backend.model, nxt, 3)

    assert e.erase_slot(EraseSlot(session="alice", cache_scope="acme")) == 60 + 3
    with pytest.raises(InvalidRequest, match="no KV of session"):
        e.save_slot(SaveSlot(path, session="alice", cache_scope="acme"))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: SaveSlot("x.bin"), "name the slot"),
        (lambda: SaveSlot("x.bin", slot=0, session="s"), "not both"),
        (lambda: SaveSlot("x.bin", slot=0, cache_scope="c"), "cache_scope goes with session"),
        (lambda: SaveSlot("", slot=0), "non-empty"),
        (lambda: SaveSlot("a\x00b", slot=0), "NUL"),
        (lambda: RestoreSlot("x.bin", slot=-1), "slot's index"),
        (lambda: RestoreSlot("x.bin", slot=True), "slot's index"),
        (lambda: EraseSlot(session="s" * 300), "at most 256"),
        (lambda: SaveSlot(b"x.bin", slot=0), "str or a path"),  # type: ignore[arg-type]
    ],
)
def test_the_messages_refuse_bad_fields_in_the_callers_thread(make: Any, reason: str) -> None:
    with pytest.raises(InvalidRequest, match=reason):
        make()


@pytest.mark.timeout(300)  # same_numbers measures this CPU's floor once a session (13 s idle)
def test_on_the_model_a_restored_slot_gives_a_fresh_runs_log_probabilities(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    ref = start_server(n_parallel=2, n_ctx=1024, prompt_cache_ram_mb=0)
    plain = start_server(n_parallel=1, n_ctx=1024, cache_prompt=False)
    tokenizer = ref.ask(GetTokenizer())
    history = tokenizer.tokenize("A long story about a lighthouse keeper and the sea. " * 6)
    ref.ask(GenerateTokens(history, max_tokens=6, temp=0)).get(timeout=60)
    (slot,) = [i for i, s in enumerate(ref.ask(GetStats())["slots"]) if s.kv_tokens]
    path = str(tmp_path / "story.bin")
    saved = ref.ask(SaveSlot(path, slot=slot))
    assert saved.n_tokens == len(history) + 5
    assert ref.ask(EraseSlot(slot=slot)) == saved.n_tokens
    restored = ref.ask(RestoreSlot(path, slot=1 - slot))
    assert (restored.slot, restored.n_tokens, restored.n_bytes) == (1 - slot, saved.n_tokens, saved.n_bytes)
    question = history + tokenizer.tokenize(" What did the keeper see?", add_special=False)
    turn = ref.ask(GenerateTokens(question, max_tokens=12, temp=0, logprobs=3)).get(timeout=60)
    assert turn.prefix_cache_tokens == len(history)
    fresh = plain.ask(GenerateTokens(question, max_tokens=12, temp=0, logprobs=3)).get(timeout=60)
    same_numbers(fresh, turn)  # bit-equal where this CPU's floor is zero
