"""Properties: the message constructors construct or refuse (in this process, no
model), and a real engine admits or refuses what they construct (in a child).

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import queue
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hostile_child import (
    OBJECT_A,
    X7,
    YES_NO,
    Child,
)
from hostile_runner import (
    LONE,
    case,
    check,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import (
    Cancel,
    Chat,
    Drain,
    EngineError,
    Generate,
    GenerateTokens,
    InvalidRequest,
    Stream,
    StreamChat,
    StreamTokens,
)
from actors.contract._checks import ROLES

# -- properties: constructors and a real engine ----------------------------------------------------

HASHABLE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.sampled_from([LONE, 10**400, -(10**309), 2**31, 2**63, ("a", 1)]),
)
SCALARS = st.one_of(
    HASHABLE,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(),
    st.decimals(allow_nan=False),
    st.fractions(),
    st.builds(object),
    st.sampled_from([np.int64(3), np.float32(0.5), np.float64("nan"), np.bool_(True), math.inf, -0.0]),
    st.sampled_from(["", " ", "x" * 300, "\x00", "<|im_start|>", f"a{LONE}"]),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(HASHABLE, inner, max_size=4),
        st.frozensets(HASHABLE, max_size=3),
    ),
    max_leaves=8,
)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(-2, 600),
    "request_id": st.text(max_size=300),
    "logit_bias": st.dictionaries(st.integers(-2, 60_000), st.floats() | st.just(-math.inf), max_size=5),
    "temp": st.floats(-1, 5),
    "top_k": st.integers(-5, 100),
    "top_p": st.floats(-0.5, 1.5),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 2**33),
    "penalty_last_n": st.integers(-3, 4096),
    "penalty_repeat": st.floats(-1, 3),
    "penalty_freq": st.floats(-3, 3),
    "penalty_present": st.floats(-3, 3),
    "grammar": st.sampled_from(["", "root ::= (", YES_NO, X7, "root ::= [a-z]+", f'root ::= "{LONE}"']),
    "json_schema": st.sampled_from(
        [{}, {"type": "object"}, OBJECT_A, {"type": "boolean"}, {"enum": ["a", "b"]}, {"$ref": "#/x"}]
    ),
    "stop": st.lists(st.text(max_size=5), max_size=4),
    "min_tokens": st.integers(-1, 40),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(-1, 25),
    "cache_scope": st.text(max_size=10),
    "session": st.text(max_size=10),
    "truncate": st.booleans(),
    "n_keep": st.integers(-1, 600),
    "deadline_s": st.floats(-1, 10),
    "priority": st.integers(-3, 3),
    "parse_special": st.booleans(),
}
OPTIONS = [name for name in PLAUSIBLE if name != "parse_special"]
CHAT = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from([*sorted(ROLES), "tool", LONE]), "content": st.text(max_size=30)}
    ),
    max_size=4,
)
PROMPTS: dict[type[Any], st.SearchStrategy[Any]] = {
    Generate: st.text(max_size=40),
    Stream: st.text(max_size=40),
    GenerateTokens: st.lists(st.integers(-2, 60_000), max_size=8),
    StreamTokens: st.lists(st.integers(-2, 60_000), max_size=8),
    Chat: CHAT,
    StreamChat: CHAT,
}
STREAMS = (Stream, StreamTokens, StreamChat)


# Values the constructors accept, many of them refused at admission (token ids and
# logit_bias ids past the vocabulary, a schema with a bad $ref) or dead ends.
VALID: dict[str, st.SearchStrategy[Any]] = {
    **PLAUSIBLE,
    "temp": st.sampled_from([0, 0.7, 1.5, 1e-7]) | st.floats(0, 3),
    "top_k": st.integers(0, 100),
    "top_p": st.floats(0, 1),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32 - 2),
    "penalty_last_n": st.integers(-1, 4096),
    "penalty_repeat": st.floats(0.5, 2),
    "grammar": st.sampled_from([YES_NO, X7, "root ::= [a-z]+", 'root ::= "a" root | "b"']),
    "logit_bias": st.dictionaries(
        st.integers(0, 52_000), st.floats(-50, 50) | st.just(-math.inf), max_size=5
    ),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "min_tokens": st.integers(0, 40),
    "logprobs": st.integers(0, 20),
    "n_keep": st.integers(0, 600),
    "deadline_s": st.floats(0.001, 10),
}
TEXT_PROMPTS = st.text(min_size=1, max_size=40) | st.text(min_size=1, max_size=40) | st.just("word " * 3000)
VALID_PROMPTS: dict[type[Any], st.SearchStrategy[Any]] = {
    Generate: TEXT_PROMPTS,
    Stream: TEXT_PROMPTS,
    GenerateTokens: st.lists(st.integers(0, 52_000), min_size=1, max_size=8),
    StreamTokens: st.lists(st.integers(0, 52_000), min_size=1, max_size=8),
    Chat: st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(sorted(ROLES)), "content": st.text(max_size=30)}),
        min_size=1,
        max_size=4,
    ),
}
VALID_PROMPTS[StreamChat] = VALID_PROMPTS[Chat]


def _options(
    names: list[str], junk_share: float, values: dict[str, st.SearchStrategy[Any]] = PLAUSIBLE
) -> st.SearchStrategy[dict[str, Any]]:
    """Some of ``names`` set, each to one of ``values`` or (about ``junk_share``) to junk."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=6))
        # Percentages: hypothesis draws floats near 0 far more often than near 1.
        junk = draw(st.lists(st.integers(0, 99), min_size=len(chosen), max_size=len(chosen)))
        return {
            n: draw(JUNK if j < junk_share * 100 else values[n]) for n, j in zip(chosen, junk, strict=True)
        }

    return build()


