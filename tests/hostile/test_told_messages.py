"""Class 4: a told message never kills the engine, whatever it carries.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from helpers import NO_EOG, wait_until
from hostile_child import (
    Child,
)
from hostile_runner import (
    LONE,
    case,
    check,
)

from actors import (
    Cancel,
    Chat,
    Decide,
    Done,
    Drain,
    EngineError,
    EngineStopped,
    EraseSlot,
    Failed,
    Generate,
    GenerateTokens,
    GetInfo,
    GetLora,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    QueueFull,
    RestoreSlot,
    SaveSlot,
    ServerPool,
    SetLora,
    Stream,
    StreamChat,
    StreamTokens,
    decide,
    generate,
    stream,
)
from actors.actor._crashes import crash_reason

# -- class 4: a told message never kills the engine --------------------------------------------


def _tampered(message: Any, **fields: Any) -> Any:
    """``message`` with fields changed behind its checks (as a buggy or hostile sender could)."""
    message = dataclasses.replace(message)
    for name, value in fields.items():
        object.__setattr__(message, name, value)
    return message


@case("c04")
def _lone_surrogates_are_refused_in_the_caller_everywhere(c: Child) -> None:
    q: queue.Queue[Any] = queue.Queue()
    user = [{"role": "user", "content": "hi"}]
    builds: list[Callable[[], object]] = [
        lambda: Generate(LONE),
        lambda: Generate(f"a{LONE}b"),
        lambda: Stream(LONE, reply_to=q),
        lambda: Chat([{"role": "user", "content": f"x{LONE}"}]),
        lambda: StreamChat([{"role": "system", "content": LONE}, *user], reply_to=q),
        lambda: Chat([{"role": LONE, "content": "x"}]),
        lambda: Generate("x", grammar=f'root ::= "{LONE}"'),
        lambda: Generate("x", stop=["ok", LONE]),
        lambda: Generate("x", request_id=LONE),
        lambda: Generate("x", cache_scope=LONE),
        lambda: Generate("x", session=LONE),
        lambda: Generate("x", json_schema={"enum": [LONE]}),
        lambda: Generate("x", json_schema={LONE: "string"}),
        lambda: Cancel(LONE),
    ]
    for i, build in enumerate(builds):
        with pytest.raises(InvalidRequest):
            build()
        assert i >= 0


@case("c04")
def _tampered_surrogates_told_and_asked(c: Child) -> None:
    chat = ({"role": "user", "content": LONE},)
    streams: list[Callable[[queue.Queue[Any]], Any]] = [
        lambda q: _tampered(Stream("ok", reply_to=q), prompt=LONE),
        lambda q: _tampered(StreamChat([{"role": "user", "content": "ok"}], reply_to=q), messages=chat),
        lambda q: _tampered(Stream("ok", reply_to=q), grammar=f'root ::= "{LONE}"'),
    ]
    for build in streams:
        q: queue.Queue[Any] = queue.Queue()
        message = build(q)
        c.ref.tell(message)
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
    asked = [
        _tampered(Generate("ok"), prompt=LONE),
        _tampered(Chat([{"role": "user", "content": "ok"}]), messages=chat),
        _tampered(Generate("ok"), grammar=f'root ::= "{LONE}"'),
    ]
    for message in asked:
        c.refused(c.ref, message)
        c.ref.tell(message)
    # A surrogate only the output path sees: a stop string, the request id.
    for fields in ({"stop": (LONE,)}, {"request_id": f"id{LONE}"}):
        q = queue.Queue()
        message = _tampered(Stream("Count: 1, 2,", max_tokens=4, temp=0, reply_to=q), **fields)
        c.ref.tell(message)
        _, last = c.outcome(q, message.request_id)


@case("c04")
def _logit_bias_of_wrong_types(c: Child) -> None:
    bad: list[object] = [
        {"5": 1.0},
        {5.0: 1.0},
        {True: 1.0},
        {None: 1.0},
        {(1,): 1.0},
        {-1: 0.0},
        {2**31: 0.0},
        {10**400: 0.0},
        {5: "1"},
        {5: None},
        {5: math.nan},
        {5: math.inf},
        {5: 10**400},
        {5: [1.0]},
        {5: 1j},
        [(5, 1.0)],
        "5:1",
        5,
    ]
    for bias in bad:
        with pytest.raises(InvalidRequest):
            Generate("x", logit_bias=bias)  # type: ignore[arg-type]
    q: queue.Queue[Any] = queue.Queue()
    for bias in ({"5": 1.0}, {5: "1"}, {5: math.nan}, [(5, 1.0)]):
        q = queue.Queue()
        message = _tampered(Stream("ok", max_tokens=2, temp=0.5, reply_to=q), logit_bias=bias)
        c.ref.tell(message)
        c.outcome(q, message.request_id)
        c.ref.tell(_tampered(Generate("ok", max_tokens=2), logit_bias=bias))
    assert c.ref.is_alive()


@case("c04")
def _cancel_with_bad_ids(c: Child) -> None:
    for request_id in ([1], None, 1, b"x", 1.5, "x" * 100_000, {"id": 1}):
        with pytest.raises(InvalidRequest):
            Cancel(request_id)  # type: ignore[arg-type]
    rid, q = c.stream(c.ref, "Story:", max_tokens=16, temp=0, logit_bias=NO_EOG)
    for request_id in ([1], None, {"a": 1}, object()):
        bad = _tampered(Cancel("x"), request_id=request_id)
        c.ref.tell(bad)
        with contextlib.suppress(EngineError):  # asked: ignored, or an EngineError, nothing else
            c.ref.ask(bad, timeout=10)
    _, last = c.outcome(q, rid)
    assert isinstance(last, Done) and last.completion.stop_reason == "max_tokens", last


@case("c04")
def _drain_with_bad_timeouts(c: Child) -> None:
    for timeout in ("30", -1, -0.5, math.nan, math.inf, -math.inf, True, 10**400, [1], 1j, Decimal(3)):
        with pytest.raises(InvalidRequest):
            Drain(timeout)  # type: ignore[arg-type]
    for timeout in ("30", [1], None.__class__):
        bad = _tampered(Drain(1), timeout=timeout)
        c.ref.tell(bad)
        with contextlib.suppress(EngineError):
            c.ref.ask(bad, timeout=10)
    assert c.ref.is_alive()
    stats = c.ref.ask(GetStats(), timeout=10)
    assert stats["active_slots"] == 0


@case("c04")
def _told_requests_that_fail_admission(c: Child) -> None:
    ref = c.start(n_parallel=1, max_queue=0)
    busy, busy_q = c.stream(ref, "Story:", max_tokens=400, temp=0, logit_bias=NO_EOG)
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 1, 20)
    # A duplicate id, told as a Generate and as a Stream, and a full queue.
    ref.tell(Generate("x", request_id=busy))
    dup, dup_q = c.stream(ref, "x", request_id=busy)
    _, last = c.outcome(dup_q, dup)
    assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest | QueueFull), last
    ref.tell(Generate("x"))
    ref.tell(Chat([{"role": "user", "content": "x"}]))
    rid, q = c.stream(ref, "x")
    _, last = c.outcome(q, rid)
    assert isinstance(last, Failed) and isinstance(last.error, QueueFull), last
    c.refused(ref, Generate("x"), QueueFull)
    ref.tell(Cancel(busy))
    _, last = c.outcome(busy_q, busy)
    assert isinstance(last, Done) and last.completion.stop_reason == "cancelled", last
    c.idle(ref)
    c.serves(ref)


@case("c04")
def _told_requests_too_long_or_out_of_the_vocabulary(c: Child) -> None:
    long_prompt = "word " * 5000  # over a slot's 512 tokens
    c.ref.tell(Generate(long_prompt))
    c.ref.tell(GenerateTokens([1, 10**7]))
    c.ref.tell(Chat([{"role": "user", "content": long_prompt}]))
    for prompt in (long_prompt, [1, 10**7], [49152]):
        rid, q = c.stream(c.ref, prompt)
        _, last = c.outcome(q, rid)
        assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
    for tokens in ((1, -5), ("a", 1), (10**7,), ()):
        q = queue.Queue()
        message = _tampered(StreamTokens([1], reply_to=q), tokens=tokens)
        c.ref.tell(message)
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
        c.refused(c.ref, _tampered(GenerateTokens([1]), tokens=tokens))


@case("c04")
def _tampered_token_ids_of_wrong_types(c: Child) -> None:
    for tokens in ((1.5,), (True, 2), (1, np.int64(2))):
        q: queue.Queue[Any] = queue.Queue()
        message = _tampered(StreamTokens([1], max_tokens=2, reply_to=q), tokens=tokens)
        c.ref.tell(message)
        _, last = c.outcome(q, message.request_id)
        assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), (tokens, last)


@case("c04")
def _told_bad_streams_through_a_pool_end_once_and_leave_nothing_in_flight(c: Child) -> None:
    pool = ServerPool.start(replicas=1, model_path=c.model_path, n_ctx=2048, n_parallel=2, n_threads=1)
    try:
        (replica,) = pool.replicas
        builds: list[Callable[[queue.Queue[Any]], Any]] = [
            lambda q: StreamTokens([1, 10**7], reply_to=q),  # refused at admission
            lambda q: Stream("word " * 5000, reply_to=q),  # too long for a slot
            lambda q: _tampered(Stream("ok", reply_to=q), prompt=LONE),
            lambda q: _tampered(Stream("ok", reply_to=q), grammar=f'root ::= "{LONE}"'),
        ]
        for build in builds:
            q: queue.Queue[Any] = queue.Queue()
            message = build(q)
            try:
                pool.tell(message)
            except InvalidRequest:
                continue  # refused in the caller's thread: that is its one outcome
            _, last = c.outcome(q, message.request_id)
            assert isinstance(last, Failed) and isinstance(last.error, InvalidRequest), last
        for tampered in (_tampered(Cancel("x"), request_id=[1]), _tampered(Drain(1), timeout="30")):
            with contextlib.suppress(Exception):  # the sender's own thread may raise for its own bug
                pool.tell(tampered)
        with contextlib.suppress(EngineError, TypeError):  # the pool refuses what it cannot route
            pool.tell(42)
        wait_until(lambda: pool.router.loads().get(replica, 0) == 0, 10)
        assert "".join(stream(pool, "Hello", max_tokens=3, temp=0, timeout=30))
        completion = generate(pool, "Hello", max_tokens=3, temp=0, timeout=30)
        assert completion.generated_tokens <= 3
        wait_until(lambda: pool.router.loads().get(replica, 0) == 0, 10)
    finally:
        pool.stop()


@case("c04")
def _told_queries_and_unknown_objects(c: Child) -> None:
    for message in (GetStats(), GetInfo(), GetTokenizer()):
        c.ref.tell(message)
    junk: list[object] = [42, "x", None, b"", {"a": 1}, [1], object(), Exception("x"), lambda: 1, Generate]
    for message in junk:
        c.ref.tell(message)
        try:
            answer = c.ref.ask(message, timeout=10)
        except EngineError:
            continue
        assert answer is None, answer
    assert c.ref.is_alive()


@case("c04")
def _a_future_resolved_by_its_caller_then_expiring(c: Child) -> None:
    ref = c.start(n_parallel=2)
    other, other_q = c.stream(ref, "Story:", max_tokens=40, temp=0, logit_bias=NO_EOG)
    future = ref.ask(Generate("Hello", max_tokens=400, temp=0, logit_bias=NO_EOG, deadline_s=0.5))
    future.set("mine")
    time.sleep(1.0)
    assert ref.is_alive(), crash_reason(ref.actor_urn)
    _, last = c.outcome(other_q, other)
    assert isinstance(last, Done) and last.completion.stop_reason == "max_tokens", last
    c.serves(ref)


@case("c04")
def _a_future_resolved_by_its_caller_at_stop(c: Child) -> None:
    ref = c.start(n_parallel=1)
    future = ref.ask(Generate("Hello", max_tokens=400, temp=0, logit_bias=NO_EOG))
    queued = [c.stream(ref, f"Story {i}:", max_tokens=400, temp=0, logit_bias=NO_EOG) for i in range(2)]
    future.set_exception(exc_info=(RuntimeError, RuntimeError("mine"), None))
    ref.stop(block=True, timeout=10)
    for rid, q in queued:
        _, last = c.outcome(q, rid, timeout=3)
        assert isinstance(last, Failed) and isinstance(last.error, EngineStopped), last


@case("c04")
def _a_future_resolved_by_its_caller_then_finishing_or_cancelled(c: Child) -> None:
    for cancel in (False, True):
        message = Generate("Hello", max_tokens=8 if not cancel else 400, temp=0, logit_bias=NO_EOG)
        future = c.ref.ask(message)
        future.set("mine")
        if cancel:
            c.ref.tell(Cancel(message.request_id))
        wait_until(lambda rid=message.request_id: c.terminals.get(rid) == 1, 20)
        assert future.get(timeout=1) == "mine"
        assert c.ref.is_alive()


def test_hostile(hostile_case: str) -> None:
    check(hostile_case)


@case("c04")
def _tampered_decisions_are_refused_and_the_engine_serves_on(c: Child) -> None:
    questions = {"q": {"type": "choice", "instructions": "Which?", "criteria": ["a", "b"]}}
    good = Decide("A state.", questions)
    for fields in (
        {"questions": {"q": "not a question"}},
        {"questions": None},
        {"state": {"not": "text"}},
        {"state": LONE},
        {"template_kwargs": {"messages": object()}},
    ):
        bad = _tampered(good, **fields)
        c.refused(c.ref, bad)
        c.ref.tell(bad)
    decision = decide(c.ref, "A state.", questions, timeout=30)
    assert set(decision.answers) == {"q"}
    c.serves(c.ref)


@case("c04")
def _tampered_lora_and_lora_control_are_refused_and_the_engine_serves_on(c: Child) -> None:
    good = Generate("Hi", max_tokens=2, lora={})
    for lora in ([{"id": 0}], {0: float("nan")}, {True: 1.0}, "x", {object(): 1.0}, {0: 1.0}):
        bad = _tampered(good, lora=lora)
        c.refused(c.ref, bad)
        c.ref.tell(bad)
    setter = SetLora({})
    for scales in (None, [1, 2], {"none": 1.0}, {0: 1.0}):
        bad_set = _tampered(setter, scales=scales)
        c.ref.tell(bad_set)
        with pytest.raises(EngineError):
            c.ref.ask(bad_set, timeout=10)
    assert c.ref.ask(GetLora(), timeout=10) == ()
    c.serves(c.ref)


@case("c04")
def _tampered_slot_file_messages_are_refused_and_the_engine_serves_on(c: Child) -> None:
    missing = "/nonexistent/slot.bin"
    tampered = [
        _tampered(SaveSlot(missing, slot=0), slot="0"),
        _tampered(SaveSlot(missing, slot=0), slot=10**9),
        _tampered(SaveSlot(missing, slot=0), path=object()),
        _tampered(RestoreSlot(missing), path="a\x00b"),
        _tampered(RestoreSlot(missing), slot=-1),
        _tampered(RestoreSlot(missing), path=LONE),
        _tampered(EraseSlot(slot=0), slot=1.5),
        _tampered(EraseSlot(slot=0), slot=None),
    ]
    for bad in tampered:
        c.ref.tell(bad)
        with pytest.raises(EngineError):
            c.ref.ask(bad, timeout=10)
    c.serves(c.ref)
