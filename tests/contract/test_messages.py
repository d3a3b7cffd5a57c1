"""Messages check what needs no model in the caller's thread, before anything is sent."""

from __future__ import annotations

import dataclasses
import math
import pickle
import queue
from types import MappingProxyType
from typing import Any

import pytest
from helpers import Opaque

import actors
from actors import (
    Cancel,
    Chat,
    EngineError,
    Generate,
    GenerateTokens,
    InvalidRequest,
    Stream,
    StreamChat,
    StreamTokens,
)


def test_request_ids_are_fresh_and_messages_frozen() -> None:
    a, b = Generate("hi"), Generate("hi")
    assert a.request_id != b.request_id and len(a.request_id) == 32
    assert a.max_tokens == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_tokens = 3  # type: ignore[misc]
    assert Generate("hi", request_id="mine").request_id == "mine"


def test_token_lists_become_tuples() -> None:
    assert GenerateTokens([1, 2, 3]).tokens == (1, 2, 3)


def test_invalid_request_is_a_value_error_and_an_engine_error() -> None:
    assert issubclass(InvalidRequest, ValueError) and issubclass(InvalidRequest, EngineError)


BAD: list[tuple[Any, dict[str, Any]]] = [
    ("", {}),
    (None, {}),
    (b"bytes", {}),
    ("ok", {"max_tokens": 0}),
    ("ok", {"max_tokens": -5}),
    ("ok", {"max_tokens": 1.5}),
    ("ok", {"max_tokens": True}),
    ("ok", {"temp": -0.1}),
    ("ok", {"temp": math.nan}),
    ("ok", {"temp": math.inf}),
    ("ok", {"top_k": -1}),
    ("ok", {"top_k": 2.5}),
    ("ok", {"top_p": 1.5}),
    ("ok", {"top_p": -0.01}),
    ("ok", {"min_p": 2}),
    ("ok", {"seed": -1}),
    ("ok", {"seed": 2**32}),
    ("ok", {"penalty_last_n": -2}),
    ("ok", {"penalty_repeat": 0}),
    ("ok", {"penalty_freq": math.nan}),
    ("ok", {"grammar": ""}),
    ("ok", {"logit_bias": {-1: 1.0}}),
    ("ok", {"logit_bias": {5: math.nan}}),
    ("ok", {"logit_bias": {5: math.inf}}),
    ("ok", {"logit_bias": [1, 2]}),
    ("ok", {"request_id": ""}),
]


