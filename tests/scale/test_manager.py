"""ModelManager: named models loaded on demand, routed by name, under a memory budget."""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest
from tiny_gguf import write_tiny_model

import telemetry
from actors import (
    Cancel,
    ConfigError,
    Done,
    Drain,
    EngineStopped,
    EraseSlot,
    Failed,
    Generate,
    GetInfo,
    GetStats,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelFailedLately,
    ModelLoadError,
    ModelManager,
    QueueFull,
    Stream,
    agenerate,
    chat,
    decide,
    default_model_path,
    estimate_memory,
    generate,
    stream,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.model]

SMALL = {"n_ctx": 512, "n_parallel": 2, "n_threads": 1}


@functools.cache
def one_mb() -> float:
    """What one SMALL engine of the default model holds (read from its header when asked:
    at import, a lane without the model could not even collect this file)."""
    return estimate_memory(**SMALL).total_mb


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture
def managers() -> Iterator[Callable[..., ModelManager]]:
    started: list[ModelManager] = []

    def start(*args: Any, **kwargs: Any) -> ModelManager:
        manager = ModelManager.start(*args, **kwargs)
        started.append(manager)
        return manager

    yield start
    for manager in started:
        manager.stop()
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def unloads() -> Iterator[list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []

    def on_unload(sender: object, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        assert measurements["memory_mb"] > 0 and measurements["loaded_ms"] >= 0
        seen.append((metadata["model"], metadata["reason"]))

    subscription = telemetry.Subscription({telemetry.model_unload: on_unload})
    yield seen
    subscription.close()


def states(manager: ModelManager) -> dict[str, str]:
    return {name: info["state"] for name, info in manager.ask(GetStats())["models"].items()}


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_two_names_for_the_default_model_route_by_name(managers: Callable[..., ModelManager]) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=4 * one_mb())
    assert manager.models() == ("a", "b")
    assert states(manager) == {"a": "unloaded", "b": "unloaded"}  # lazy: nothing loaded yet
    first = generate(manager, "Once upon a time", max_tokens=6, temp=0, model="a", timeout=60)
    assert first.generated_tokens == 6
    assert states(manager) == {"a": "ready", "b": "unloaded"}
    assert "".join(stream(manager, "Once upon a time", max_tokens=6, temp=0, model="b", timeout=60))
    reply = chat(manager.engine("a"), [{"role": "user", "content": "Hi"}], max_tokens=4, timeout=60)
    assert reply.generated_tokens >= 1
    question = {"q": {"type": "choice", "instructions": "Which?", "criteria": ["red", "blue"]}}
    by_a = decide(manager, "The sky is blue.", question, model="a", timeout=60)
    by_b = decide(manager, "The sky is blue.", question, model="b", timeout=60)
    assert by_a.answers == by_b.answers  # the same model under two names: the same numbers
    stats = manager.ask(GetStats())
    assert stats["models"]["a"]["engine"]["replicas_up"] == 1
    assert stats["held_mb"] == pytest.approx(2 * one_mb())
    assert stats["models"]["b"]["loads"] == 1


def test_unknown_or_missing_model_is_an_invalid_request(managers: Callable[..., ModelManager]) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=4 * one_mb())
    with pytest.raises(InvalidRequest, match=r"unknown model 'nope'.*'a', 'b'"):
        generate(manager, "x", max_tokens=1, model="nope")
    with pytest.raises(InvalidRequest, match="name the model"):
        generate(manager, "x", max_tokens=1)
    with pytest.raises(InvalidRequest, match="unknown model"):
        manager.engine("nope")
    events: queue.Queue[Any] = queue.Queue()
    with pytest.raises(InvalidRequest, match="unknown model"):
        manager.tell(Stream("x", reply_to=events, model="nope"))
    with pytest.raises(InvalidRequest, match="names model 'b' but was sent to 'a'"):
        generate(manager.engine("a"), "x", max_tokens=1, model="b")
    assert states(manager) == {"a": "unloaded", "b": "unloaded"}


