"""``Decide`` and its answers, without a model: the question shapes, every hostile
input refused with a reason at construction (in bounded time), and the arithmetic that
turns label log-probabilities into an ``Answer``."""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

import pytest

from actors import Answer, Decide, InvalidRequest, Question
from actors.contract import MAX_LEVELS, MAX_OPTIONS, MAX_QUESTIONS

NOUL = {"type": "noul", "instructions": "Is it about billing?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "refunds", "tech": None}}
SCORE = {"type": "score", "instructions": "How urgent?", "criteria": ["not", "somewhat", "very"]}


def test_the_three_question_types_in_the_system_one_shape() -> None:
    message = Decide({"ticket": "charged twice"}, {"n": NOUL, "c": CHOICE, "s": SCORE})
    assert message.state == '{"ticket": "charged twice"}'  # JSON is read as compact JSON
    n, c, s = message.questions["n"], message.questions["c"], message.questions["s"]
    assert (n.type, n.options, n.descriptions) == ("noul", ("true", "false"), (None, None))
    assert (c.options, c.descriptions) == (("billing", "tech"), ("refunds", None))
    assert (s.options, s.descriptions) == (("0", "1", "2"), ("not", "somewhat", "very"))
    assert list(message.questions) == ["n", "c", "s"]  # the order asked


def test_question_constructors_equal_their_dicts() -> None:
    assert Question.noul("Is it spam?", true="it sells", false=None) == Question.of(
        {"type": "noul", "instructions": "Is it spam?", "criteria": {"true": "it sells"}}
    )
    assert Question.choice("Which?", ["a", "b"]) == Question.of(
        {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}}
    )
    assert Question.score("How?", ["low", "high"]).options == ("0", "1")


def test_a_question_made_directly_is_checked_like_a_dict() -> None:
    unchecked = Question("choice", "Which?", tuple(f"o{i}" for i in range(300)), (None,) * 300)
    with pytest.raises(InvalidRequest, match=f"2 to {MAX_OPTIONS} options"):
        Decide("state", {"q": unchecked})


def test_json_instructions_and_descriptions_are_read_as_json_text() -> None:
    q = Question.of({"type": "score", "instructions": {"ask": "size"}, "criteria": [{"lines": 1}, "big"]})
    assert q.instructions == '{"ask": "size"}' and q.descriptions == ('{"lines": 1}', "big")


@pytest.mark.parametrize(
    ("questions", "needle"),
    [
        ({}, f"1 to {MAX_QUESTIONS} questions"),
        ({f"q{i}": NOUL for i in range(10_000)}, f"1 to {MAX_QUESTIONS} questions"),
        ([NOUL], "dict of names"),
        ({"": NOUL}, "non-empty"),
        ({1: NOUL}, "must be a str"),
        ({"q": "Is it?"}, "must be a dict"),
        ({"q": {"type": "maybe", "instructions": "x"}}, "noul, choice, score"),
        ({"q": {"type": "noul"}}, "instructions is required"),
        ({"q": {"type": "noul", "instructions": "  "}}, "must not be empty"),
        ({"q": {**NOUL, "labels": ["y"]}}, "unknown field 'labels'"),
        ({"q": {**NOUL, "criteria": {"yes": "x"}}}, "true and false"),
        ({"q": {**NOUL, "criteria": "true"}}, "true and false"),
        ({"q": {"type": "choice", "instructions": "x", "criteria": {}}}, f"2 to {MAX_OPTIONS} options"),
        ({"q": {"type": "choice", "instructions": "x", "criteria": {"only": None}}}, "has 1"),
        (
            {"q": {"type": "choice", "instructions": "x", "criteria": {f"o{i}": None for i in range(255)}}},
            f"2 to {MAX_OPTIONS} options",
        ),
        ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", "a"]}}, "'a' twice"),
        ({"q": {"type": "choice", "instructions": "x", "criteria": ["a", ""]}}, "empty option"),
        ({"q": {"type": "choice", "instructions": "x", "criteria": None}}, "map each option"),
        ({"q": {"type": "score", "instructions": "x", "criteria": []}}, f"2 to {MAX_LEVELS} levels"),
        ({"q": {"type": "score", "instructions": "x", "criteria": list("abcdefghijk")}}, "has 11"),
        ({"q": {"type": "score", "instructions": "x", "criteria": {"a": 1}}}, "list of level"),
        ({"q": {"type": "score", "instructions": "x", "criteria": ["a", " "]}}, "empty level"),
        ({"q": {"type": "noul", "instructions": "x" * 70_000}}, "at most 65536"),
        ({"q": {"type": "noul", "instructions": "\ud83d"}}, "lone surrogate"),
    ],
)
def test_hostile_questions_are_refused_with_the_reason(questions: Any, needle: str) -> None:
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match=needle.replace("(", r"\(")):
        Decide("a state", questions)
    assert time.monotonic() - start < 1.0  # bounded: 10,000 questions are refused by count


