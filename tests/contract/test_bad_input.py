"""Every invalid input the engine can receive raises its own error, and the engine serves on."""

from __future__ import annotations

import math
import queue
from collections.abc import Callable
from typing import Any

import pykka
import pytest
from helpers import NO_EOG

from actors import (
    Chat,
    Generate,
    GenerateTokens,
    InvalidRequest,
    Stream,
    StreamTokens,
    generate,
)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


# (what, how to build the message, the error it raises, where: "caller" or "admission")
CASES: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    ("prompt not a str", lambda: Generate(123), InvalidRequest, "caller"),
    ("prompt None", lambda: Generate(None), InvalidRequest, "caller"),
    ("empty prompt", lambda: Generate(""), InvalidRequest, "caller"),
    ("empty tokens", lambda: GenerateTokens([]), InvalidRequest, "caller"),
    ("tokens a str", lambda: GenerateTokens("abc"), InvalidRequest, "caller"),
    ("token id -1", lambda: GenerateTokens([1, -1]), InvalidRequest, "caller"),
    ("token id 10**7", lambda: GenerateTokens([1, 10**7]), InvalidRequest, "admission"),
    ("max_tokens 0", lambda: Generate("hi", max_tokens=0), InvalidRequest, "caller"),
    ("max_tokens a str", lambda: Generate("hi", max_tokens="5"), InvalidRequest, "caller"),
    ("temp NaN", lambda: Generate("hi", temp=math.nan), InvalidRequest, "caller"),
    ("temp inf", lambda: Generate("hi", temp=math.inf), InvalidRequest, "caller"),
    ("temp < 0", lambda: Generate("hi", temp=-0.5), InvalidRequest, "caller"),
    ("top_p inf", lambda: Generate("hi", top_p=math.inf), InvalidRequest, "caller"),
    ("min_p NaN", lambda: Generate("hi", min_p=math.nan), InvalidRequest, "caller"),
    ("top_k < 0", lambda: Generate("hi", top_k=-3), InvalidRequest, "caller"),
    ("seed too big", lambda: Generate("hi", seed=2**40), InvalidRequest, "caller"),
    ("penalty NaN", lambda: Generate("hi", penalty_present=math.nan), InvalidRequest, "caller"),
    ("logit_bias NaN", lambda: Generate("hi", logit_bias={5: math.nan}), InvalidRequest, "caller"),
    ("logit_bias out of vocab", lambda: Generate("hi", logit_bias={10**6: 1.0}), InvalidRequest, "admission"),
    ("1 MB prompt", lambda: Generate("word " * 200_000), InvalidRequest, "admission"),
    ("100,000 stop strings", lambda: Generate("hi", stop=["x"] * 100_000), InvalidRequest, "caller"),
    ("empty stop string", lambda: Generate("hi", stop=[""]), InvalidRequest, "caller"),
    ("64-level schema", lambda: Generate("hi", json_schema=nested_schema(64)), InvalidRequest, "caller"),
    (
        "schema with a bad ref",
        lambda: Generate("hi", json_schema={"$ref": "#/x"}),
        InvalidRequest,
        "admission",
    ),
    (
        "grammar that does not parse",
        lambda: Generate("hi", grammar="root ::= ("),
        InvalidRequest,
        "caller",
    ),
    ("logprobs 100", lambda: Generate("hi", logprobs=100), InvalidRequest, "caller"),
    ("unknown role", lambda: Chat([{"role": "robot", "content": "hi"}]), InvalidRequest, "caller"),
    ("no messages", lambda: Chat([]), InvalidRequest, "caller"),
    (
        "template_kwargs not JSON",
        lambda: Chat([{"role": "user", "content": "hi"}], template_kwargs={"a": object()}),
        InvalidRequest,
        "caller",
    ),
    (
        "template_kwargs naming messages",
        lambda: Chat([{"role": "user", "content": "hi"}], template_kwargs={"messages": []}),
        InvalidRequest,
        "caller",
    ),
    ("deadline 0", lambda: Generate("hi", deadline_s=0), InvalidRequest, "caller"),
    ("priority a float", lambda: Generate("hi", priority=0.5), InvalidRequest, "caller"),
    ("reply_to without put", lambda: Stream("hi", reply_to=[]), InvalidRequest, "caller"),
    ("reply_to None", lambda: StreamTokens([1], reply_to=None), InvalidRequest, "caller"),
    ("unknown option", lambda: Generate("hi", temperature=0.5), TypeError, "caller"),
    ("positional max_tokens", lambda: Generate("hi", 5), TypeError, "caller"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("what", "build", "error", "where"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(
    server: pykka.ActorRef[Any], what: str, build: Callable[[], Any], error: type[BaseException], where: str
) -> None:
    if where == "caller":
        with pytest.raises(error):
            build()
    else:
        message = build()
        with pytest.raises(error):
            server.ask(message)
    completion = generate(server, "Still serving", max_tokens=2, logit_bias=NO_EOG, timeout=60)
    assert completion.generated_tokens == 2


def test_a_stream_with_bad_input_at_admission_gets_failed(server: pykka.ActorRef[Any]) -> None:
    q: queue.Queue[Any] = queue.Queue()
    server.tell(StreamTokens([1, 10**7], reply_to=q))
    failed = q.get(timeout=30)
    assert isinstance(failed.error, InvalidRequest)