@pytest.mark.parametrize(("prompt", "options"), BAD)
def test_bad_generate_raises_in_the_callers_thread(prompt: Any, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        Generate(prompt, **options)


@pytest.mark.parametrize("tokens", [[], [1, -1], [1, 2.0], "abc", [True], None])
def test_bad_token_lists(tokens: Any) -> None:
    with pytest.raises(InvalidRequest):
        GenerateTokens(tokens)
    with pytest.raises(InvalidRequest):
        StreamTokens(tokens, reply_to=queue.Queue())


def test_stream_needs_a_reply_to_with_put() -> None:
    with pytest.raises(InvalidRequest, match="put"):
        Stream("hi", reply_to=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Stream("hi")  # type: ignore[call-arg]


def test_progress_is_a_stream_option_and_a_bool() -> None:
    assert Stream("hi", reply_to=queue.Queue()).progress is False
    assert StreamTokens([1], reply_to=queue.Queue(), progress=True).progress is True
    for bad in (1, "yes", None):
        with pytest.raises(InvalidRequest, match="progress must be a bool"):
            Stream("hi", reply_to=queue.Queue(), progress=bad)
        with pytest.raises(InvalidRequest, match="progress must be a bool"):
            StreamChat([{"role": "user", "content": "hi"}], reply_to=queue.Queue(), progress=bad)
    with pytest.raises(TypeError, match="progress"):
        Generate("hi", progress=True)  # type: ignore[call-arg]


def test_add_generation_prompt_is_a_chat_option_and_a_bool() -> None:
    hi = [{"role": "user", "content": "hi"}]
    assert Chat(hi).add_generation_prompt is True
    assert StreamChat(hi, reply_to=queue.Queue(), add_generation_prompt=False).add_generation_prompt is False
    for bad in (0, "false", None):
        with pytest.raises(InvalidRequest, match="add_generation_prompt must be a bool"):
            Chat(hi, add_generation_prompt=bad)


def test_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="temperature"):
        Generate("hi", temperature=0.5)  # type: ignore[call-arg]


def test_minus_infinity_bias_bans_a_token() -> None:
    assert Generate("hi", logit_bias={5: -math.inf}).logit_bias == {5: -math.inf}


def test_cancel_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Cancel("x").request_id = "y"  # type: ignore[misc]


@pytest.mark.parametrize(
    "options",
    [
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": 1.5},
        {"stop": ""},
        {"stop": b"abc"},
        {"stop": [""]},
        {"stop": ["ok", 3]},
        {"stop": ["x"] * 33},
        {"stop": ["x" * 257]},
        {"min_tokens": -1},
        {"ignore_eos": "yes"},
        {"json_schema": "not a dict"},
        {"json_schema": {"type": "object"}, "grammar": 'root ::= "x"'},
        {"json_schema": {"bad": {1, 2}}},
    ],
    ids=repr,
)
def test_bad_request_features(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        Generate("hi", **options)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        ["user: hi"],
    ],
    ids=repr,
)
def test_bad_chat_messages(messages: Any) -> None:
    with pytest.raises(InvalidRequest):
        Chat(messages)
    with pytest.raises(InvalidRequest):
        StreamChat(messages, reply_to=queue.Queue())


def test_chat_messages_are_frozen_copies() -> None:
    original = [{"role": "user", "content": "hi", "name": "ann", "extra": "ignored"}]
    message = Chat(original)
    original[0]["content"] = "changed"
    assert message.messages[0]["content"] == "hi" and "extra" not in message.messages[0]
    assert message.messages[0]["name"] == "ann"  # OpenAI's field: templates may render it


HI = [{"role": "user", "content": "hi"}]


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_SELF: list[Any] = []
_SELF.append(_SELF)


