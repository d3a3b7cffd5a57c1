"""The engine end to end on the default model: concurrency, streaming, cache, cancel."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, SIGNALS, Recorder, drain, same_greedy

from actors import (
    Cancel,
    Completion,
    Done,
    Failed,
    Generate,
    GenerateTokens,
    GetInfo,
    GetStats,
    GetTokenizer,
    Stream,
    StreamTokens,
    Token,
    generate,
    stream,
)
from actors.engine._delivery import courier

StartServer = Callable[..., pykka.ActorRef[Any]]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    for signal in SIGNALS.values():
        for receiver in list(signal.receivers_for(None)):
            signal.disconnect(receiver)


def test_generate_returns_a_completion(server: pykka.ActorRef[Any]) -> None:
    completion = generate(server, "Once upon a time", max_tokens=20, temp=0, logit_bias=NO_EOG, timeout=60)
    assert isinstance(completion, Completion)
    assert completion.stop_reason == "max_tokens"
    assert completion.generated_tokens == len(completion.token_ids) == 20
    assert completion.prompt_tokens == 4
    assert completion.text and completion.text == server.ask(GetTokenizer()).detokenize(completion.token_ids)
    assert 0 < completion.ttft_ms <= completion.duration_ms


def test_ask_returns_a_future_once_admitted(server: pykka.ActorRef[Any]) -> None:
    future = server.ask(Generate("Hello", max_tokens=5, logit_bias=NO_EOG))
    assert isinstance(future, pykka.Future)
    assert future.get(timeout=60).generated_tokens == 5


def test_eight_streams_on_four_slots_batch_their_decodes(
    server: pykka.ActorRef[Any], recorder: Recorder
) -> None:
    queues = []
    for i in range(8):
        q: queue.Queue[Any] = queue.Queue()
        server.tell(
            Stream(
                f"Story {i}: once upon a time", reply_to=q, max_tokens=24, temp=0.7, seed=i, logit_bias=NO_EOG
            )
        )
        queues.append(q)
    for q in queues:
        events = drain(q)
        done = events[-1]
        assert isinstance(done, Done), done
        tokens = [e for e in events if isinstance(e, Token)]
        assert "".join(t.text for t in tokens) == done.completion.text
        # One Token per generated token, and one more if a cut last character was flushed.
        ids = list(done.completion.token_ids)
        assert [t.token_id for t in tokens][: len(ids)] == ids and len(tokens) - len(ids) in (0, 1)
        assert all(t.request_id == done.request_id for t in tokens)
    decode_batches = [m["decode_tokens"] for m, _ in recorder.of("tick")]
    assert max(decode_batches) == 4
    assert all(m["batch_size"] <= 2048 for m, _ in recorder.of("tick"))
    # The tick's slot samples follow each request: prompt, then one more token per tick.
    seen: dict[str, list[int]] = {}
    for m, md in recorder.of("tick"):
        samples = md["slots"]
        assert [s.seq_id for s in samples] == [0, 1, 2, 3]
        assert m["active_slots"] == sum(s.state != "idle" for s in samples)
        assert m["kv_cells_used"] == sum(s.kv_tokens for s in samples) <= m["kv_cells_total"]
        for s in samples:
            if s.request_id is not None:
                seen.setdefault(s.request_id, []).append(s.generated_tokens)
    assert len(seen) == 8
    assert all(counts == sorted(counts) and counts[-1] == 23 for counts in seen.values())


def test_every_request_has_one_start_and_one_end(server: pykka.ActorRef[Any], recorder: Recorder) -> None:
    futures = [server.ask(Generate(f"Count to {i}", max_tokens=8 + i)) for i in range(6)]
    q: queue.Queue[Any] = queue.Queue()
    cancelled = Stream("A long story:", reply_to=q, max_tokens=200, logit_bias=NO_EOG)
    server.tell(cancelled)
    assert isinstance(q.get(timeout=30), Token)
    server.tell(Cancel(cancelled.request_id))
    assert drain(q)[-1].completion.stop_reason == "cancelled"
    ids = {f.get(timeout=60).request_id for f in futures} | {cancelled.request_id}
    starts = [md["request_id"] for _, md in recorder.of("start")]
    ends = [md["request_id"] for _, md in recorder.of("done") + recorder.of("exception")]
    assert sorted(starts) == sorted(ends) == sorted(ids)
    done = {md["request_id"]: (m, md) for m, md in recorder.of("done")}
    m, md = done[cancelled.request_id]
    assert md["stop_reason"] == "cancelled" and md["mode"] == "stream"
    assert set(m) == {
        "prompt_tokens", "generated_tokens", "duration_ms", "ttft_ms", "prompt_eval_rate",
        "generation_rate", "prefix_cache_tokens", "prefix_cache_ratio", "draft_tokens", "draft_accepted",
    }  # fmt: skip


def test_max_tokens_is_exact_and_eog_is_never_returned(server: pykka.ActorRef[Any]) -> None:
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    # Where the model ends is its own (and the CPU's) choice: a bias makes each
    # end-of-generation token in turn the pick at every step, min_tokens holds it off for 3.
    for eog in (0, 2, 4):
        completion = generate(server, chat, max_tokens=200, temp=0, min_tokens=3, logit_bias={eog: 100.0})
        assert completion.stop_reason == "eog" and completion.generated_tokens == 3
        assert not {0, 2, 4} & set(completion.token_ids)
        assert "<|im_end|>" not in completion.text and "<|endoftext|>" not in completion.text
    for n in (1, 2, 7, 40):
        completion = generate(server, chat, max_tokens=n, logit_bias=NO_EOG)
        assert completion.generated_tokens == n and completion.stop_reason == "max_tokens"


def test_token_prompts(repeatable_server: pykka.ActorRef[Any], reference_llama: Any) -> None:
    server = repeatable_server  # the three runs are the same computation: equal to the bit
    prompt = reference_llama.tokenize(b"Once upon a time", add_bos=True, special=True)
    tokens = list(generate(server, "Once upon a time", max_tokens=6, temp=0).token_ids)
    by_tokens = server.ask(GenerateTokens(prompt, max_tokens=6, temp=0)).get(timeout=60)
    assert by_tokens.prompt_tokens == 4 and list(by_tokens.token_ids) == tokens
    q: queue.Queue[Any] = queue.Queue()
    server.tell(StreamTokens(prompt, reply_to=q, max_tokens=6, temp=0))
    assert list(drain(q)[-1].completion.token_ids) == tokens


def test_prefix_cache_reuses_the_first_turn(server: pykka.ActorRef[Any]) -> None:
    first = "<|im_start|>user\nTell me about cats.<|im_end|>\n<|im_start|>assistant\n"
    one = generate(server, first, max_tokens=30, temp=0)
    # Stripped: a reply that opened with a newline would merge with the prompt's last "\n".
    reply = one.text.lstrip()
    second = first + reply + "<|im_end|>\n<|im_start|>user\nAnd dogs?<|im_end|>\n<|im_start|>assistant\n"
    two = generate(server, second, max_tokens=10, temp=0, logit_bias=NO_EOG, logprobs=2)
    assert two.prefix_cache_tokens >= one.prompt_tokens
    again = generate(server, second, max_tokens=10, temp=0, logit_bias=NO_EOG)  # an exact repeat finishes
    assert again.prefix_cache_tokens == again.prompt_tokens - 1
    same_greedy(two, again.token_ids)  # in other batches than the first time: the same tokens


def test_cache_prompt_off_reuses_nothing(start_server: StartServer) -> None:
    ref = start_server(n_parallel=1, cache_prompt=False)
    generate(ref, "The same prompt, twice", max_tokens=4)
    assert generate(ref, "The same prompt, twice", max_tokens=4).prefix_cache_tokens == 0


def test_cancel_a_running_generate_returns_the_text_so_far(server: pykka.ActorRef[Any]) -> None:
    message = Generate("Write a very long essay about the sea.", max_tokens=2000, logit_bias=NO_EOG)
    future = server.ask(message)
    time.sleep(0.3)
    server.tell(Cancel(message.request_id))
    completion = future.get(timeout=10)
    assert completion.stop_reason == "cancelled"
    assert 0 < completion.generated_tokens < 2000
    assert server.ask(GetStats())["active_slots"] == 0


def test_cancel_a_queued_request(start_server: StartServer, recorder: Recorder) -> None:
    ref = start_server(n_parallel=1)
    running = ref.ask(Generate("Tell me a long story.", max_tokens=100, logit_bias=NO_EOG))
    waiting = Generate("I wait in the queue", max_tokens=100)
    future = ref.ask(waiting)
    assert ref.ask(GetStats())["queue_depth"] == 1
    ref.tell(Cancel(waiting.request_id))
    completion = future.get(timeout=10)
    assert completion.stop_reason == "cancelled" and completion.generated_tokens == 0
    assert completion.ttft_ms == completion.duration_ms
    assert ref.ask(GetStats())["queue_depth"] == 0
    running.get(timeout=60)
    assert waiting.request_id not in [md["request_id"] for _, md in recorder.of("start")]


def test_stream_helper_joins_to_the_completion_and_closing_early_cancels(
    server: pykka.ActorRef[Any], repeatable_server: pykka.ActorRef[Any], recorder: Recorder
) -> None:
    pieces = list(stream(repeatable_server, "The weather today is", max_tokens=16, temp=0))
    assert "".join(pieces) == generate(repeatable_server, "The weather today is", max_tokens=16, temp=0).text
    iterator = stream(server, "An endless list of numbers: 1, 2,", max_tokens=1000, logit_bias=NO_EOG)
    next(iterator)
    iterator.close()
    deadline = time.monotonic() + 10
    while server.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.ask(GetStats())["active_slots"] == 0
    assert "cancelled" in [md["stop_reason"] for _, md in recorder.of("done")]


def test_a_stream_whose_consumer_stops_reading_is_cancelled_and_still_gets_its_end(
    server: pykka.ActorRef[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(courier, "stall_s", 0.5)
    full: queue.Queue[Any] = queue.Queue(maxsize=2)
    server.tell(Stream("Nobody reads this", reply_to=full, max_tokens=500, logit_bias=NO_EOG))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (full.qsize() < 2 or server.ask(GetStats())["active_slots"]):
        time.sleep(0.02)
    assert server.ask(GetStats())["active_slots"] == 0  # cancelled once it stalled
    assert generate(server, "Still serving?", max_tokens=3, logit_bias=NO_EOG).generated_tokens == 3
    # The consumer reads again: the held tokens, then exactly one Done, in order.
    events = [full.get(timeout=5)]
    while not isinstance(events[-1], Done | Failed):
        events.append(full.get(timeout=5))
    assert isinstance(events[-1], Done) and events[-1].completion.stop_reason == "cancelled"
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    ids = list(events[-1].completion.token_ids)  # and one more Token if a cut character was flushed
    assert tokens[: len(ids)] == ids and len(tokens) - len(ids) in (0, 1)
    time.sleep(0.1)
    assert full.empty()


def test_stats_and_info(server: pykka.ActorRef[Any], model_path: str) -> None:
    stats = server.ask(GetStats())
    slots = stats.pop("slots")
    assert [(s.seq_id, s.state, s.request_id) for s in slots] == [(i, "idle", None) for i in range(4)]
    assert stats == {
        "active_slots": 0, "idle_slots": 4, "prefilling_slots": 0, "generating_slots": 0,
        "queue_depth": 0, "embed_queue_depth": 0, "embed_passes": 0, "embedded_texts": 0,
        "n_parallel": 4, "n_batch": 2048, "n_ctx": 2048, "n_ctx_per_slot": 512,
        "kv_cells_used": 0, "kv_cells_total": 2048, "ram_cache_entries": 0, "ram_cache_bytes": 0,
        "preemptions": 0, "draft_tokens": 0, "draft_accepted": 0, "draft_acceptance_rate": 0.0,
        "kv_positions": (0, 0, 0, 0),
    }  # fmt: skip
    info = server.ask(GetInfo())
    assert info["model_path"] == model_path
    assert info["n_vocab"] == 49152 and info["n_ctx_train"] == 8192
    assert info["has_chat_template"] is True
    assert info["n_ctx"] == 2048 and info["n_parallel"] == 4 and info["n_batch"] == 2048
    assert info["n_threads"] >= 1


def test_idle_engine_stops_ticking(server: pykka.ActorRef[Any], recorder: Recorder) -> None:
    generate(server, "Hi", max_tokens=3)
    server.ask(GetStats())  # handled after the last tick, whose signal follows the reply
    n = len(recorder.of("tick"))
    time.sleep(0.3)
    assert len(recorder.of("tick")) == n


def test_unknown_message_is_ignored(server: pykka.ActorRef[Any]) -> None:
    assert server.ask("what is this?") is None
    server.tell(12345)
    assert generate(server, "Still here", max_tokens=2, logit_bias=NO_EOG).generated_tokens == 2


def test_seeded_sampling_is_reproducible(repeatable_server: pykka.ActorRef[Any]) -> None:
    server = repeatable_server  # the same computation twice (beside others: test_features.py)
    a = generate(server, "My favourite animal is", max_tokens=16, temp=1.0, seed=1234)
    b = generate(server, "My favourite animal is", max_tokens=16, temp=1.0, seed=1234)
    assert a.token_ids == b.token_ids


def test_model_load_reports_progress_then_the_load_time(start_server: Callable[..., Any]) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=1)
    ref.ask(GetStats())  # on_start has run
    events = [m for m, _ in recorder.of("model_load")]
    progress = [m["progress"] for m in events]
    assert progress == sorted(progress) and progress[-1] == 1.0 and len(progress) >= 2
    assert events[-1]["load_ms"] > 0 and all(m["load_ms"] is None for m in events[:-1])
