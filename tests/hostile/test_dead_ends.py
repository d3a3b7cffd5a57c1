"""Classes 1 and 2: grammar dead ends end once and cleanly; huge JSON schemas are refused quickly.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import json
import math
import queue
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers import NO_EOG
from hostile_child import (
    OBJECT_A,
    X7,
    YES_NO,
    Child,
    _bias,
    _eog,
)
from hostile_runner import (
    Event,
    case,
    check,
)

from actors import (
    Chat,
    Done,
    EngineError,
    Failed,
    Generate,
    GenerateTokens,
    GetStats,
    InvalidRequest,
    StopReason,
    Stream,
    StreamChat,
)

# -- class 1: grammar dead ends ---------------------------------------------------------------

SAMPLING = {"greedy": {"temp": 0}, "sampled": {"temp": 0.9, "seed": 7}}


for _how, _sampling in SAMPLING.items():

    @case("c01", f"schema-min-tokens-past-the-end-{_how}")
    def _schema_min_tokens(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        message = Generate("JSON:", json_schema=OBJECT_A, min_tokens=200, max_tokens=300, **sampling)
        completion = c.complete(c.ref, message)
        # The document is complete and only end-of-generation is allowed: it ends there.
        assert completion.stop_reason == "eog", completion
        assert completion.generated_tokens < 200
        assert isinstance(json.loads(completion.text)["a"], int)

    @case("c01", f"grammar-ignore-eos-{_how}")
    def _grammar_ignore_eos(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        completion = c.complete(c.ref, Generate("Yes or no?", grammar=YES_NO, ignore_eos=True, **sampling))
        assert completion.stop_reason == "eog" and completion.text in ("yes", "no"), completion

    @case("c01", f"object-schema-with-every-brace-token-banned-{_how}")
    def _object_no_brace(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        bias = _bias(c, lambda t, piece: piece.startswith(b"{"))
        assert bias
        options: dict[str, Any] = {"json_schema": {"type": "object"}, "logit_bias": bias, **sampling}
        c.refused(c.ref, Generate("JSON:", **options))
        rid, q = c.stream(c.ref, "JSON:", **options)
        tokens, last = c.outcome(q, rid)
        assert not tokens and isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
        c.ref.tell(Generate("JSON:", **options))  # told: refused, logged, nobody crashes
        c.ref.tell(Chat([{"role": "user", "content": "JSON"}], **options))

    @case("c01", f"grammar-whose-only-continuation-is-banned-midway-{_how}")
    def _banned_midway(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        options: dict[str, Any] = {"grammar": X7, "logit_bias": _bias(c, lambda t, p: b"7" in p), **sampling}
        c.refused(c.ref, Generate("Say x7:", **options))
        rid, q = c.stream(c.ref, "Say x7:", **options)
        tokens, last = c.outcome(q, rid)
        assert "".join(t.text for t in tokens) == "x"
        assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
        assert c.terminals.get(rid) == 1

    @case("c01", f"grammar-end-with-every-eog-banned-{_how}")
    def _end_banned(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        bias = {t: -math.inf for t in _eog(c)}
        c.refused(c.ref, Generate("Say yes:", grammar='root ::= "yes"', logit_bias=bias, **sampling))

    @case("c01", f"only-eog-allowed-and-min-tokens-{_how}")
    def _only_eog(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        eog = _eog(c)
        bias = _bias(c, lambda t, p: t not in eog)
        completion = c.complete(c.ref, Generate("Hi", logit_bias=bias, min_tokens=5, **sampling))
        assert completion.stop_reason == "eog" and completion.generated_tokens == 0, completion

    @case("c01", f"every-token-banned-{_how}")
    def _all_banned(c: Child, sampling: dict[str, Any] = _sampling) -> None:
        bias = _bias(c, lambda t, p: True)
        c.refused(c.ref, Generate("Hi", logit_bias=bias, **sampling))
        c.refused(c.ref, Generate("Hi", logit_bias=bias, min_tokens=3, logprobs=3, **sampling))


@case("c01")
def _token_grammars_that_end_at_an_end_of_generation_token(c: Child) -> None:
    for sampling in SAMPLING.values():
        # A grammar that asks for <|im_end|> as a token: llama.cpp allows an end token
        # only where the grammar is complete, so after "a" nothing is allowed.
        c.refused(c.ref, Generate("Hi", grammar='root ::= "a" <|im_end|>', **sampling))
        c.refused(c.ref, Generate("Hi", grammar="root ::= <[2]>", **sampling))
        # One token that is not <|endoftext|>, then only the end: min_tokens yields to it.
        completion = c.complete(c.ref, Generate("Hi", grammar="root ::= !<[0]>", min_tokens=5, **sampling))
        assert completion.stop_reason == "eog" and completion.generated_tokens == 1, completion
        completion = c.complete(
            c.ref, Generate("Hi", grammar="root ::= <|im_start|>+", ignore_eos=True, max_tokens=4, **sampling)
        )
        assert completion.token_ids == (1, 1, 1, 1) and completion.text == "", completion
        # llama.cpp reads a token's piece as a C string: the NUL token matches nothing.
        c.refused(c.ref, Generate("Hi", grammar='root ::= "a\\x00b"', **sampling))


@case("c01")
def _chat_bool_schema_min_tokens_streamed(c: Child) -> None:
    q: queue.Queue[Any] = queue.Queue()
    message = StreamChat(
        [{"role": "user", "content": "True or false?"}],
        json_schema={"type": "boolean"},
        min_tokens=50,
        max_tokens=60,
        reply_to=q,
    )
    c.ref.tell(message)
    _, last = c.outcome(q, message.request_id)
    assert isinstance(last, Done) and last.completion.stop_reason == "eog", last
    assert isinstance(json.loads(last.completion.text), bool)


@case("c01")
def _server_default_grammar_with_ignore_eos(c: Child) -> None:
    ref = c.start(n_parallel=1, grammar=YES_NO)
    for temp in (0, 0.8):
        completion = c.complete(ref, Generate("Yes or no?", ignore_eos=True, temp=temp, max_tokens=40))
        assert completion.stop_reason == "eog" and completion.text in ("yes", "no"), completion
    c.serves(ref)


@case("c01")
def _json_schema_with_ignore_eos_is_refused_in_the_caller(c: Child) -> None:
    q: queue.Queue[Any] = queue.Queue()
    builds: list[Callable[[], object]] = [
        lambda: Generate("x", json_schema={"type": "object"}, ignore_eos=True),
        lambda: Stream("x", json_schema={"type": "string"}, ignore_eos=True, reply_to=q),
        lambda: Chat([{"role": "user", "content": "x"}], json_schema={}, ignore_eos=True),
        lambda: GenerateTokens([1, 2], json_schema={"type": "boolean"}, ignore_eos=True),
    ]
    for build in builds:
        with pytest.raises(InvalidRequest):
            build()


@case("c01")
def _dead_end_with_penalties_and_logprobs(c: Child) -> None:
    bias = _bias(c, lambda t, p: b"7" in p)
    message = Generate("Say x7:", grammar=X7, logit_bias=bias, penalty_repeat=1.3, logprobs=4, temp=0.7)
    c.refused(c.ref, message)


@case("c01")
def _dead_ends_in_one_batch_leave_the_others_alone(c: Child) -> None:
    eog = _eog(c)
    seven = _bias(c, lambda t, p: b"7" in p)
    not_eog = _bias(c, lambda t, p: t not in eog)
    runs: list[tuple[dict[str, Any], type[EngineError] | StopReason]] = [
        ({"grammar": X7, "logit_bias": seven, "temp": 0}, InvalidRequest),
        ({"logit_bias": {**not_eog, **{t: -math.inf for t in eog}}, "temp": 0.5}, InvalidRequest),
        ({"logit_bias": not_eog, "min_tokens": 9, "temp": 0}, "eog"),
        ({"json_schema": OBJECT_A, "min_tokens": 120, "max_tokens": 150, "temp": 0}, "eog"),
        ({"logit_bias": NO_EOG, "max_tokens": 24, "temp": 0}, "max_tokens"),
    ]
    told = [(c.stream(c.ref, "Write:", **options), expected) for options, expected in runs]
    for (rid, q), expected in told:
        _, last = c.outcome(q, rid)
        if isinstance(expected, str):
            assert isinstance(last, Done) and last.completion.stop_reason == expected, (expected, last)
        else:
            assert isinstance(last, Failed) and isinstance(last.error, expected), (expected, last)


@case("c01")
def _dead_ends_under_kv_pressure_end_once(c: Child) -> None:
    # 256 KV cells (llama.cpp's least) for four streams of 61 + 16 tokens: they overflow,
    # so requests are preempted and resumed (their grammar's state kept), and the dead
    # ends among them come and go meanwhile.
    ref = c.start(n_parallel=4, n_ctx=256, n_ctx_per_slot=256)
    assert ref.ask(GetStats())["kv_cells_total"] == 256
    long = {"grammar": "root ::= [a-z ]+", "logit_bias": NO_EOG, "max_tokens": 16, "temp": 0.8}
    kinds: list[tuple[dict[str, Any], type[Event]]] = [
        (long, Done),
        ({"grammar": X7, "logit_bias": _bias(c, lambda t, p: b"7" in p), "temp": 0.5}, Failed),
        (long, Done),
        ({"grammar": YES_NO, "ignore_eos": True, "temp": 0.9}, Done),
        (long, Done),
        ({"logit_bias": _bias(c, lambda t, p: True), "temp": 0}, Failed),
        ({"json_schema": OBJECT_A, "min_tokens": 16, "max_tokens": 20, "temp": 0.7}, Done),
        (long, Done),
    ]
    runs = [
        c.stream(ref, f"Story number {i}: " * 12, seed=i, **options) for i, (options, _) in enumerate(kinds)
    ]
    for (rid, q), (options, expected) in zip(runs, kinds, strict=True):
        _, last = c.outcome(q, rid, timeout=60)
        assert isinstance(last, expected), last
        if options is long:
            assert isinstance(last, Done) and set(last.completion.text) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert ref.ask(GetStats())["preemptions"] > 0, "no KV pressure: the case tests nothing"
    c.serves(ref)


# -- class 2 (its dead-end half): huge JSON schemas are refused quickly ----------------------

# name: (schema, what it must get: "refused", or "either" a refusal or a normal finish)
HUGE_SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "string-maxlength-20000": ({"type": "string", "maxLength": 20000}, "refused"),
    "string-maxlength-10**9": ({"type": "string", "maxLength": 10**9}, "refused"),
    "array-maxitems-10**9": ({"type": "array", "maxItems": 10**9}, "either"),
    "string-maxlength-10**6": ({"type": "string", "maxLength": 10**6}, "refused"),
    "string-minlength-20000": ({"type": "string", "minLength": 20000}, "refused"),
    "anyof-50-wide": ({"anyOf": [{"type": "string", "maxLength": 500} for _ in range(50)]}, "refused"),
    "3000-required-properties": (
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
            "required": [f"p{i}" for i in range(3000)],
        },
        "refused",
    ),
    "array-of-strings-100x100": (
        {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 100},
        "either",
    ),
    "pattern-a{20000}": ({"type": "string", "pattern": "^a{20000}$"}, "either"),
    "integers-within-1e300": ({"type": "integer", "minimum": -(10**300), "maximum": 10**300}, "either"),
}
# Its grammar costs seconds per token over the vocabulary: the caller's thread probes it
# (about 12 s on a 2-core machine) and refuses it, while the engine serves on.
ENUM_20000 = {"enum": [f"value-{i}" for i in range(20000)]}

for _name, (_schema, _expected) in HUGE_SCHEMAS.items():

    @case("c02", f"huge-schema-{_name}")
    def _huge_schema(c: Child, schema: dict[str, Any] = _schema, expected: str = _expected) -> None:
        c.serves(c.ref)
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.monotonic()
        try:
            completion = c.complete(c.ref, Generate("JSON:", json_schema=schema, temp=0, max_tokens=4))
            assert expected == "either", completion
        except InvalidRequest as e:
            assert "MemoryError" not in str(e), f"refused by running out of memory: {e!r}"
        assert time.monotonic() - t0 < 10
        grown_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak_mb
        assert grown_mb < 300, f"{grown_mb:.0f} MB more resident memory"
        rid, q = c.stream(c.ref, "JSON:", json_schema=schema, temp=0.8, max_tokens=4)
        _, last = c.outcome(q, rid, timeout=20)
        if expected == "refused":
            assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last


@case("c02")
def _a_huge_enum_probed_meanwhile_does_not_stall_the_engine(c: Child) -> None:
    errors: list[BaseException] = []

    def send() -> None:
        try:
            c.ref.ask(Generate("JSON:", json_schema=ENUM_20000, max_tokens=4))
        except BaseException as e:
            errors.append(e)

    sender = threading.Thread(target=send)
    t0 = time.monotonic()
    sender.start()
    gaps = []
    while True:  # at least once: a refusal may come before the first look
        t1 = time.monotonic()
        c.ref.ask(GetStats(), timeout=10)
        gaps.append(time.monotonic() - t1)
        if not sender.is_alive():
            break
        time.sleep(0.05)
    sender.join()
    assert len(errors) == 1 and isinstance(errors[0], InvalidRequest), errors
    assert time.monotonic() - t0 < 30, "refusing the enum took over 30 s"
    assert max(gaps) < 2.0, f"the engine answered GetStats only after {max(gaps):.1f} s"


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)