def test_a_default_model_takes_requests_without_a_name(managers: Callable[..., ModelManager]) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=4 * one_mb(), default="b")
    assert generate(manager, "Hello", max_tokens=2, timeout=60).generated_tokens == 2
    assert states(manager)["b"] == "ready"
    assert manager.ask(GetInfo())["n_ctx"] == 512  # the default model's
    single = managers({"only": SMALL}, memory_budget_mb=2 * one_mb())
    assert generate(single, "Hello", max_tokens=2, timeout=60).generated_tokens == 2


def test_a_load_past_the_budget_unloads_the_least_recently_used_idle_model(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers({"a": SMALL, "b": SMALL, "c": SMALL}, memory_budget_mb=2.5 * one_mb())
    for name in ("a", "b", "a", "c"):  # b is the least recently used when c comes
        generate(manager, "Hi", max_tokens=2, model=name, timeout=60)
    assert states(manager) == {"a": "ready", "b": "unloaded", "c": "ready"}
    assert unloads == [("b", "evicted")]
    assert manager.ask(GetStats())["held_mb"] <= 2.5 * one_mb()


def test_a_model_in_use_or_pinned_is_never_unloaded_for_room(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers({"busy": SMALL, "other": SMALL}, memory_budget_mb=1.5 * one_mb(), wait_s=0)
    events: queue.Queue[Any] = queue.Queue()
    message = Stream("Tell me a long story", reply_to=events, max_tokens=400, ignore_eos=True, model="busy")
    manager.tell(message)
    assert not isinstance(events.get(timeout=60), Failed)  # a first token: it runs
    with pytest.raises(
        MemoryBudgetExceeded, match=r"needs about \d+ MiB.*\d+ MiB of the \d+ MiB budget.*busy"
    ) as e:
        generate(manager, "Hi", max_tokens=1, model="other", timeout=60)
    assert e.value.needed_mb == pytest.approx(one_mb()) and e.value.budget_mb == pytest.approx(1.5 * one_mb())
    manager.tell(Cancel(message.request_id))
    while not isinstance(events.get(timeout=60), Done | Failed):
        pass
    wait_for(lambda: manager.ask(GetStats())["models"]["busy"]["in_flight"] == 0)
    generate(manager, "Hi", max_tokens=1, model="other", timeout=60)  # now busy is idle: evicted
    assert unloads == [("busy", "evicted")]

    # A pinned model never makes room: refused at once, even by a manager that waits.
    pinned = managers({"pinned": {**SMALL, "pinned": True}, "other": SMALL}, memory_budget_mb=1.5 * one_mb())
    generate(pinned, "Hi", max_tokens=1, model="pinned", timeout=60)
    t0 = time.monotonic()
    with pytest.raises(MemoryBudgetExceeded, match="pinned"):
        generate(pinned, "Hi", max_tokens=1, model="other", timeout=60)
    assert time.monotonic() - t0 < 5


def test_a_request_waits_for_a_busy_model_to_make_room(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    # As the HTTP router does (ModelManager.DEFAULT_WAIT_S): the request waits for the
    # busy model to go idle, which then unloads for it; its own timeout bounds the wait.
    assert ModelManager.DEFAULT_WAIT_S == 300.0
    manager = managers({"busy": SMALL, "other": SMALL}, memory_budget_mb=1.5 * one_mb())
    events: queue.Queue[Any] = queue.Queue()
    message = Stream("Tell me a story", reply_to=events, max_tokens=60, ignore_eos=True, model="busy")
    manager.tell(message)
    assert not isinstance(events.get(timeout=60), Failed)  # a first token: it runs
    t0 = time.monotonic()
    with pytest.raises(MemoryBudgetExceeded):
        generate(manager, "Hi", max_tokens=1, model="other", timeout=0.5)  # its timeout, not 300 s
    assert 0.4 <= time.monotonic() - t0 < 5
    served = generate(manager, "Hi", max_tokens=1, model="other", timeout=60)
    assert served.generated_tokens == 1
    ends = []
    while not ends:
        event = events.get(timeout=60)
        if isinstance(event, Done | Failed):
            ends.append(event)
    assert isinstance(ends[0], Done) and ends[0].completion.generated_tokens == 60  # it finished first
    assert unloads == [("busy", "evicted")]
    with pytest.raises(ConfigError, match="wait_s"):
        ModelManager.start(memory_budget_mb=100, wait_s=-1)


def test_a_model_idle_past_its_keep_alive_unloads_and_loads_again(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers(
        {"brief": {**SMALL, "keep_alive_s": 0.3}, "kept": {**SMALL, "keep_alive_s": None}},
        memory_budget_mb=4 * one_mb(),
    )
    for name in ("brief", "kept"):
        generate(manager, "Hi", max_tokens=2, model=name, timeout=60)
    wait_for(lambda: states(manager)["brief"] == "unloaded")
    assert states(manager)["kept"] == "ready"
    assert unloads == [("brief", "idle")]
    # A long request is not idle: its keep_alive counts from its end.
    generate(manager, "Tell me a story", max_tokens=120, ignore_eos=True, model="brief", timeout=60)
    assert states(manager)["brief"] == "ready"
    assert manager.ask(GetStats())["models"]["brief"]["loads"] == 2


def test_requests_for_a_loading_model_wait_while_the_others_serve(
    managers: Callable[..., ModelManager], tiny_model: str
) -> None:
    slow_loads = 0

    def slow(sender: object, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        nonlocal slow_loads
        if metadata.get("replica") == "slow" and measurements["load_ms"] is None:
            slow_loads += 1
            time.sleep(0.01)  # the slow model's own engine thread: a long load

    subscription = telemetry.Subscription({telemetry.model_load: slow})
    try:
        manager = managers(
            {
                "slow": SMALL,
                "fast": {"model_path": tiny_model, "n_ctx": 512, "n_parallel": 2, "load": "eager"},
            },
            memory_budget_mb=4 * one_mb(),
        )
        results: list[Any] = []

        def call() -> None:
            results.append(generate(manager, "Hi", max_tokens=3, model="slow", timeout=60))

        threads = [threading.Thread(target=call) for _ in range(6)]
        for thread in threads:
            thread.start()
        wait_for(lambda: slow_loads > 0)
        assert states(manager)["slow"] == "loading"
        # The fast model answers while the slow one loads.
        assert generate(manager, "Hi", max_tokens=3, model="fast", timeout=60).generated_tokens == 3
        assert states(manager)["slow"] == "loading"
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 6 and all(r.generated_tokens == 3 for r in results)
        assert manager.ask(GetStats())["models"]["slow"]["loads"] == 1
    finally:
        subscription.close()


def test_a_model_that_fails_to_load_fails_only_its_own_requests(
    managers: Callable[..., ModelManager], tmp_path: Path, tiny_model: str
) -> None:
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(Path(tiny_model).read_bytes()[:2_000_000])  # the header, part of the weights
    manager = managers(
        {"broken": {"model_path": str(broken), "n_ctx": 512, "n_parallel": 1}, "good": SMALL},
        memory_budget_mb=4 * one_mb(),
    )
    with pytest.raises(EngineStopped, match="could not load"):  # llama.cpp's reason, as it came
        generate(manager, "Hi", max_tokens=2, model="broken", timeout=60)
    assert generate(manager, "Hi", max_tokens=2, model="good", timeout=60).generated_tokens == 2
    # Failed, until the keep_alive sweep frees it (its estimate counted for nothing).
    wait_for(lambda: states(manager)["broken"] in ("failed", "unloaded"))
    assert "could not load" in manager.ask(GetStats())["models"]["broken"]["last_error"]
    with pytest.raises(EngineStopped, match="broken"):  # loaded again for it, and failed again
        generate(manager, "Hi", max_tokens=2, model="broken", timeout=60)
    assert generate(manager, "Hi", max_tokens=2, model="good", timeout=60).generated_tokens == 2
    # A file that is not a model at all is refused when it is registered.
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelLoadError, match="cannot read the model file"):
        manager.register("garbage", model_path=str(garbage))
    with pytest.raises(ModelLoadError, match="does not exist"):
        manager.register("missing", model_path=str(tmp_path / "missing.gguf"))


def test_a_model_whose_load_failed_unloads_no_working_model_to_try_again(
    managers: Callable[..., ModelManager], tmp_path: Path, tiny_model: str
) -> None:
    # A hostile review: two requests for a broken file unloaded both good models (one each).
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(Path(tiny_model).read_bytes()[:2_000_000])
    tiny = {"model_path": tiny_model, "n_ctx": 512, "n_parallel": 1}
    manager = managers(
        {"broken": {"model_path": str(broken), "n_ctx": 512, "n_parallel": 1}, "a": tiny, "b": tiny},
        max_models=2,
    )
    generate(manager, "Hi", max_tokens=2, model="a", timeout=60)
    with pytest.raises(EngineStopped, match="could not load"):  # its first try may take a's place
        generate(manager, "Hi", max_tokens=2, model="broken", timeout=60)
    generate(manager, "Hi", max_tokens=2, model="b", timeout=60)
    wait_for(lambda: states(manager)["broken"] in ("failed", "unloaded"))
    loaded = {name for name, state in states(manager).items() if state == "ready"}
    if len(loaded) < 2:
        generate(manager, "Hi", max_tokens=2, model="a", timeout=60)
    working = {name for name, state in states(manager).items() if state == "ready"}
    assert working == {"a", "b"}
    for _ in range(2):  # again and again: refused, and nobody unloaded for it
        with pytest.raises(ModelFailedLately, match="failed lately"):
            generate(manager, "Hi", max_tokens=2, model="broken", timeout=60)
        assert {name for name, state in states(manager).items() if state == "ready"} == {"a", "b"}


def test_the_tiny_model_and_async_helpers(managers: Callable[..., ModelManager], tiny_model: str) -> None:
    manager = managers(
        {"smol": SMALL, "tiny": {"model_path": tiny_model, "n_ctx": 512, "n_parallel": 2}},
        memory_budget_mb=4 * one_mb(),
    )

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(
                agenerate(manager, "Hi", max_tokens=4, model="tiny", ignore_eos=True, timeout=60),
                agenerate(manager.engine("smol"), "Hi", max_tokens=4, ignore_eos=True, timeout=60),
            )
        )

    tiny, smol = asyncio.run(both())
    assert tiny.generated_tokens == smol.generated_tokens == 4
    stats = manager.ask(GetStats())["models"]
    assert stats["tiny"]["estimate_mb"] < stats["smol"]["estimate_mb"] - 50  # 8 MB of weights, not 92


def test_register_checks_every_option(managers: Callable[..., ModelManager]) -> None:
    manager = managers({"a": SMALL}, memory_budget_mb=4 * one_mb())
    bad: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
        (("a",), SMALL, "registered already"),
        (("",), {}, "non-empty"),
        ((7,), {}, "model name"),
        (("x\ud800",), {}, "model name"),
        (("x" * 10_000,), {}, "model name"),
        (("x",), {"keep_alive_s": float("nan")}, "keep_alive_s"),
        (("x",), {"keep_alive_s": -1}, "keep_alive_s"),
        (("x",), {"keep_alive_s": True}, "keep_alive_s"),
        (("x",), {"pinned": "yes"}, "pinned"),
        (("x",), {"load": "now"}, "load"),
        (("x",), {"replicas": 0}, "replicas"),
        (("x",), {"replicas": True}, "replicas"),
        (("x",), {"n_ctx": -5}, "n_ctx"),
        (("x",), {"name": "y"}, "named after its model"),
        (("x",), {"no_such_option": 1}, "no_such_option"),
    ]
    for args, kwargs, match in bad:
        with pytest.raises((ConfigError, TypeError), match=match):
            manager.register(*args, **kwargs)
    with pytest.raises(MemoryBudgetExceeded, match="more than the whole memory budget"):
        manager.register("huge", n_ctx=32768, n_parallel=1)
    # Telemetry labels a model's replicas name-0, name-1, ...: no two models may share one.
    manager.register("b", replicas=2, **SMALL)
    manager.register("c-0", **SMALL)
    for name, replicas in (("b-1", 1), ("b-0", 1), ("c", 2)):
        with pytest.raises(ConfigError, match="would both label telemetry"):
            manager.register(name, replicas=replicas, **SMALL)
    manager.register("a-1", **SMALL)  # "a" has one replica, labelled "a"
    manager.register("c", **SMALL)  # one replica: "c"
    assert manager.models() == ("a", "b", "c-0", "a-1", "c")
    for budget in (0, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ConfigError, match="memory_budget_mb"):
            ModelManager.start(memory_budget_mb=budget)
    with pytest.raises(ConfigError, match="default 'z' is not one of"):
        ModelManager.start({"a": SMALL}, memory_budget_mb=4 * one_mb(), default="z")
    with pytest.raises(InvalidRequest, match="model"):
        Generate("x", model="")
    with pytest.raises(InvalidRequest, match="model"):
        Generate("x", model=3)  # type: ignore[arg-type]


def test_an_eager_model_that_cannot_fit_fails_start_and_stops_everything(
    managers: Callable[..., ModelManager],
) -> None:
    with pytest.raises(MemoryBudgetExceeded):
        ModelManager.start(
            {"a": {**SMALL, "load": "eager", "pinned": True}, "b": {**SMALL, "load": "eager"}},
            memory_budget_mb=1.5 * one_mb(),
        )
    assert not [ref for ref in pykka.ActorRegistry.get_all() if ref.is_alive()]


def test_unload_unregister_and_stop(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=4 * one_mb())
    manager.load("a")
    manager.load("b")
    wait_for(lambda: states(manager) == {"a": "ready", "b": "ready"})
    manager.unload("a")
    manager.unregister("b")
    assert manager.models() == ("a",) and states(manager) == {"a": "unloaded"}
    generate(manager, "Hi", max_tokens=1, timeout=60)  # the only model left needs no name
    manager.stop()
    assert unloads == [("a", "unloaded"), ("b", "unregistered"), ("a", "stopped")]
    assert not manager.is_alive()
    with pytest.raises(EngineStopped):
        generate(manager, "Hi", max_tokens=1, timeout=5)


_RSS_CHILD = """
import json, random, sys, threading
from actors import ServerActor, embed, generate, GetInfo, estimate_memory

def rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

options = json.loads(sys.argv[1])
before = rss_mb()
ref = ServerActor.start(**options)
slot = ref.ask(GetInfo())["n_ctx"] // options["n_parallel"]
rng = random.Random(0)
# Every slot's context nearly full: the KV and the attention at their largest.
threads = [
    threading.Thread(target=generate, args=(ref, [rng.randrange(100, 40000) for _ in range(slot - 16)]),
                     kwargs={"max_tokens": 4, "temp": 0, "cache_prompt": False, "timeout": 120})
    for _ in range(options["n_parallel"])
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
embed(ref, ["text " * 300], timeout=120)  # a pass of its largest size: 256 rows
print(json.dumps({"measured": rss_mb() - before, "estimate": estimate_memory(**options).total_mb}))
ref.stop()
"""


@pytest.mark.subprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "options",
    [
        {"n_ctx": 1024, "n_parallel": 2},
        {"n_ctx": 1024, "n_parallel": 2, "flash_attn": False},
        {"model": "tiny", "n_ctx": 4096, "n_parallel": 2},
    ],
    ids=["default", "no-flash-attn", "tiny"],
)
def test_the_memory_estimate_is_within_15_percent_of_the_measured_growth(
    options: dict[str, Any], tiny_model: str
) -> None:
    """The estimate against the RSS a loaded engine adds once every slot's context is
    full and it has embedded texts, in a fresh process (docs/guides/models.md has the
    formula)."""
    options = dict(options, n_threads=2)  # the child is the only process computing
    if options.pop("model", None) == "tiny":
        options["model_path"] = tiny_model
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, json.dumps(options)],
        capture_output=True, text=True, timeout=280, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["estimate"] == pytest.approx(result["measured"], rel=0.15), result


