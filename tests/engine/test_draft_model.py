"""The draft-model drafter's bookkeeping against a fake draft context that keeps
llama.cpp's rules (unified KV cells, ``seq_cp`` shares cells, a pass without room
computes nothing and returns 1, positions of a sequence must follow on): prefixes are
shared across slots, sequences of requests that left are evicted first, catch-up is
shared fairly, positions stay below the draft model's training context, a refused
trim starts over, and a draft that cannot grow says so. The "model" predicts from every
token its sequence holds, so a wrong copy or a gap shows up as a wrong draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from fake_backend import FakeKv

from actors.engine._draft_model import ModelDrafter
from actors.engine._speculative import DraftWant

EOG = 3


def model(tokens: Sequence[int]) -> int:
    """The fake model's greedy next token after ``tokens``."""
    return (sum(tokens) * 31 + len(tokens)) % 50 + 10


class FakeDraftContext(FakeKv):
    """A draft context with ``n_ctx`` cells shared by all sequences, as llama.cpp's
    unified KV cache (the KV bookkeeping is ``tests/fake_backend.py``'s), whose model
    predicts :func:`model`'s token with confidence ``p``."""

    def __init__(self, n_ctx: int = 512, n_batch: int = 128, n_ctx_train: int = 0, hidden: int = 0) -> None:
        super().__init__(n_ctx, n_seq_max=1 << 30)
        self.n_batch, self.n_ctx_train = n_batch, n_ctx_train
        self.hidden = hidden  # cells llama.cpp keeps that the drafter cannot know of
        self.tokens = np.zeros(n_batch, dtype=np.int32)
        self.pos = np.zeros(n_batch, dtype=np.int32)
        self.seq_ids = np.zeros(n_batch, dtype=np.int32)
        self.logits = np.zeros(n_batch, dtype=np.int8)
        self.eog_ids = frozenset({EOG})
        self._out: dict[int, int] = {}  # batch row -> predicted token
        self.fed = 0  # tokens decoded in all
        self.refuse_trim = False
        self.predict = model
        self.p = 1.0

    # The backend's parts (``actors.backend.Backend``) are this one object.
    @property
    def rows(self) -> FakeDraftContext:
        return self

    @property
    def kv(self) -> FakeDraftContext:
        return self

    sampling = vocab = rows

    def decode(self, start: int, end: int) -> int:
        n = end - start
        assert start == 0 and 0 < n <= self.n_batch, "llama.cpp aborts on a batch over n_batch"
        if n > self.n_ctx - self.hidden - self.used:
            return 1
        rows = list(range(n))
        expect: dict[int, int] = {}
        for row in rows:  # llama.cpp refuses a batch whose positions do not follow on
            seq = int(self.seq_ids[row])
            p = expect.get(seq, max(self.held(seq), default=-1) + 1)
            assert int(self.pos[row]) == p, f"seq {seq}: position {int(self.pos[row])}, expected {p}"
            expect[seq] = p + 1
        self._out = {}
        for row in rows:
            seq = int(self.seq_ids[row])
            self.add(seq, int(self.pos[row]), int(self.tokens[row]))
            if self.logits[row]:
                self._out[row] = self.predict(self.tokens_of(seq))
        self.fed += n
        return 0

    def top_token(self, row: int) -> tuple[int, float]:
        return self._out[row], self.p  # KeyError: a row without logits (llama.cpp aborts)

    def trim(self, seq_id: int, keep: int) -> bool:
        if self.refuse_trim:
            return False
        return super().trim(seq_id, keep)

    def close(self) -> None:
        pass


def drafter(context: FakeDraftContext, n_ctx_slot: int = 1024, **options: Any) -> ModelDrafter:
    return ModelDrafter(context, n_ctx_slot, **options)  # type: ignore[arg-type]


def truth(tokens: Sequence[int], n: int) -> list[int]:
    """The fake model's greedy continuation of ``tokens``, ``n`` tokens."""
    out: list[int] = []
    for _ in range(n):
        out.append(model([*tokens, *out]))
    return out


def want(seq_id: int, owner: object, prompt: list[int], generated: list[int], limit: int) -> DraftWant:
    return DraftWant(seq_id, owner, prompt, generated, limit)


SYSTEM = [(7 * i) % 40 + 11 for i in range(200)]  # a long shared system prompt


def test_slots_share_the_prefix_another_sequence_holds() -> None:
    # 300 cells: one copy of the 200-token prompt and four suffixes fit; two copies do not.
    context = FakeDraftContext(n_ctx=300, n_batch=256)
    d = drafter(context)
    owners = [object() for _ in range(4)]
    prompts = [[*SYSTEM, 40 + i, 41 + i] for i in range(4)]
    [first] = d.propose([want(0, owners[0], prompts[0], [12], 4)])
    assert first.tokens == truth([*prompts[0], 12], 4)
    drafts = d.propose([want(i, owners[i], prompts[i], [12], 4) for i in range(1, 4)])
    for i, draft in enumerate(drafts, 1):
        assert draft.tokens == truth([*prompts[i], 12], 4)
    assert d.n_failures == d.n_evicted == 0
    assert context.used < 300 and d.cells_used == context.used  # a shared cell counts once