def _deep(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ("", "must not be empty"),
        (None, "text or a JSON"),
        (42, "text or a JSON"),
        (_deep(100_000), "nests deeper"),
        ({"x": float("nan")}, "not JSON"),
        ({("a", "tuple"): "key"}, "not JSON"),
        ("\udc00", "lone surrogate"),
    ],
)
def test_hostile_states_are_refused(state: Any, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        Decide(state, {"q": NOUL})


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"priority": "high"}, "priority"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"request_id": ""}, "request_id"),
        ({"cache_prompt": "yes"}, "cache_prompt"),
        ({"template_kwargs": {"messages": []}}, "set by the chat formatter"),
        ({"model": ""}, "model"),
    ],
)
def test_hostile_options_are_refused(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        Decide("a state", {"q": NOUL}, **options)


def test_an_unknown_option_names_the_one_meant() -> None:
    with pytest.raises(TypeError, match="did you mean 'template_kwargs'"):
        Decide("s", {"q": NOUL}, chat_template_kwargs={})  # type: ignore[call-arg]


def test_a_decide_pickles_and_is_checked_again() -> None:
    message = Decide({"a": [1, 2]}, {"c": CHOICE, "s": SCORE}, template_kwargs={"x": {"y": 1}}, priority=3)
    assert pickle.loads(pickle.dumps(message)) == message


# -- answers from label log-probabilities ---------------------------------------------


def test_a_choice_answer_is_the_restricted_softmax_and_its_confidence() -> None:
    q = Question.choice("Which?", ["a", "b", "c"])
    lp = [math.log(0.3), math.log(0.1), math.log(0.2)]  # 60% of the mass on the labels
    answer = Answer.read(q, lp)
    assert answer.choice == "a" and answer.type == "choice"
    assert list(answer.probabilities) == ["a", "b", "c"]
    assert answer.probabilities["a"] == pytest.approx(0.5)
    assert answer.probabilities["b"] == pytest.approx(1 / 6)
    assert answer.option_mass == pytest.approx(0.6)
    assert answer.confidence == pytest.approx((3 * 0.5 - 1) / 2)  # (n p_max - 1) / (n - 1)
    assert answer.noul is None and answer.score is None


def test_confidence_is_one_when_certain_and_zero_when_uniform() -> None:
    questions = (Question.choice("x", list("abc")), Question.score("x", list("lmh")), Question.noul("x"))
    for q in questions:
        n = len(q.options)
        assert Answer.read(q, [0.0] + [-math.inf] * (n - 1)).confidence == pytest.approx(1.0)
        assert Answer.read(q, [math.log(0.2)] * n).confidence == pytest.approx(0.0)


def test_a_noul_is_the_probability_it_holds() -> None:
    answer = Answer.read(Question.noul("Is it?"), [math.log(0.6), math.log(0.2)])
    assert answer.noul == pytest.approx(0.75) and answer.probabilities["false"] == pytest.approx(0.25)
    assert answer.confidence == pytest.approx(0.5) and answer.option_mass == pytest.approx(0.8)


def test_a_score_is_the_expected_level_with_the_distance_confidence() -> None:
    q = Question.score("How?", ["0", "1", "2", "3", "4"])
    p = [0.0444, 0.0262, 0.0349, 0.8421, 0.0524]
    answer = Answer.read(q, [math.log(x) for x in p])
    total = sum(p)
    probs = [x / total for x in p]
    assert answer.score == pytest.approx(sum(i * x for i, x in enumerate(probs)))
    spread = sum(abs(i - 2) for i in range(5)) / 5  # a uniform answer's mean distance from the middle
    expected = 1 - sum(x * abs(i - 3) for i, x in enumerate(probs)) / spread
    assert answer.confidence == pytest.approx(expected)
    assert answer.confidence == pytest.approx(0.7725, abs=1e-3)  # llama.cpp's and TypeSafe's worked value


def test_no_mass_on_any_label_is_uniform_with_zero_option_mass() -> None:
    answer = Answer.read(Question.choice("x", ["a", "b"]), [-math.inf, -math.inf])
    assert dict(answer.probabilities) == {"a": 0.5, "b": 0.5}
    assert answer.option_mass == 0.0 and answer.confidence == 0.0 and answer.choice == "a"


def test_ties_go_to_the_first_option() -> None:
    answer = Answer.read(Question.choice("x", ["a", "b", "c"]), [math.log(0.1), math.log(0.4), math.log(0.4)])
    assert answer.choice == "b"