def test_max_models_and_autoload(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=10 * one_mb(), max_models=1)
    generate(manager, "Hi", max_tokens=1, model="a", timeout=60)
    generate(manager, "Hi", max_tokens=1, model="b", timeout=60)
    assert states(manager) == {"a": "unloaded", "b": "ready"}  # the budget had room; the count did not
    assert unloads == [("a", "evicted")]

    told = managers({"a": SMALL}, memory_budget_mb=10 * one_mb(), autoload=False)
    with pytest.raises(ModelLoadError, match="not loaded"):
        generate(told, "Hi", max_tokens=1, timeout=60)
    told.load("a")
    assert generate(told, "Hi", max_tokens=1, timeout=60).generated_tokens == 1
    for bad in ({"max_models": -1}, {"max_models": 1.5}, {"max_models": True}, {"autoload": "yes"}):
        with pytest.raises(ConfigError):
            ModelManager.start(memory_budget_mb=100, **bad)


def test_a_model_handle_answers_for_its_model(managers: Callable[..., ModelManager]) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=10 * one_mb())
    handle = manager.engine("a")
    assert handle.ask(GetStats())["state"] == "unloaded"  # asking does not load it
    generate(handle, "Hi", max_tokens=1, timeout=60)
    stats = handle.ask(GetStats())
    assert stats["state"] == "ready" and stats["engine"]["replicas_up"] == 1
    assert handle.ask(GetInfo())["n_ctx"] == 512
    held = sum(s.kv_tokens for s in handle.ask(GetStats())["engine"]["slots"])
    assert handle.ask(EraseSlot(session="nobody")) == 0 and held > 0  # slot files reach the model
    with pytest.raises(InvalidRequest, match="drain the manager"):
        handle.ask(Drain())
    assert states(manager) == {"a": "ready", "b": "unloaded"}