def test_sequences_of_requests_that_left_are_evicted_first() -> None:
    context = FakeDraftContext(n_ctx=300, n_batch=256)
    d = drafter(context)
    a, b, c = object(), object(), object()
    pa = [(3 * i) % 40 + 11 for i in range(120)]
    pb = [(5 * i) % 40 + 11 for i in range(120)]
    pc = [(9 * i) % 40 + 13 for i in range(120)]
    d.propose([want(0, a, pa, [12], 2), want(1, b, pb, [12], 2)])
    d.retain({1: b})  # a left slot 0; b still generates in slot 1
    d.propose([want(1, b, pb, [12, 20], 2)])
    # c needs 121 cells: a's sequence (free to go) makes the room; b's stays.
    [got] = d.propose([want(2, c, pc, [12], 2)])
    assert got.tokens == truth([*pc, 12], 2)
    assert d.n_failures == 0 and d.n_evicted == 1 and d.n_passes == 2 + 2 + 2  # none failed
    assert not context.held(0) and context.held(1)
    assert d.cells_used == context.used
    [again] = d.propose([want(1, b, pb, [12, 20, 30], 3)])
    assert again.tokens == truth([*pb, 12, 20, 30], 3)


def test_least_recently_used_live_sequences_make_room_before_all_start_over() -> None:
    context = FakeDraftContext(n_ctx=300, n_batch=256)
    d = drafter(context)
    owners = [object() for _ in range(3)]
    prompts = [[(k * i) % 40 + 11 + k for i in range(120)] for k in (3, 5, 9)]
    d.propose([want(0, owners[0], prompts[0], [12], 2)])
    d.propose([want(1, owners[1], prompts[1], [12], 2)])
    [got] = d.propose([want(2, owners[2], prompts[2], [12], 2)])  # slot 0's is the oldest
    assert got.tokens == truth([*prompts[2], 12], 2)
    assert d.n_failures == 0 and d.n_evicted == 1 and not context.held(0)
    assert d.cells_used == context.used
    # Slot 0's request catches up again (evicting slot 1's, now the oldest).
    [back] = d.propose([want(0, owners[0], prompts[0], [12, 20], 2)])
    assert back.tokens == truth([*prompts[0], 12, 20], 2)
    assert d.n_failures == 0


def test_a_sessions_next_turn_keeps_the_conversation_it_shares() -> None:
    context = FakeDraftContext(n_ctx=1024, n_batch=512)
    d = drafter(context)
    turn1, turn2 = object(), object()
    d.propose([want(0, turn1, SYSTEM, [12, 13, 14], 2)])
    d.retain({})
    before = context.fed
    prompt2 = [*SYSTEM, 12, 13, 14, 50, 51]
    [got] = d.propose([want(0, turn2, prompt2, [15], 3)])
    assert got.tokens == truth([*prompt2, 15], 3)
    # The new turn's own tokens (and the draft), never the 200-token conversation again.
    assert context.fed - before <= 5 + 3


def test_a_long_new_prompt_catches_up_over_ticks_and_starves_no_other_slot() -> None:
    context = FakeDraftContext(n_ctx=2048, n_batch=64)
    d = drafter(context, chunk_size=32)
    owners = [object() for _ in range(4)]
    short = [[20 + i, 21, 22] for i in range(4)]
    d.propose([want(i, owners[i], short[i], [12], 1) for i in range(1, 4)])
    long_prompt = [(11 * i) % 40 + 11 for i in range(200)]
    generated = [[12] for _ in range(4)]
    for tick in range(12):
        for g in generated:
            g.append(tick % 7 + 12)
        wants = [want(0, owners[0], long_prompt, generated[0], 1)]
        wants += [want(i, owners[i], short[i], generated[i], 1) for i in range(1, 4)]
        drafts = d.propose(wants)
        for i in range(1, 4):  # the short ones draft every tick
            assert drafts[i].tokens == truth([*short[i], *generated[i]], 1)
        if drafts[0].tokens:
            assert tick >= 200 // 32 - 1
            assert drafts[0].tokens == truth([*long_prompt, *generated[0]], 1)
            break
    else:
        raise AssertionError("the long prompt never caught up")
    assert d.n_failures == 0


