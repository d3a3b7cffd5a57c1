"""Bad input never reaches llama.cpp; failures reach every caller; nobody hangs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pykka
import pytest
from helpers import NO_EOG

import strategies
import telemetry
from actors import (
    ConfigError,
    Done,
    EngineError,
    EngineStopped,
    Failed,
    Generate,
    GenerateTokens,
    GetStats,
    InvalidRequest,
    ModelLoadError,
    QueueFull,
    RequestTimeout,
    ServerActor,
    StrategyError,
    Stream,
    generate,
    stream,
)

StartServer = Callable[..., pykka.ActorRef[Any]]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_batch": 0}, "n_batch"),
        ({"n_parallel": 0}, "n_parallel"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"n_parallel": 2.5}, "n_parallel"),
        ({"max_queue": -1}, "max_queue"),
        ({"temp": -1.0}, "temp"),
        ({"top_p": 3.0}, "top_p"),
        ({"batch_strategy": "fast"}, "BatchStrategy"),
    ],
)
def test_bad_options_raise_from_start(model_path: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerActor.start(model_path=model_path, **options)


def test_unknown_option_is_a_type_error_naming_it(model_path: str) -> None:
    with pytest.raises(TypeError, match="n_gpu"):
        ServerActor.start(model_path=model_path, n_gpu=1)


@pytest.mark.model  # the draft model's check comes after the default model's
def test_missing_or_bogus_model_raises_from_start(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"does not exist \(model_path= names it\): give model_path= a GGUF"
    ):
        ServerActor.start(model_path=tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match=r"give draft_model_path= a GGUF"):
        ServerActor.start(spec_type="draft", draft_model_path=tmp_path / "nope.gguf")
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        ServerActor.start(model_path=text)
    with pytest.raises(ModelLoadError, match=r"is not a file"):
        ServerActor.start(model_path=tmp_path)


def test_a_model_that_fails_to_load_stops_the_actor_and_asks_fail_at_once(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    ref = ServerActor.start(model_path=broken)
    t0 = time.monotonic()
    with pytest.raises((pykka.ActorDeadError, EngineError)):
        ref.ask(Generate("hi"), timeout=10)
    with pytest.raises(EngineStopped):
        generate(ref, "hi", timeout=10)
    assert time.monotonic() - t0 < 5


def test_default_model_path_honours_llama_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from actors import default_model_path

    monkeypatch.setenv("LLAMA_MODEL", str(tmp_path / "x.gguf"))
    assert default_model_path() == str(tmp_path / "x.gguf")


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (GenerateTokens([1, 2, 49152]), "outside the vocabulary"),
        (GenerateTokens([10**7]), "outside the vocabulary"),
        (Generate("word " * 3000), "cannot fit a slot.s context"),
        (GenerateTokens([1] * 2048), "cannot fit a slot.s context"),
        (Generate("hi", grammar="root ::= <not-one-token>"), "grammar"),  # needs the vocabulary
        (Generate("hi", logit_bias={60000: 1.0}), "outside the vocabulary"),
    ],
    ids=["token-id", "huge-token-id", "long-prompt", "long-tokens", "grammar", "logit-bias"],
)
def test_invalid_at_admission_raises_from_ask_and_fails_a_stream(
    server: pykka.ActorRef[Any], message: Any, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match):
        server.ask(message)
    q: queue.Queue[Any] = queue.Queue()
    fields = {k: getattr(message, k) for k in ("max_tokens", "grammar", "logit_bias")}
    prompt = getattr(message, "prompt", None)
    if prompt is not None:
        server.tell(Stream(prompt, reply_to=q, **fields))
    else:
        from actors import StreamTokens

        server.tell(StreamTokens(message.tokens, reply_to=q, **fields))
    failed = q.get(timeout=10)
    assert isinstance(failed, Failed) and isinstance(failed.error, InvalidRequest)
    assert server.ask(GetStats())["active_slots"] == 0
    assert generate(server, "Still serving", max_tokens=2, logit_bias=NO_EOG).generated_tokens == 2


def test_a_duplicate_live_request_id_is_invalid(server: pykka.ActorRef[Any]) -> None:
    first = server.ask(Generate("A long answer:", max_tokens=200, request_id="same", logit_bias=NO_EOG))
    with pytest.raises(InvalidRequest, match="already in use"):
        server.ask(Generate("Another", request_id="same"))
    first.get(timeout=60)
    assert generate(server, "Reused after it finished", max_tokens=2, request_id="same").request_id == "same"


def test_queue_full(start_server: StartServer) -> None:
    ref = start_server(n_parallel=1, max_queue=1)
    running = ref.ask(Generate("One", max_tokens=50, logit_bias=NO_EOG))
    queued = ref.ask(Generate("Two", max_tokens=5, logit_bias=NO_EOG))
    with pytest.raises(QueueFull):
        ref.ask(Generate("Three"))
    q: queue.Queue[Any] = queue.Queue()
    ref.tell(Stream("Four", reply_to=q))
    failed = q.get(timeout=10)
    assert isinstance(failed, Failed) and isinstance(failed.error, QueueFull)
    assert running.get(timeout=60).generated_tokens == 50
    assert queued.get(timeout=60).generated_tokens == 5


def test_max_queue_zero_accepts_only_what_fits_a_slot(start_server: StartServer) -> None:
    ref = start_server(n_parallel=1, max_queue=0)
    running = ref.ask(Generate("One", max_tokens=30, logit_bias=NO_EOG))
    with pytest.raises(QueueFull):
        ref.ask(Generate("Two"))
    running.get(timeout=60)


def test_a_raising_receiver_is_logged_and_skipped(
    server: pykka.ActorRef[Any], caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    def broken(sender: Any, **payload: Any) -> None:
        raise RuntimeError("receiver bug")

    def counting(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        seen.append(metadata["request_id"])

    telemetry.request_done.connect(broken)
    telemetry.request_done.connect(counting)
    try:
        completion = generate(server, "Hello", max_tokens=3, timeout=30)
    finally:
        telemetry.request_done.disconnect(broken)
        telemetry.request_done.disconnect(counting)
    assert seen == [completion.request_id]
    assert "receiver bug" in caplog.text


def test_stopping_the_actor_fails_every_pending_caller_at_once(start_server: StartServer) -> None:
    ref = start_server(n_parallel=2)
    running = [ref.ask(Generate(f"Story {i}", max_tokens=2000, logit_bias=NO_EOG)) for i in range(2)]
    queued = [ref.ask(Generate(f"Queued {i}", max_tokens=10)) for i in range(3)]
    q: queue.Queue[Any] = queue.Queue()
    ref.tell(Stream("A stream", reply_to=q, max_tokens=2000, logit_bias=NO_EOG))
    blocked: list[BaseException] = []

    def helper() -> None:
        try:
            generate(ref, "A helper", max_tokens=2000, logit_bias=NO_EOG)
        except BaseException as e:
            blocked.append(e)

    thread = threading.Thread(target=helper)
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    ref.stop()
    for future in running + queued:
        with pytest.raises(EngineStopped):
            future.get(timeout=5)
    event = q.get(timeout=5)
    while not isinstance(event, Failed | Done):
        event = q.get(timeout=5)
    assert isinstance(event, Failed) and isinstance(event.error, EngineStopped)
    thread.join(timeout=5)
    assert not thread.is_alive() and isinstance(blocked[0], EngineStopped)
    assert time.monotonic() - t0 < 5


def test_generate_timeout_cancels_the_request(server: pykka.ActorRef[Any]) -> None:
    with pytest.raises(RequestTimeout):
        generate(server, "A very long essay:", max_tokens=2000, timeout=0.3, logit_bias=NO_EOG)
    deadline = time.monotonic() + 5
    while server.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.ask(GetStats())["active_slots"] == 0


class Oversized(strategies.BatchStrategy):
    """A buggy user strategy: asks for more tokens than the budget."""

    def build_batch(
        self,
        slots: Sequence[strategies.SlotView],
        budget: int,
        chunk_size: int,
        *,
        queue_depth: int,
    ) -> strategies.BatchPlan:
        return strategies.BatchPlan(
            tuple(strategies.SlotPlan(s.seq_id, prefill_tokens=budget + 1) for s in slots)
        )


class Raising(strategies.BatchStrategy):
    def build_batch(
        self,
        slots: Sequence[strategies.SlotView],
        budget: int,
        chunk_size: int,
        *,
        queue_depth: int,
    ) -> strategies.BatchPlan:
        raise KeyError("oops")


@pytest.mark.parametrize("strategy", [Oversized(), Raising()], ids=repr)
def test_a_buggy_strategy_fails_requests_clearly_and_the_engine_lives(
    start_server: StartServer, strategy: strategies.BatchStrategy
) -> None:
    ref = start_server(n_parallel=2, batch_strategy=strategy)
    with pytest.raises(StrategyError):
        generate(ref, "Hello there", max_tokens=4, timeout=10)
    assert ref.is_alive()
    assert ref.ask(GetStats())["active_slots"] == 0


def test_stream_timeout_cancels_the_request(server: pykka.ActorRef[Any]) -> None:
    long_prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 150
    pieces = stream(server, long_prompt, max_tokens=50, timeout=0.001)
    with pytest.raises(RequestTimeout, match="no token within"):
        next(pieces)
    deadline = time.monotonic() + 10
    while server.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.ask(GetStats())["active_slots"] == 0


def test_prompt_too_long_pickles_with_its_numbers() -> None:
    import pickle

    from actors import InvalidRequest, PromptTooLong

    error = pickle.loads(pickle.dumps(PromptTooLong("too long", 5000, 1024)))
    assert isinstance(error, InvalidRequest)
    assert (str(error), error.n_prompt_tokens, error.n_ctx) == ("too long", 5000, 1024)
