"""Decisions over HTTP on the default model: System One's ``/v1/systemone`` in its
shape, OpenAI's ``/v1/decisions`` through the real ``openai`` SDK, the same numbers as
in-process, and every request the model cannot answer a 400 that names why."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from http_server import Running

from actors import ServerActor, decide
from actors.http import HttpSettings

pytestmark = pytest.mark.timeout(180)

STATE = {"message": "My card was charged twice for the same order and I need a refund.", "channel": "support"}
SYSTEMONE = {
    "is_billing": {
        "type": "noul",
        "instructions": "Is this a billing-related request?",
        "criteria": {"true": "a charge, payment, invoice or refund", "false": "anything else"},
    },
    "intent": {
        "type": "choice",
        "instructions": "Which intent best matches the message?",
        "criteria": {"refund": "money back", "cancel": None, "question": "a how-to question"},
    },
    "frustration": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["calm", "annoyed", {"level": "angry", "signs": "caps, threats"}],
    },
}


@pytest.fixture(scope="module")
def running(model_path: str) -> Iterator[Running]:
    with Running.ready(
        HttpSettings(model_ids=("smol",)),
        lambda: ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=4096),
    ) as server:
        yield server


def test_systemone_answers_in_its_shape(running: Running) -> None:
    body = {"model": "smol", "state": STATE, "questions": SYSTEMONE}
    response = httpx.post(running.url + "/v1/systemone", json=body, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["model"] == "smol" and list(out["answers"]) == list(SYSTEMONE)
    assert out["usage"]["input_tokens"] > 0 and out["usage"]["output_tokens"] == 0
    noul, choice, score = (out["answers"][name] for name in SYSTEMONE)
    assert set(noul) == {"type", "noul", "option_mass"} and 0.0 <= noul["noul"] <= 1.0  # Jev's: no confidence
    assert choice["type"] == "choice" and list(choice["probabilities"]) == ["refund", "cancel", "question"]
    assert choice["choice"] == max(choice["probabilities"], key=choice["probabilities"].get)
    assert score["type"] == "score" and list(score["probabilities"]) == ["0", "1", "2"]
    assert score["legend"] == {"0": "calm", "1": "annoyed", "2": {"level": "angry", "signs": "caps, threats"}}
    for answer in (choice, score):
        # Each probability is rounded to 6 decimals on the wire: the sum may be off by half
        # a unit of the last digit per option.
        probs = answer["probabilities"].values()
        assert math.fsum(probs) == pytest.approx(1.0, abs=len(probs) * 5e-7 + 1e-12)
        assert 0.0 <= answer["confidence"] <= 1.0 and 0.0 < answer["option_mass"] <= 1.0
    # The same numbers as the library's, for the same request, to the wire's 6 decimals.
    local = decide(running.engine, STATE, SYSTEMONE, timeout=120)
    assert choice["probabilities"] == {
        k: round(p, 6) for k, p in local.answers["intent"].probabilities.items()
    }
    assert noul["noul"] == round(local.answers["is_billing"].noul or 0.0, 6)
    # What a strict client checks (pydantic-ai's): the score is what the probabilities
    # shown give, and they sum to 1, within the digits shown.
    probabilities = [score["probabilities"][str(i)] for i in range(3)]
    assert abs(math.fsum(probabilities) - 1.0) <= 3 * 5e-7
    assert abs(score["score"] - sum(i * p for i, p in enumerate(probabilities))) <= 4 * 5e-7


def test_decisions_through_the_openai_sdk(running: Running) -> None:
    client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
    decision = client.decisions.create(
        model="smol",
        input="I was charged twice for my order. Please refund me.",
        questions=[
            {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for a refund?"},
            {
                "type": "choice",
                "name": "department",
                "instructions": "Which department should handle this?",
                "choices": [
                    {"value": "billing", "description": "payments"},
                    {"value": "shipping"},
                    {"value": True},
                ],
            },
            {
                "type": "score",
                "instructions": "How severe is it?",
                "levels": [
                    {"label": "low"},
                    {"label": "medium"},
                    {"label": "high", "description": "money lost"},
                ],
            },
        ],
    )
    refund, department, severity = decision.answers
    assert (refund.type, refund.name) == ("predicate", "refund") and 0.0 <= refund.probability <= 1.0
    assert department.type == "choice" and [p.value for p in department.probabilities] == [
        "billing",
        "shipping",
        True,
    ]
    assert department.choice in ("billing", "shipping", True)
    assert severity.type == "score" and severity.name is None
    assert [(p.value, p.label) for p in severity.probabilities] == [(0, "low"), (1, "medium"), (2, "high")]
    assert 0.0 <= severity.score <= 2.0 and 0.0 <= severity.confidence <= 1.0
    assert decision.usage.input_tokens > 0 and decision.usage.output_tokens == 0
    assert decision.usage.total_tokens == decision.usage.input_tokens


def test_message_items_are_a_state(running: Running) -> None:
    body = {
        "model": "smol",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Where is my parcel?"}]},
            {"role": "assistant", "content": "It ships tomorrow."},
            {"type": "input_json", "role": "user", "content": [{"type": "input_json", "data": {"order": 7}}]},
        ],
        "questions": [{"type": "predicate", "instructions": "Was the question answered?"}],
    }
    response = httpx.post(running.url + "/v1/decisions", json=body, timeout=120)
    assert response.status_code == 400 and "unknown type 'input_json'" in response.text
    del body["input"][2]["type"]
    response = httpx.post(running.url + "/v1/decisions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["answers"][0]["type"] == "predicate"


CHOICE = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}}


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/systemone", {"questions": {"q": CHOICE}}, "'state' is required"),
        ("/v1/systemone", {"state": "s", "questions": [CHOICE]}, "object of names"),
        ("/v1/systemone", {"state": 3, "questions": {"q": CHOICE}}, "text or a JSON"),
        ("/v1/systemone", {"state": "s", "questions": {f"q{i}": CHOICE for i in range(10_000)}}, "1 to 64"),
        (
            "/v1/systemone",
            {"state": "s", "questions": {"q": {**CHOICE, "criteria": {f"o{i}": None for i in range(255)}}}},
            "2 to 26 options",
        ),
        ("/v1/systemone", {"state": "s", "questions": {"q": {**CHOICE, "criteria": {}}}}, "2 to 26 options"),
        (
            "/v1/systemone",
            {"state": "word " * 5000, "questions": {"q": CHOICE}},
            "cannot fit a slot's context",
        ),
        (
            "/v1/systemone",
            {"state": "s", "questions": {"q": CHOICE}, "chat_template_kwargs": []},
            "template_kwargs",
        ),
        (
            "/v1/systemone",
            {
                "state": "s",
                "questions": {"q": {"type": "noul", "instructions": "x", "criteria": {"maybe": 1}}},
            },
            "true and false",
        ),
        ("/v1/decisions", {"questions": []}, "'input' is required"),
        ("/v1/decisions", {"input": "s", "questions": []}, "1 to 64"),
        (
            "/v1/decisions",
            {"input": "s", "questions": [{"type": "vote", "instructions": "x"}]},
            "predicate, choice",
        ),
        (
            "/v1/decisions",
            {
                "input": "s",
                "questions": [
                    {"type": "choice", "instructions": "x", "choices": [{"value": "true"}, {"value": True}]}
                ],
            },
            "given twice",
        ),
        (
            "/v1/decisions",
            {
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}],
                "questions": [],
            },
            "text only",
        ),
    ],
)
def test_what_cannot_be_answered_is_a_400_naming_why(
    running: Running, path: str, body: dict[str, Any], needle: str
) -> None:
    response = httpx.post(running.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
    assert httpx.get(running.url + "/health", timeout=10).status_code == 200