def test_no_draft_reaches_past_the_draft_models_training_context(caplog: pytest.LogCaptureFixture) -> None:
    context = FakeDraftContext(n_ctx=512, n_batch=128, n_ctx_train=40)
    d = drafter(context)
    assert "trained on 40 positions" in caplog.text  # said once, at load
    owner = object()
    prompt = list(range(11, 47))  # 36 tokens
    [near] = d.propose([want(0, owner, prompt, [12, 13], 16)])  # 38 known
    assert near.tokens == truth([*prompt, 12, 13], 3) and near.room == 3
    assert max(context.held(0)) < 40
    [past] = d.propose([want(0, owner, prompt, [12, 13, 14, 15, 16], 16)])  # 41 known
    assert past.tokens == [] and not context.held(0)


def test_a_refused_trim_starts_the_sequence_over() -> None:
    context = FakeDraftContext()
    d = drafter(context)
    owner = object()
    prompt = list(range(11, 31))
    [first] = d.propose([want(0, owner, prompt, [12], 4)])
    context.refuse_trim = True  # a recurrent model's memory refuses partial removal
    # The request went on differently from the draft: the draft tokens must go.
    generated = [12, first.tokens[0], (first.tokens[1] + 1) % 50 + 10]
    [second] = d.propose([want(0, owner, prompt, generated, 4)])
    assert second.tokens == truth([*prompt, *generated], 4)


def test_a_draft_that_stopped_at_its_first_token_has_no_room_to_grow() -> None:
    context = FakeDraftContext()
    context.predict = lambda tokens: EOG
    d = drafter(context)
    [draft] = d.propose([want(0, object(), [11, 12, 13], [14], 1)])
    assert draft.tokens == [EOG] and draft.room == 1
    context.predict = model
    [going] = d.propose([want(1, object(), [11, 12, 13], [15], 1)])
    assert going.tokens == truth([11, 12, 13, 15], 1) and going.room is not None and going.room > 1


def test_an_unsure_first_token_leaves_no_draft_and_no_room() -> None:
    context = FakeDraftContext()
    context.p = 0.2
    d = drafter(context, p_min=0.5)
    [draft] = d.propose([want(0, object(), [11, 12, 13], [14], 1)])
    assert draft.tokens == [] and draft.room == 0


def test_a_pass_llama_cpp_finds_no_room_for_evicts_more_and_is_tried_once_more() -> None:
    # 40 cells the drafter does not know of: its count says the pass fits, llama.cpp says
    # no room (1, nothing computed); the oldest sequence goes and the pass is run again.
    context = FakeDraftContext(n_ctx=300, n_batch=256, hidden=40)
    d = drafter(context)
    owners = [object() for _ in range(3)]
    prompts = [[(k * i) % 40 + 11 + k for i in range(90)] for k in (3, 5, 9)]
    for i in range(3):
        [got] = d.propose([want(i, owners[i], prompts[i], [12], 2)])
        assert got.tokens == truth([*prompts[i], 12], 2)
    assert d.n_passes == 3 * 2 + 1  # the third's catch-up twice
    assert d.n_failures == 0 and d.n_evicted == 1 and not context.held(0)
    assert d.cells_used == context.used


def test_requests_that_start_together_write_their_shared_prefix_once() -> None:
    # Three choices of one 200-token prompt start drafting in the same tick: one feeds
    # the prompt, the others wait a tick and copy it.
    context = FakeDraftContext(n_ctx=512, n_batch=512)
    d = drafter(context)
    owners = [object() for _ in range(3)]
    first = d.propose([want(i, owners[i], SYSTEM, [12 + i], 2) for i in range(3)])
    assert first[0].tokens == truth([*SYSTEM, 12], 2)
    assert first[1].tokens == first[2].tokens == []  # waiting for the copy
    second = d.propose([want(i, owners[i], SYSTEM, [12 + i, 20], 2) for i in range(3)])
    for i, draft in enumerate(second):
        assert draft.tokens == truth([*SYSTEM, 12 + i, 20], 2)
    assert context.used < 200 + 3 * 8 and d.cells_used == context.used
    assert d.n_failures == 0


def test_live_sequences_that_cannot_all_fit_keep_the_oldest_drafting() -> None:
    # Three requests whose contexts cannot all fit 300 cells: the oldest keep drafting,
    # the newest waits (its sequence gives its cells back), nobody starts over.
    context = FakeDraftContext(n_ctx=300, n_batch=256)
    d = drafter(context)
    owners = [object() for _ in range(3)]
    prompts = [[(k * i) % 40 + 11 + k for i in range(120)] for k in (3, 5, 9)]
    generated: list[list[int]] = [[12], [12], [12]]
    for tick in range(6):
        drafts = d.propose([want(i, owners[i], prompts[i], generated[i], 2) for i in range(3)])
        for i in (0, 1):
            if tick:  # the first tick shared the rows among all three
                assert drafts[i].tokens == truth([*prompts[i], *generated[i]], 2), (tick, i)
        assert d.cells_used == context.used <= 300
        for g in generated:
            g.append(tick % 5 + 13)
    assert d.n_failures == 0