@pytest.mark.parametrize(
    ("template_kwargs", "match"),
    [
        ("enable_thinking", "must be a dict"),
        ([("a", 1)], "must be a dict"),
        ({1: True}, "not a variable name"),
        ({"": True}, "not a variable name"),
        ({"two words": True}, "not a variable name"),
        ({"x" * 300: True}, "not a variable name"),
        ({"messages": []}, "set by the chat formatter itself"),
        ({"add_generation_prompt": False}, "set by the chat formatter itself"),
        ({"bos_token": "<s>"}, "set by the chat formatter itself"),
        ({"a": math.nan}, "finite number"),
        ({"a": math.inf}, "finite number"),
        ({"a": 2**64}, "64 bits"),
        ({"a": Opaque()}, "JSON value"),
        ({"a": b"bytes"}, "JSON value"),
        ({"a": {1, 2}}, "JSON value"),
        ({"a": {1: "x"}}, "keys are strings"),
        ({"a": "\ud800"}, "lone surrogate"),
        ({"a": "x" * 70_000}, "at most"),
        ({"a": ["x" * 1000] * 100}, "too large"),
        ({"a": list(range(100_000))}, "too large"),
        ({"a": _deep(17)}, "deeper than 16"),
        ({"a": _SELF}, "deeper than 16"),
    ],
    ids=repr,
)
def test_bad_template_kwargs(template_kwargs: Any, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        Chat(HI, template_kwargs=template_kwargs)
    with pytest.raises(InvalidRequest, match=match):
        StreamChat(HI, reply_to=queue.Queue(), template_kwargs=template_kwargs)


def test_template_kwargs_are_frozen_copies_that_pickle() -> None:
    original: dict[str, Any] = {
        "enable_thinking": False,
        "n": 3,
        "x": 0.5,
        "s": "é",
        "l": [1, [None, {"k": ["v"]}]],
    }
    message = Chat(HI, template_kwargs=original)
    original["l"][1][1]["k"].append("changed")
    original["n"] = 4
    kwargs = message.template_kwargs
    assert isinstance(kwargs, MappingProxyType)
    assert dict(kwargs) == {
        "enable_thinking": False, "n": 3, "x": 0.5, "s": "é",
        "l": (1, (None, MappingProxyType({"k": ("v",)}))),
    }  # fmt: skip
    with pytest.raises(TypeError):
        kwargs["n"] = 5  # type: ignore[index]
    # A ServerPool pickles requests to Ray replicas: every nested mapping goes too.
    again = pickle.loads(pickle.dumps(message))
    assert again == message and again.template_kwargs == kwargs
    assert Chat(HI).template_kwargs is None and Chat(HI, template_kwargs={}).template_kwargs == {}
    stream = StreamChat(HI, reply_to=queue.Queue(), template_kwargs={"a": [{"b": 1}]})
    assert stream.template_kwargs == {"a": (MappingProxyType({"b": 1}),)}


def test_a_schema_nested_past_the_recursion_limit_is_refused_not_a_recursion_error() -> None:
    import functools

    from actors import Generate, InvalidRequest

    schema = functools.reduce(lambda inner, _: {"type": "object", "properties": {"a": inner}}, range(400), {})
    with pytest.raises(InvalidRequest, match="nests deeper"):
        Generate("x", json_schema=schema)


# -- names a newcomer brings from elsewhere -------------------------------------------------


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("temperature", "temp"), ("n_predict", "max_tokens"), ("stop_sequences", "stop"),
     ("max_new_tokens", "max_tokens"), ("presence_penalty", "penalty_present"), ("maxtokens", "max_tokens")],
)  # fmt: skip
def test_an_unknown_keyword_names_the_option_it_likely_meant(typo: str, meant: str) -> None:
    messages = {
        Generate: ("hi",), GenerateTokens: ([1, 2],), Stream: ("hi",), StreamTokens: ([1, 2],),
        Chat: ([{"role": "user", "content": "hi"}],), StreamChat: ([{"role": "user", "content": "hi"}],),
    }  # fmt: skip
    for cls, args in messages.items():
        extra = {"reply_to": queue.Queue()} if cls in (Stream, StreamTokens, StreamChat) else {}
        with pytest.raises(TypeError, match=f"not an option of {cls.__name__}\\(\\); did you mean '{meant}'"):
            cls(*args, **{typo: 1}, **extra)
    with pytest.raises(TypeError, match=r"requests\.md"):  # nothing close: where to look
        Generate("hi", zzzz=1)


def test_a_single_stop_string_is_one_stop() -> None:
    message = Generate("hi", stop="\n")
    assert message.stop == ("\n",)
    assert pickle.loads(pickle.dumps(message)).stop == ("\n",)
    assert dataclasses.replace(message, max_tokens=3).stop == ("\n",)


def test_chat_messages_given_as_tokens_point_to_chat() -> None:
    with pytest.raises(InvalidRequest, match=r"use chat\(ref, messages\) or Chat\(messages\)"):
        GenerateTokens([{"role": "user", "content": "hi"}])


def test_public_errors_are_named_by_their_public_path() -> None:
    errors = [getattr(actors, name) for name in actors.__all__ if name.endswith(("Error", "Full", "Request",
              "Stopped", "Timeout", "Exceeded", "Lately", "Long"))]  # fmt: skip
    assert len(errors) == 12
    for error in errors:
        assert issubclass(error, actors.EngineError)
        assert f"{error.__module__}.{error.__qualname__}" == f"actors.{error.__name__}"
        assert pickle.loads(pickle.dumps(error)) is error  # found again by that path
