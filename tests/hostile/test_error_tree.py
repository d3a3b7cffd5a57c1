"""Class 14: every error a caller can meet is an EngineError.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hostile_child import (
    Child,
)
from hostile_runner import (
    LONE,
    case,
    check,
)

from actors import (
    Chat,
    Drain,
    EngineError,
    EngineStopped,
    Generate,
    GenerateTokens,
    GetTokenizer,
    InvalidRequest,
    Tokenizer,
)

# -- class 14: every error is an EngineError -------------------------------------------------------

HUGE = [10**309, -(10**309), 10**400, 2**1024, float("1e308") * 10]


@case("c14")
def _the_tokenizer_during_and_after_its_engine_stops(c: Child) -> None:
    ref = c.start(n_parallel=1)
    tokenizer: Tokenizer = ref.ask(GetTokenizer())
    backend = ref.backend
    assert backend is not None
    big = "word " * 200_000
    errors: list[BaseException] = []

    def tokenize() -> None:
        try:
            for _ in range(50):
                tokenizer.tokenize(big)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=tokenize) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    ref.stop(block=True, timeout=10)  # frees the model only once the tokenizers are out
    for thread in threads:
        thread.join(30)
    assert [type(e) for e in errors] == [EngineStopped, EngineStopped], errors
    calls: list[Callable[[], object]] = [
        lambda: tokenizer.tokenize("hi"),
        lambda: tokenizer.detokenize([1, 2]),
        lambda: backend.chat.tokenize_chat([{"role": "user", "content": "hi"}]),
        lambda: backend.sampling.probe_grammar('root ::= "a"', None),
    ]
    for call in calls:
        with pytest.raises(EngineStopped):
            call()


@case("c14")
def _huge_numbers_in_every_option(c: Child) -> None:
    floats = ("temp", "top_p", "min_p", "penalty_repeat", "penalty_freq", "penalty_present", "deadline_s")
    ints = ("max_tokens", "top_k", "seed", "penalty_last_n", "min_tokens", "n_keep", "priority", "logprobs")
    for name in floats:
        for value in HUGE:
            with pytest.raises(InvalidRequest):
                Generate("x", **{name: value})
    for value in HUGE:
        with pytest.raises(InvalidRequest):
            Generate("x", logit_bias={5: value})
        with pytest.raises(InvalidRequest):
            Drain(value)
    for name in ints:
        for value in (10**400, -(10**400), 2**63, 2**64):
            try:
                message = Generate("Count:", **{"max_tokens": 2, name: value})
            except InvalidRequest:
                continue
            # Accepted: then the engine runs it to a defined end or refuses it.
            with contextlib.suppress(EngineError):
                c.complete(c.ref, dataclasses.replace(message, max_tokens=min(message.max_tokens, 4)))
    for value in (10**400, 2**40, 2**31, -1):
        with pytest.raises(InvalidRequest):
            GenerateTokens([1, value])


@case("c14")
def _surrogates_and_junk_at_the_tokenizer(c: Child) -> None:
    tokenizer: Tokenizer = c.ref.ask(GetTokenizer())
    for text in (LONE, f"ok{LONE}", "\udfff", b"bytes", None, 5, ["a"]):
        with pytest.raises(InvalidRequest):
            tokenizer.tokenize(text)  # type: ignore[arg-type]
    for ids in ([10**7], [-1], ["a"], [1.5], [True], [10**400], "abc", [None]):
        with pytest.raises(InvalidRequest):
            tokenizer.detokenize(ids)  # type: ignore[arg-type]
    backend = c.ref.backend
    assert backend is not None
    with pytest.raises(InvalidRequest):
        backend.chat.tokenize_chat([{"role": "user", "content": LONE}])
    assert tokenizer.detokenize(tokenizer.tokenize("Hello")) == "Hello"


@case("c14")
def _detokenize_a_non_iterable(c: Child) -> None:
    tokenizer: Tokenizer = c.ref.ask(GetTokenizer())
    for ids in (None, 5, 1.5):
        with pytest.raises(InvalidRequest):
            tokenizer.detokenize(ids)  # type: ignore[arg-type]


@case("c14")
def _json_values_python_cannot_dump(c: Child) -> None:
    circular: dict[str, Any] = {"type": "object"}
    circular["properties"] = {"self": circular}
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    bad: list[object] = [
        circular,
        {"enum": deep},
        {"enum": {1, 2}},
        {"enum": [math.nan]},
        {"minimum": math.inf},
        {b"type": "string"},
        {("a",): 1},
        {"enum": [object()]},
        {"enum": [Decimal(1)]},
        ["type", "string"],
        "string",
    ]
    for schema in bad:
        with pytest.raises(InvalidRequest):
            Generate("x", json_schema=schema)  # type: ignore[arg-type]
    for schema in (
        {"enum": [10**400]},
        {"type": "integer", "minimum": -(10**300), "maximum": 10**300},
        {1: 2},
    ):
        try:
            message = Generate("JSON:", json_schema=schema, max_tokens=3)  # type: ignore[arg-type]
        except InvalidRequest:
            continue
        with contextlib.suppress(InvalidRequest):
            c.complete(c.ref, message)


@case("c14")
def _stops_messages_and_tokens_of_wrong_shapes(c: Child) -> None:
    stops: list[object] = [
        {"a"},
        (s for s in ["a"]),
        b"abc",
        "",
        "a" * 257,
        [b"x"],
        [None],
        [1],
        ["a"] * 33,
        ["a" * 257],
        [""],
    ]
    for stop in stops:
        with pytest.raises(InvalidRequest):
            Generate("x", stop=stop)  # type: ignore[arg-type]
    assert Generate("x", stop="abc").stop == ("abc",)  # one string is one stop
    chats: list[object] = [
        {"role": "user", "content": "x"},
        [None],
        [{"role": "user"}],
        [{"role": "user", "content": b"x"}],
        [{"role": "user", "content": None}],
        [{"role": None, "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [("user", "x")],
        "user: x",
        [],
    ]
    for messages in chats:
        with pytest.raises(InvalidRequest):
            Chat(messages)  # type: ignore[arg-type]
    tokens: list[object] = [[np.int64(5)], [1.0], [True], (t for t in [1]), {1, 2}, b"\x01", None, [[1]]]
    for ids in tokens:
        with pytest.raises(InvalidRequest):
            GenerateTokens(ids)  # type: ignore[arg-type]
    completion = c.complete(c.ref, GenerateTokens(range(1, 5), max_tokens=2))
    assert completion.prompt_tokens == 4


@case("c14")
def _nul_and_control_characters_are_text(c: Child) -> None:
    odd = [
        "a\x00b\x00",
        "\x00",
        "\r\n\r" * 20,
        "\u202e\u2066\ufeff\ufffe\uffff",
        "\U0010ffff\U000e0001",
        "\x1b[2J",
    ]
    for text in odd:
        assert c.complete(c.ref, Generate(text, max_tokens=2, temp=0)).generated_tokens <= 2
        messages = [{"role": "user", "content": text}]
        assert c.complete(c.ref, Chat(messages, max_tokens=2, temp=0)).generated_tokens <= 2
        assert c.complete(c.ref, Generate("Count:", stop=[text[:256]], max_tokens=2)).generated_tokens <= 2
    tokenizer: Tokenizer = c.ref.ask(GetTokenizer())
    assert tokenizer.detokenize(tokenizer.tokenize("\x00\x00", add_special=False)) == "\x00\x00"


@case("c14")
def _number_types_that_are_not_int_or_float(c: Child) -> None:
    for value in (Decimal("0.5"), Fraction(1, 2), 0.5j, "0.5", np.float32(0.5)):
        with pytest.raises(InvalidRequest):
            Generate("x", temp=value)  # type: ignore[arg-type]
    for value in (np.int64(4), 4.0, "4", Decimal(4)):
        with pytest.raises(InvalidRequest):
            Generate("x", max_tokens=value)  # type: ignore[arg-type]
    # A float subclass is a float: it is used as one.
    completion = c.complete(c.ref, Generate("Hi", temp=np.float64(0.0), max_tokens=2))
    assert completion.generated_tokens <= 2


@case("c14", "penalty-last-n-2**31-1")
def _penalty_last_n_is_bounded(c: Child) -> None:
    c.serves(c.ref)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for last_n in (10**8, 2**31 - 1):
        t0 = time.monotonic()
        with contextlib.suppress(InvalidRequest):
            message = Generate("Story:", max_tokens=4, temp=0.7, penalty_repeat=1.1, penalty_last_n=last_n)
            completion = c.complete(c.ref, message)
            assert completion.stop_reason in ("max_tokens", "eog")
        assert time.monotonic() - t0 < 5
        grown_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak_mb
        assert grown_mb < 200, f"penalty_last_n={last_n}: {grown_mb:.0f} MB more resident memory"


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