def _check_constructed(message: Any) -> None:
    """What a constructed message guarantees: plain, checked values of the right types."""
    assert type(message.request_id) is str and 0 < len(message.request_id) <= 256
    message.request_id.encode("utf-8")
    for name in ("temp", "top_p", "min_p", "penalty_repeat", "penalty_freq", "penalty_present", "deadline_s"):
        value = getattr(message, name)
        assert value is None or (type(value) is float and math.isfinite(value)), (name, value)
    for name in ("max_tokens", "min_tokens", "n_keep", "priority"):
        value = getattr(message, name)
        assert isinstance(value, int) and not isinstance(value, bool), (name, value)
    assert message.max_tokens >= 1 and message.min_tokens >= 0 and message.n_keep >= 0
    assert isinstance(message.ignore_eos, bool) and isinstance(message.truncate, bool)
    if message.logit_bias is not None:
        for token, bias in message.logit_bias.items():
            assert type(token) is int and 0 <= token < 2**31 and type(bias) is float and bias != math.inf
            assert not math.isnan(bias)
    if message.stop is not None:
        assert all(type(s) is str and s for s in message.stop)
    if message.json_schema is not None:
        json.dumps(dict(message.json_schema), allow_nan=False)
    if message.grammar is not None:
        message.grammar.encode("utf-8")
    if hasattr(message, "prompt"):
        assert type(message.prompt) is str and message.prompt
        message.prompt.encode("utf-8")
    if hasattr(message, "tokens"):
        assert type(message.tokens) is tuple and message.tokens
        assert all(type(t) is int and 0 <= t < 2**31 for t in message.tokens)
    if hasattr(message, "messages"):
        for m in message.messages:
            assert m["role"] in ROLES and type(m["content"]) is str
            m["content"].encode("utf-8")
    if not isinstance(message, STREAMS):  # a pool pickles requests to Ray replicas
        assert pickle.loads(pickle.dumps(message)) == message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", list(PROMPTS), ids=lambda cls: cls.__name__)
@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_constructors_construct_or_refuse_with_invalid_request(cls: type[Any], data: st.DataObject) -> None:
    names = OPTIONS + (["parse_special"] if cls in (Chat, StreamChat) else [])
    prompt = data.draw(PROMPTS[cls] | JUNK, label="prompt")
    options = data.draw(_options(names, junk_share=0.5), label="options")
    if cls in STREAMS:
        options["reply_to"] = data.draw(st.just(queue.Queue()) | JUNK, label="reply_to")
    try:
        message = cls(prompt, **options)
    except InvalidRequest:
        return
    _check_constructed(message)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None, database=None)
@given(request_id=JUNK | st.text(), timeout=JUNK)
def test_cancel_and_drain_construct_or_refuse_with_invalid_request(request_id: Any, timeout: Any) -> None:
    try:
        cancel = Cancel(request_id)
    except InvalidRequest:
        pass
    else:
        assert type(cancel.request_id) is str and len(cancel.request_id) <= 256
        cancel.request_id.encode("utf-8")
    try:
        drain = Drain(timeout)
    except InvalidRequest:
        pass
    else:
        assert drain.timeout is None or (type(drain.timeout) is float and 0 <= drain.timeout < math.inf)


def _engine_property(c: Child) -> Callable[[], None]:
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cls=st.sampled_from(list(PROMPTS)), data=st.data())
    def admitted_or_refused(cls: type[Any], data: st.DataObject) -> None:
        names = OPTIONS + (["parse_special"] if cls in (Chat, StreamChat) else [])
        prompt = data.draw(VALID_PROMPTS[cls], label="prompt")
        options = data.draw(_options(names, junk_share=0, values=VALID), label="options")
        options["max_tokens"] = data.draw(st.integers(1, 6), label="max_tokens")
        options.pop("request_id", None)  # fresh ids: telemetry counts each request's ends by id
        q: queue.Queue[Any] = queue.Queue()
        if cls in STREAMS:
            options["reply_to"] = q
        try:
            message = cls(prompt, **options)
        except InvalidRequest:
            return
        if cls in STREAMS:
            c.ref.tell(message)
            c.outcome(q, message.request_id, timeout=60)
        else:
            with contextlib.suppress(EngineError):
                completion = c.complete(c.ref, message, timeout=60)
                assert completion.request_id == message.request_id
                assert completion.generated_tokens <= message.max_tokens
        assert c.ref.is_alive()

    return admitted_or_refused


@case("c00")
def _hypothesis_requests_are_admitted_or_refused_by_a_real_engine(c: Child) -> None:
    _engine_property(c)()


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
