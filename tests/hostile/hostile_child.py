"""The child side of the hostile runner: what a case gets (:class:`Child`: servers and
the bookkeeping of outcomes), the helpers cases of several classes share, and
:func:`child_main`, which runs the cases a parent gives it and reports each on stdout
(see :mod:`hostile_runner`)."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import queue
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pykka
import pytest
from helpers import wait_until
from hostile_runner import _MARK, CASE_TIMEOUT_S, CASES, HUNG, STOP_REASONS, Case, Event

import telemetry
from actors import (
    Completion,
    Done,
    EngineError,
    Failed,
    Generate,
    GetInfo,
    GetStats,
    InvalidRequest,
    ServerActor,
    StrategyError,
    Stream,
    StreamTokens,
    Token,
    default_model_path,
    generate,
)
from actors.backend._faults import faults
from actors.engine._delivery import courier
from strategies import BatchPlan, BatchStrategy, DecodeMaximal, SlotView

# Where a huge allocation is expected, it fails at once under a tighter limit.
ADDRESS_SPACE = {"c02": 3 << 30}
CASE_TIMEOUTS_S = {"m00": 2.0}

# -- the child ----------------------------------------------------------------------------


class Bystander(pykka.ThreadingActor):
    """An unrelated actor of the same process: pykka stops every actor when one dies of a
    ``BaseException``, so it answering after a case shows the case took down no one else."""

    def on_receive(self, message: Any) -> Any:
        return ("pong", message)


class Sink:
    """A ``reply_to`` with only ``put`` (no ``put_nowait``) that keeps its events.

    ``capacity`` makes it bounded: ``put`` raises ``queue.Full`` while that many events
    are unread (:meth:`read` reads them). ``fail(event, n)`` runs before each put (``n``
    events delivered so far) and may raise.
    """

    def __init__(
        self, capacity: int | None = None, fail: Callable[[object, int], None] | None = None
    ) -> None:
        self.events: list[object] = []
        self.capacity = capacity
        self.fail = fail
        self._unread = 0
        self._lock = threading.Lock()

    def put(self, item: object) -> None:
        if self.fail is not None:
            self.fail(item, len(self.events))
        with self._lock:
            if self.capacity is not None and self._unread >= self.capacity:
                raise queue.Full
            self.events.append(item)
            self._unread += 1

    def read(self) -> list[object]:
        with self._lock:
            self._unread = 0
            return list(self.events)


class Toggle(BatchStrategy):
    """``DecodeMaximal``, or while ``bad`` is set whatever ``bad`` returns (or raises)."""

    def __init__(self) -> None:
        self.bad: Callable[[Sequence[SlotView], int, int], object] | None = None

    def build_batch(
        self, slots: Sequence[SlotView], budget: int, chunk_size: int, *, queue_depth: int
    ) -> BatchPlan:
        bad = self.bad
        if bad is not None:
            return bad(slots, budget, chunk_size)  # type: ignore[return-value]
        return DecodeMaximal().build_batch(slots, budget, chunk_size, queue_depth=queue_depth)


class Child:
    """What a case gets in its child: servers, and the bookkeeping of outcomes."""

    def __init__(self) -> None:
        self.model_path = default_model_path()
        self.current = ""
        self._shared: Any = None
        self.started: list[Any] = []
        self.bystander = Bystander.start()
        self._late: list[tuple[str, str, Callable[[], int]]] = []
        self._lock = threading.Lock()
        self.terminals: dict[str, int] = {}  # request id -> request_done + request_exception
        self._owner: dict[str, str] = {}
        self._telemetry = telemetry.Subscription(
            {telemetry.request_done: self._on_end, telemetry.request_exception: self._on_end}
        )
        self.strategy_server: tuple[Any, Toggle] | None = None
        self._defaults = (courier.stall_s, courier.give_up_s)

    def _on_end(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self._lock:
            rid = metadata["request_id"]
            self.terminals[rid] = self.terminals.get(rid, 0) + 1
            self._owner.setdefault(rid, self.current)

    # -- servers ---------------------------------------------------------------------

    @property
    def ref(self) -> Any:
        """The shared 4-slot server (started again if a case killed it)."""
        if self._shared is None or not self._shared.is_alive():
            self._shared = ServerActor.start(model_path=self.model_path, n_ctx=2048, n_parallel=4)
            self._shared.ask(GetInfo(), timeout=30)  # loaded: its backend is set
        return self._shared

    def start(self, **options: Any) -> Any:
        """A server of this case only (loaded when this returns), stopped after it."""
        options.setdefault("n_ctx", 2048)
        ref = ServerActor.start(model_path=self.model_path, **options)
        self.started.append(ref)
        ref.ask(GetInfo(), timeout=30)
        return ref

    # -- outcomes --------------------------------------------------------------------

    def outcome(self, q: queue.Queue[Any], request_id: str, timeout: float = 30) -> tuple[list[Token], Event]:
        """A stream's tokens and its one terminal event; more events later fail the case."""
        events: list[Any] = []
        while not events or not isinstance(events[-1], Done | Failed):
            events.append(q.get(timeout=timeout))
        self.watch(f"stream {request_id}", q.qsize)
        return self._checked(events, request_id)

    def sink_outcome(self, sink: Sink, request_id: str, timeout: float = 30) -> tuple[list[Token], Event]:
        """As :meth:`outcome` for a :class:`Sink`."""
        wait_until(lambda: any(isinstance(e, Done | Failed) for e in sink.read()), timeout)
        n = len(sink.events)
        self.watch(f"stream {request_id}", lambda: len(sink.events) - n)
        return self._checked(sink.read(), request_id)

    @staticmethod
    def _checked(events: list[Any], request_id: str) -> tuple[list[Token], Event]:
        *tokens, last = events
        assert all(isinstance(e, Token) for e in tokens), events
        assert isinstance(last, Done | Failed), events
        assert all(e.request_id == request_id for e in events), (request_id, events)
        if isinstance(last, Done):
            completion = last.completion
            assert completion.stop_reason in STOP_REASONS
            assert "".join(t.text for t in tokens) == completion.text
            ids, generated = [t.token_id for t in tokens], list(completion.token_ids)
            # One Token per generated token, and one more (the same id) that flushes a
            # character cut by the end.
            assert ids == generated or (generated and ids == [*generated, generated[-1]]), (ids, generated)
        else:
            assert isinstance(last.error, EngineError), last
        return tokens, last

    def watch(self, what: str, extra: Callable[[], int]) -> None:
        """Fail the case if ``extra()`` (events after the outcome) is not 0 when the child ends."""
        self._late.append((self.current, what, extra))

    def stream(self, ref: Any, prompt: str | Sequence[int], **options: Any) -> tuple[str, queue.Queue[Any]]:
        """Tell a ``Stream`` (or ``StreamTokens``); its id and queue."""
        q: queue.Queue[Any] = queue.Queue(maxsize=options.pop("maxsize", 0))
        message: Stream | StreamTokens = (
            Stream(prompt, reply_to=q, **options)
            if isinstance(prompt, str)
            else StreamTokens(prompt, reply_to=q, **options)
        )
        ref.tell(message)
        return message.request_id, q

    @staticmethod
    def complete(ref: Any, message: Any, timeout: float = 30) -> Completion:
        """Ask, then wait for the Completion (raises what admission or the request raises)."""
        completion: Completion = ref.ask(message, timeout=timeout).get(timeout=timeout)
        assert completion.stop_reason in STOP_REASONS
        return completion

    @staticmethod
    def refused(ref: Any, message: Any, error: type[EngineError] = InvalidRequest) -> EngineError:
        """The request ends in ``error`` (at admission or later), nothing else."""
        with pytest.raises(EngineError) as caught:
            ref.ask(message, timeout=30).get(timeout=30)
        assert isinstance(caught.value, error), repr(caught.value)
        return caught.value

    @staticmethod
    def serves(ref: Any) -> None:
        completion = generate(ref, "The capital of France is", max_tokens=3, temp=0, timeout=30)
        assert completion.stop_reason in ("max_tokens", "eog"), completion

    @staticmethod
    def idle(ref: Any, seconds: float = 20) -> None:
        def quiet() -> bool:
            stats = ref.ask(GetStats(), timeout=10)
            return bool(stats["active_slots"] == 0 and stats["queue_depth"] == 0)

        wait_until(quiet, seconds)

    def alive(self) -> None:
        """The unrelated actor still answers."""
        assert self.bystander.is_alive(), "an unrelated pykka actor was stopped"
        assert self.bystander.ask("ping", timeout=5) == ("pong", "ping")

    # -- running cases ---------------------------------------------------------------

    def run(self, item: Case) -> list[str]:
        self.current = item.name
        problems: list[str] = []
        try:
            item.run(self)
        except BaseException:
            problems.append(traceback.format_exc(limit=12))
        faults.reset()
        courier.stall_s, courier.give_up_s = self._defaults
        try:
            self.alive()
            shared = self._shared
            if shared is not None:
                assert shared.is_alive(), "the shared engine died"
                self.idle(shared)
                self.serves(shared)
        except BaseException:
            problems.append("after the case: " + traceback.format_exc(limit=8))
        for ref in self.started:
            with contextlib.suppress(Exception):
                ref.stop(block=True, timeout=10)
        self.started.clear()
        return problems

    def late_problems(self) -> dict[str, list[str]]:
        """Second outcomes, looked for once every case of the child has run."""
        time.sleep(0.5)
        found: dict[str, list[str]] = {}
        for name, what, extra in self._late:
            n = extra()
            if n:
                found.setdefault(name, []).append(f"{what}: {n} more events after its outcome")
        with self._lock:
            for rid, n in self.terminals.items():
                if n > 1:
                    found.setdefault(self._owner[rid], []).append(f"request {rid} ended {n} times")
        return found


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def child_main(cases_json: str) -> None:
    """Run the named cases in this (child) process and report each on stdout;
    ``cases_json`` lists ``[module, name]`` pairs (the modules register the cases)."""
    pairs: list[list[str]] = json.loads(cases_json)
    for module in dict.fromkeys(module for module, _ in pairs):
        importlib.import_module(module)
    names = [name for _, name in pairs]
    # A request must not take the host's memory (machines are shared): 6 GiB of address
    # space holds a few engines of the default model; a runaway allocation dies here.
    group = CASES[names[0]].group
    limit = ADDRESS_SPACE.get(group, 6 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    child = Child()
    running: list[float] = []  # when the case under way started

    def watchdog() -> None:
        while True:
            time.sleep(1)
            if running and time.monotonic() - running[0] > CASE_TIMEOUTS_S.get(group, CASE_TIMEOUT_S):
                os._exit(HUNG)

    threading.Thread(target=watchdog, daemon=True).start()
    for name in names:
        _emit({"start": name})
        running[:] = [time.monotonic()]
        problems = child.run(CASES[name])
        _emit({"end": name, "problems": problems, "seconds": round(time.monotonic() - running[0], 2)})
        running.clear()
    for name, problems in child.late_problems().items():
        _emit({"end": name, "problems": problems})
    pykka.ActorRegistry.stop_all(timeout=10)
    _emit({"done": True})


# -- what cases of several classes use --------------------------------------------------

PROMPT_20 = " ".join(["one two three four five six seven eight nine ten"] * 3)


def _strategy_server(c: Child) -> tuple[Any, Toggle]:
    """The child's server with a :class:`Toggle` strategy (one for all its cases)."""
    if c.strategy_server is None or not c.strategy_server[0].is_alive():
        toggle = Toggle()
        ref = ServerActor.start(
            model_path=c.model_path,
            n_ctx=2048,
            n_parallel=2,
            n_batch=16,
            chunk_size=16,
            batch_strategy=toggle,
        )
        c.strategy_server = (ref, toggle)
    ref, toggle = c.strategy_server
    toggle.bad = None
    c.serves(ref)
    return ref, toggle


OBJECT_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


X7 = 'root ::= "x" "7"'  # with every token containing "7" banned: a dead end after "x"


YES_NO = 'root ::= "yes" | "no"'


def _bias(c: Child, keep: Callable[[int, bytes], bool]) -> dict[int, float]:
    """-inf for every token of the shared model for which ``keep(id, piece)`` holds."""
    backend = c.ref.backend
    assert backend is not None
    return {t: -math.inf for t in range(backend.vocab.n_vocab) if keep(t, backend.vocab.piece(t))}


def _eog(c: Child) -> frozenset[int]:
    assert c.ref.backend is not None
    return c.ref.backend.vocab.eog_ids


def _fails_with_strategy_error(
    c: Child, plan: Callable[[Sequence[SlotView], int, int], object], *, check_alive: bool = False
) -> None:
    ref, toggle = _strategy_server(c)
    toggle.bad = plan
    future = ref.ask(Generate(PROMPT_20, max_tokens=8, temp=0), timeout=10)
    rid, q = c.stream(ref, PROMPT_20, max_tokens=8, temp=0)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as caught:
        future.get(timeout=20)
    assert isinstance(caught.value, StrategyError), repr(caught.value)
    _, last = c.outcome(q, rid)
    assert isinstance(last, Failed) and isinstance(last.error, StrategyError), last
    assert time.monotonic() - t0 < 10
    if check_alive:
        c.alive()
    c.idle(ref)
    cpu = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.15, "the engine spins with nothing to do"
    toggle.bad = None
    c.serves(ref)


def _full_queue() -> queue.Queue[Any]:
    q: queue.Queue[Any] = queue.Queue(maxsize=1)
    q.put("unread")
    return q
