"""Decisions on the default model: the three question types, and the same request's
probabilities on every path (the state computed by the leader, taken from the cache,
beside generation, each question alone, no cache at all), compared as strictly as this
CPU's floor allows; a thinking template is refused at the answer position."""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import cpu_floor

from actors import (
    Answer,
    Decision,
    InvalidRequest,
    PromptTooLong,
    ServerActor,
    Stream,
    adecide,
    decide,
    generate,
)

pytestmark = pytest.mark.timeout(180)

STATE = {
    "ticket": "I was charged twice for order 4411 and I need the second charge refunded today.",
    "customer": {"plan": "pro", "since": 2021},
    "channel": "email",
}
QUESTIONS: dict[str, Any] = {
    "billing": {
        "type": "noul",
        "instructions": "Is this a billing request?",
        "criteria": {"true": "about a charge, payment or refund", "false": "about anything else"},
    },
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {"billing": "payments and refunds", "support": "how-to questions", "engineering": None},
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is this ticket?",
        "criteria": ["can wait", "this week", "today", "right now"],
    },
}


@pytest.fixture(scope="module")
def ref(model_path: str) -> Iterator[Any]:
    server = ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=4096)
    yield server
    server.stop()


def same_answers(expected: Decision, got: Decision) -> None:
    """Equal where this CPU's floor is zero; else each probability within what a logit
    move of the floor allows."""
    floor = cpu_floor()
    assert list(expected.answers) == list(got.answers)
    for name, a in expected.answers.items():
        b = got.answers[name]
        if floor == 0.0:
            assert a == b, name
            continue
        slack = math.expm1(4 * floor)  # a probability moves by at most that factor
        for key, p in a.probabilities.items():
            assert abs(p - b.probabilities[key]) <= slack * max(p, b.probabilities[key]), (name, key)


def test_the_three_question_types_answer_with_probabilities(ref: Any) -> None:
    decision = decide(ref, STATE, QUESTIONS, timeout=120)
    assert list(decision.answers) == list(QUESTIONS)
    noul, team, urgency = (decision.answers[name] for name in QUESTIONS)
    assert noul.type == "noul" and noul.noul == noul.probabilities["true"]
    assert team.type == "choice" and list(team.probabilities) == ["billing", "support", "engineering"]
    assert team.choice == max(team.probabilities, key=lambda k: team.probabilities[k])
    assert urgency.type == "score" and list(urgency.probabilities) == ["0", "1", "2", "3"]
    assert 0.0 <= (urgency.score or 0.0) <= 3.0
    for answer in decision.answers.values():
        assert isinstance(answer, Answer)
        assert math.fsum(answer.probabilities.values()) == pytest.approx(1.0)
        assert 0.0 <= answer.confidence <= 1.0
        assert 0.0 < answer.option_mass <= 1.0  # the model answers with the labels at all
    assert decision.prompt_tokens > 0 and decision.duration_ms > 0


def test_the_same_decision_on_every_path_has_the_same_probabilities(ref: Any) -> None:
    state = {"id": "every-path", **STATE}  # a state no other test cached (from its first line)
    first = decide(ref, state, QUESTIONS, timeout=120)
    cached = decide(ref, state, QUESTIONS, timeout=120)
    assert first.cached_tokens < 40  # at most the template's header was cached
    assert cached.cached_tokens >= cached.prompt_tokens // 2  # the state came from the cache
    same_answers(first, cached)
    private = decide(ref, state, QUESTIONS, cache_prompt=False, timeout=120)
    same_answers(first, private)
    alone = decide(ref, state, {"team": QUESTIONS["team"]}, timeout=120)  # one question: no leader
    assert alone.answers["team"] == private.answers["team"] or cpu_floor() > 0
    # Beside two generations that keep the batch busy.
    events: queue.Queue[Any] = queue.Queue()
    for i in range(2):
        ref.tell(
            Stream(f"Tell a long story about ship {i}.", max_tokens=48, reply_to=events, ignore_eos=True)
        )
    other = {"id": "beside", **STATE}
    beside = decide(ref, other, QUESTIONS, timeout=120)
    alone_too = decide(ref, other, QUESTIONS, cache_prompt=False, timeout=120)
    same_answers(alone_too, beside)


def test_concurrent_decisions_and_the_asyncio_helper(ref: Any) -> None:
    import asyncio

    async def both() -> list[Decision]:
        return list(
            await asyncio.gather(
                adecide(ref, "The printer on floor 3 is on fire.", QUESTIONS, timeout=120),
                adecide(ref, "Can you send me last month's invoice?", QUESTIONS, timeout=120),
            )
        )

    fire, invoice = asyncio.run(both())
    again = decide(ref, "The printer on floor 3 is on fire.", QUESTIONS, timeout=120)
    same_answers(fire, again)
    assert fire.answers != invoice.answers
    text = generate(ref, "Hello", max_tokens=4)  # the engine serves on
    assert text.generated_tokens >= 1


def test_a_state_past_the_context_is_refused(ref: Any) -> None:
    with pytest.raises(PromptTooLong, match=r"the state is 50\d\d tokens: it cannot fit a slot's context"):
        decide(ref, "word " * 5000, QUESTIONS, timeout=60)


def test_a_template_that_thinks_at_the_answer_is_refused(model_path: str) -> None:
    from templates import template

    qwen3 = template("Qwen-Qwen3-0.6B")
    server = ServerActor.start(model_path=model_path, n_parallel=1, n_ctx=2048, chat_template=qwen3)
    try:
        off = decide(server, STATE, QUESTIONS, timeout=120)  # thinking off (the default): it answers
        assert set(off.answers) == set(QUESTIONS)
        with pytest.raises(InvalidRequest, match="leaves the model thinking where the answer is read"):
            decide(server, STATE, QUESTIONS, template_kwargs={"enable_thinking": True}, timeout=60)
    finally:
        server.stop()
    r1 = template("llama-cpp-deepseek-r1")  # opens the thinking in the prompt, always
    server = ServerActor.start(model_path=model_path, n_parallel=1, n_ctx=2048, chat_template=r1)
    try:
        with pytest.raises(InvalidRequest, match="leaves the model thinking where the answer is read"):
            decide(server, STATE, QUESTIONS, timeout=60)
    finally:
        server.stop()
