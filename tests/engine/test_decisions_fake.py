"""Decisions in the engine on the scripted backend: the state prefilled once, every
question's own part in one tick over the shared cells, answers equal to each question's
solo read whatever the cache path, and one outcome for every way a decision ends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pykka
import pytest
from fake_backend import FakeBackend
from test_engine_fake import engine, prompt, result, run, submit

from actors.chat import ReplySpec, ToolGrammar
from actors.contract import (
    Answer,
    Chat,
    Decide,
    Decision,
    EngineError,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    RequestTimeout,
    StreamChat,
)
from actors.engine import Engine, prepare_decision

pytestmark = pytest.mark.timeout(60)

N_VOCAB = 40


def whole_context(tokens: Sequence[int]) -> npt.NDArray[np.float32]:
    """Logits that depend on every token the sequence holds, and where: a question that
    read another's cells, or a state computed twice differently, would show."""
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 31 + t * (i + 7)) % 1_000_003
    logits = np.array([((h >> (t % 11)) + t * h) % 13 / 3.0 for t in range(N_VOCAB)], dtype=np.float32)
    logits[0] = -10.0  # never the end: a generation beside runs to its max_tokens
    return logits


class TextChat:
    """A chat template for the fake model: the user's text between two marker tokens."""

    info = None

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def prompt(
        self, message: Chat | StreamChat, reasoning_format: str = "auto"
    ) -> tuple[list[int], ToolGrammar | None, ReplySpec | None]:
        text = "".join(str(m["content"]) for m in message.messages)
        return self.backend.vocab.tokenize("u" + text + "a"), None, None


def backend(n_seq_max: int = 6, n_ctx: int = 2048, n_batch: int = 256) -> FakeBackend:
    fake = FakeBackend(
        n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_vocab=N_VOCAB, model=whole_context
    )
    fake.chat = TextChat(fake)  # type: ignore[assignment]
    return fake


STATE = "the customer was charged twice and asks for a refund " * 3
QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": "bugs"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high", "now"]},
    "tone": {"type": "choice", "instructions": "Tone?", "criteria": ["calm", "angry", "sad"]},
    "size": {"type": "score", "instructions": "How big?", "criteria": ["small", "large"]},
}


def decide(e: Engine, questions: Any = None, **options: Any) -> pykka.ThreadingFuture[Any]:
    future: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
    message = Decide(STATE, questions or QUESTIONS, **options)
    e.admit_decision(prepare_decision(e.backend, message, e.n_ctx_slot), future)
    return future


def solo_answers(fake: FakeBackend, limit: int, state: str = STATE) -> dict[str, Answer]:
    """Each question read on its own: the fake model over the question's whole prompt."""
    prepared = prepare_decision(fake, Decide(state, QUESTIONS), limit)
    out = {}
    for (name, question), part, reads in zip(
        prepared.message.questions.items(), prepared.questions, prepared.reads, strict=True
    ):
        logits = whole_context(part.prompt).astype(np.float64)
        log_softmax = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
        out[name] = Answer.read(question, [float(log_softmax[ids[0]]) for ids in reads])
    return out


def test_the_state_is_prefilled_once_and_every_question_reads_in_one_tick() -> None:
    fake = backend(n_batch=1024)
    e = engine(fake, chunk_size=1024)
    prepared = prepare_decision(fake, Decide(STATE, QUESTIONS), e.n_ctx_slot)
    assert prepared.leader is not None
    shared = len(prepared.leader.prompt)
    future = decide(e)
    run(e)
    decision: Decision = future.get(timeout=0)
    own = [len(q.prompt) - shared for q in prepared.questions]
    rows = [len(p) for p in fake.rows.passes]
    # One pass computes the state (the leader's prompt), one pass every question's own part.
    assert rows == [shared, sum(own)], rows
    questions_seqs = {seq for seq, _ in fake.rows.passes[1]}
    assert len(questions_seqs) == len(QUESTIONS)
    assert decision.prompt_tokens == shared + sum(own) and decision.cached_tokens == 0
    assert decision.answers == solo_answers(fake, e.n_ctx_slot)
    assert list(decision.answers) == list(QUESTIONS)


def test_the_answers_do_not_depend_on_the_cache_path_or_the_neighbours() -> None:
    fake = backend(n_seq_max=4)  # fewer slots than questions + leader: they take turns
    e = engine(fake)
    expected = solo_answers(fake, e.n_ctx_slot)
    first = decide(e)
    run(e)
    again = decide(e)  # the state is cached now: nothing of it is computed again
    run(e)
    busy = [submit(e, prompt(s, 40), max_tokens=30) for s in range(2)]
    beside = decide(e, request_id="beside")
    private = decide(e, cache_prompt=False)  # no leader, no sharing: each prompt in full
    run(e)
    for future in (first, again, beside, private):
        assert future.get(timeout=0).answers == expected
    assert again.get(timeout=0).cached_tokens >= len(STATE)  # the state came from the cache
    assert private.get(timeout=0).cached_tokens == 0
    for future in busy:
        assert result(future).generated_tokens == 30
    assert not e.state.requests and not e.state.choices and not fake.sampling.live


def test_a_cancelled_decision_ends_once_with_an_error_and_frees_everything() -> None:
    fake = backend(n_seq_max=2)
    e = engine(fake, chunk_size=16)
    future = decide(e, request_id="d")
    e.step()
    e.cancel("d")
    run(e)
    with pytest.raises(EngineError, match="cancelled"):
        future.get(timeout=0)
    assert not e.state.requests and not e.state.choices and not e.state.waiting and not fake.sampling.live


def test_a_decision_past_its_deadline_is_a_timeout() -> None:
    fake = backend(n_seq_max=2)
    e = engine(fake, chunk_size=16)
    future = decide(e, deadline_s=1e-9)
    run(e)
    with pytest.raises(RequestTimeout):
        future.get(timeout=0)
    assert not e.state.requests and not e.state.choices


def test_admission_refuses_what_the_engine_cannot_take() -> None:
    fake = backend(n_seq_max=2)
    e = engine(fake, max_queue=2)
    with pytest.raises(QueueFull):  # a leader and 4 questions: 3 would wait, 2 may
        decide(e)
    decide(e, questions={"q": QUESTIONS["team"]}, request_id="one")
    with pytest.raises(InvalidRequest, match="already in use"):
        decide(e, questions={"q": QUESTIONS["team"]}, request_id="one")
    run(e)


def test_labels_the_model_cannot_read_as_one_token_are_refused() -> None:
    fake = backend()
    # The fake spells every word letter by letter.
    with pytest.raises(InvalidRequest, match="label 'yes' is 3 tokens"):
        prepare_decision(fake, Decide(STATE, {"q": {"type": "noul", "instructions": "Is it?"}}), 512)
    small = FakeBackend(n_vocab=8)  # letters wrap around seven tokens
    small.chat = TextChat(small)  # type: ignore[assignment]
    ten = {"q": {"type": "choice", "instructions": "Which?", "criteria": [f"o{i}" for i in range(10)]}}
    with pytest.raises(InvalidRequest, match="two of its labels are the same token"):
        prepare_decision(small, Decide(STATE, ten), 512)


def test_a_state_past_the_context_is_refused_before_any_question_is_rendered() -> None:
    fake = backend()
    with pytest.raises(PromptTooLong, match="the state is 600 tokens"):
        prepare_decision(fake, Decide("x" * 600, QUESTIONS), 512)
    with pytest.raises(PromptTooLong, match="question 'team'"):
        prepare_decision(fake, Decide("x" * 500, QUESTIONS), 512)