def test_requests_for_a_loading_model_wait_in_a_bounded_queue(managers: Callable[..., ModelManager]) -> None:
    loading = threading.Event()
    release = threading.Event()

    def hold(sender: object, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        if metadata.get("replica") == "held" and measurements["load_ms"] is None:
            loading.set()
            release.wait(30)  # the held model's own engine thread: a load that takes a while

    subscription = telemetry.Subscription({telemetry.model_load: hold})
    try:
        manager = managers({"held": {**SMALL, "max_queue": 2}}, memory_budget_mb=4 * one_mb())
        events: list[queue.Queue[Any]] = [queue.Queue() for _ in range(5)]
        for i in range(4):  # 2 slots and a queue of 2 while it loads
            manager.tell(Stream("Hi", reply_to=events[i], max_tokens=2))
        assert loading.wait(30)
        with pytest.raises(QueueFull, match="'held' has 4 requests"):
            manager.tell(Stream("Hi", reply_to=events[4], max_tokens=2))
        release.set()
        for i in range(4):
            while not isinstance(event := events[i].get(timeout=60), Done | Failed):
                pass
            assert isinstance(event, Done)
    finally:
        release.set()
        subscription.close()


class _ShiftyPath:
    """A path-like that names one file when checked and another afterwards (or raises)."""

    def __init__(self, first: str, then: str | BaseException) -> None:
        self.first, self.then, self.calls = first, then, 0

    def __fspath__(self) -> str:
        self.calls += 1
        if self.calls == 1:
            return self.first
        if isinstance(self.then, BaseException):
            raise self.then
        return self.then


def test_the_options_checked_at_register_are_the_ones_loaded(
    managers: Callable[..., ModelManager], tiny_model: str
) -> None:
    """A caller's object is never read again in the manager's thread: a path that turns
    into another file, or raises SystemExit, at load changes nothing."""
    manager = managers(memory_budget_mb=4 * one_mb())
    manager.register("x", model_path=_ShiftyPath(tiny_model, SystemExit(3)), n_ctx=512, n_parallel=1)
    manager.register("y", model_path=_ShiftyPath(tiny_model, default_model_path()), n_ctx=512, n_parallel=1)
    for name in ("x", "y"):
        assert (
            generate(manager, "Hi", max_tokens=2, ignore_eos=True, model=name, timeout=60).generated_tokens
            == 2
        )
    info = manager.engine("y").ask(GetInfo())
    assert info["model_path"] == tiny_model
    assert manager.is_alive()


def test_request_ids_are_unique_across_models_and_a_cancel_reaches_one(
    managers: Callable[..., ModelManager],
) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=4 * one_mb())
    events: queue.Queue[Any] = queue.Queue()
    manager.tell(Stream("Hi", reply_to=events, max_tokens=300, ignore_eos=True, model="a", request_id="r1"))
    assert not isinstance(events.get(timeout=60), Failed)
    with pytest.raises(InvalidRequest, match="in flight on another model"):
        generate(manager, "Hi", max_tokens=2, model="b", request_id="r1", timeout=60)
    other = generate(manager, "Hi", max_tokens=2, model="b", request_id="r2", timeout=60)
    assert other.generated_tokens == 2
    manager.tell(Cancel("r1"))
    while not isinstance(event := events.get(timeout=60), Done | Failed):
        pass
    assert isinstance(event, Done) and event.completion.stop_reason == "cancelled"


def test_hostile_calls_are_refused_before_any_model_loads(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers({"a": SMALL, "b": SMALL}, memory_budget_mb=1.5 * one_mb())
    generate(manager, "Hi", max_tokens=1, model="a", timeout=60)
    with pytest.raises(TypeError, match="does not handle"):
        manager.ask(object())
    with pytest.raises(TypeError, match="does not handle"):
        manager.engine("b").tell("hello")
    for timeout in (float("inf"), float("nan"), -1, 1e300, "1", True):
        with pytest.raises(InvalidRequest, match="timeout"):
            manager.ask(Generate("Hi", max_tokens=1, model="b"), timeout=timeout)
    for name in (None, [1], ""):
        for call in (manager.unload, manager.unregister, manager.load):
            with pytest.raises(InvalidRequest):
                call(name)  # type: ignore[arg-type]
    assert unloads == [] and states(manager) == {"a": "ready", "b": "unloaded"}


def test_a_request_that_cannot_fit_unloads_nothing(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    manager = managers(
        {"p": {**SMALL, "pinned": True}, "a": SMALL, "big": {**SMALL, "n_ctx": 4096}},
        memory_budget_mb=2.2 * one_mb(),
    )
    for name in ("p", "a"):
        generate(manager, "Hi", max_tokens=1, model=name, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(MemoryBudgetExceeded, match="'big' needs about"):
        generate(manager, "Hi", max_tokens=1, model="big", timeout=60)
    # It could never fit beside the pinned model: refused at once, not after wait_s.
    assert time.monotonic() - t0 < 5
    assert unloads == [] and states(manager) == {"p": "ready", "a": "ready", "big": "unloaded"}


def test_blocking_requests_to_a_loading_model_count_once(managers: Callable[..., ModelManager]) -> None:
    release = threading.Event()

    def hold(sender: object, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        if metadata.get("replica") == "held" and measurements["load_ms"] is None:
            release.wait(30)

    subscription = telemetry.Subscription({telemetry.model_load: hold})
    try:
        manager = managers({"held": {**SMALL, "max_queue": 8}}, memory_budget_mb=4 * one_mb())  # capacity 10
        outcomes: list[Any] = []

        def call() -> None:
            try:
                outcomes.append(generate(manager, "Hi", max_tokens=1, timeout=60))
            except Exception as e:
                outcomes.append(e)

        threads = [threading.Thread(target=call) for _ in range(10)]
        for thread in threads:
            thread.start()
        wait_for(lambda: manager.ask(GetStats())["models"]["held"]["in_flight"] == 10)
        release.set()
        for thread in threads:
            thread.join(60)
        assert [type(o).__name__ for o in outcomes] == ["Completion"] * 10
    finally:
        release.set()
        subscription.close()


def test_keep_alive_counts_from_the_end_of_the_load(
    managers: Callable[..., ModelManager], unloads: list[tuple[str, str]]
) -> None:
    release = threading.Event()

    def hold(sender: object, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        if metadata.get("replica") == "slow" and measurements["load_ms"] is None:
            release.wait(30)

    subscription = telemetry.Subscription({telemetry.model_load: hold})
    try:
        manager = managers({"slow": {**SMALL, "keep_alive_s": 0.2}}, memory_budget_mb=4 * one_mb())
        manager.load("slow")
        time.sleep(1.0)  # five keep_alives into a load that has not ended
        assert states(manager) == {"slow": "loading"} and unloads == []
        release.set()
        wait_for(lambda: states(manager)["slow"] == "unloaded")
        assert unloads == [("slow", "idle")]
    finally:
        release.set()
        subscription.close()
