"""n completions of one prompt on the real model: the prompt is prefilled once, every
choice starts in the same tick when slots allow, each samples on its own, and each gets
exactly one outcome (a failure of one fails them all)."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, Recorder, wait_until

from actors import (
    Cancel,
    Completion,
    Done,
    EngineError,
    Generate,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    Stream,
    Token,
    agenerate,
    astream,
    astream_events,
    generate,
    stream,
)
from actors.backend._faults import faults

StartServer = Callable[..., pykka.ActorRef[Any]]

PROMPT = "Write one sentence about the sea. " * 20 + "\nSentence:"


def prompt_tokens(ref: pykka.ActorRef[Any]) -> int:
    return len(ref.ask(GetTokenizer()).tokenize(PROMPT))


def test_n_choices_compute_the_prompt_once_and_sample_each_on_its_own(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=4, n_ctx=4096)
    got = ref.ask(Generate(PROMPT, n=4, temp=1.0, seed=7, max_tokens=16, logit_bias=NO_EOG)).get(timeout=120)
    assert isinstance(got, tuple) and [c.index for c in got] == [0, 1, 2, 3]
    assert all(isinstance(c, Completion) and c.generated_tokens == 16 for c in got)
    assert len({c.token_ids for c in got}) > 1  # their own seeds
    n_prompt = prompt_tokens(ref)
    assert all(c.prompt_tokens == n_prompt for c in got)
    # One prefill: the others copied the leader's cells and sampled its logits row.
    assert sum(m["prefill_tokens"] for m, _ in recorder.of("tick")) == n_prompt
    assert [c.prefix_cache_tokens for c in got[1:]] == [n_prompt] * 3
    starts = [md["request_id"] for _, md in recorder.of("start")]
    assert starts == [got[0].request_id] * 4  # under one request id


def test_the_same_request_with_a_seed_repeats_on_a_fresh_engine(start_server: StartServer) -> None:
    runs = []
    for _ in range(2):
        ref = start_server(n_parallel=3, n_ctx=4096, cache_prompt=False)
        runs.append(generate(ref, PROMPT, n=3, temp=1.0, seed=11, max_tokens=12))
        ref.stop()
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]


def test_streamed_choices_all_start_in_the_first_tick_and_end_once_each(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, n_ctx=4096)
    events: queue.Queue[Any] = queue.Queue()
    ref.tell(Stream(PROMPT, reply_to=events, n=3, temp=0.9, max_tokens=10, logit_bias=NO_EOG))
    seen: list[Any] = []
    while sum(isinstance(e, Done) for e in seen) < 3:
        seen.append(events.get(timeout=120))
    tokens = [e for e in seen if isinstance(e, Token)]
    # Every choice's first token comes before any choice's second one: the same tick.
    assert {e.index for e in tokens[:3]} == {0, 1, 2}
    done = {e.index: e.completion for e in seen if isinstance(e, Done)}
    assert sorted(done) == [0, 1, 2]
    for i, completion in done.items():
        assert completion.index == i
        assert "".join(e.text for e in tokens if e.index == i) == completion.text
    assert events.empty()


def test_more_choices_than_free_slots_run_later_from_the_leaders_cells(start_server: StartServer) -> None:
    recorder = Recorder()
    ref = start_server(n_parallel=2, n_ctx=4096)
    got = generate(ref, PROMPT, n=5, temp=1.0, max_tokens=8, logit_bias=NO_EOG)
    assert [c.index for c in got] == list(range(5)) and all(c.generated_tokens == 8 for c in got)
    n_prompt = prompt_tokens(ref)
    # Waiting choices copy all but the last prompt token, which each decodes itself.
    assert sum(m["prefill_tokens"] for m, _ in recorder.of("tick")) <= n_prompt + 5


def test_another_request_takes_turns_with_the_choices_of_one(start_server: StartServer) -> None:
    # A hostile review: four n=16 requests queued 64 choices first come, first served, and
    # an ordinary request behind them waited 333 s. Now a waiting request goes before the
    # choices of a request that has some in the slots: it waits for one choice at most.
    ref = start_server(n_parallel=2, n_ctx=4096)
    t_many = time.monotonic()
    many = ref.ask(Generate(PROMPT, n=6, temp=1.0, max_tokens=40, logit_bias=NO_EOG), block=False)
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 2, seconds=60)
    t_single = time.monotonic()
    single = generate(ref, "Hi", max_tokens=5, logit_bias=NO_EOG, timeout=120)
    choices = many.get(timeout=300).get(timeout=300)
    assert single.generated_tokens == 5 and all(c.generated_tokens == 40 for c in choices)
    # Its first token came before the last choices' (which, first come first served, it
    # waited for all): the slots took turns.
    firsts = sorted(t_many + c.ttft_ms / 1000 for c in choices)
    assert t_single + single.ttft_ms / 1000 < firsts[-2], (t_single + single.ttft_ms / 1000, firsts)


def test_cancel_ends_every_choice(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, n_ctx=4096)
    events: queue.Queue[Any] = queue.Queue()
    message = Stream(PROMPT, reply_to=events, n=3, max_tokens=400, logit_bias=NO_EOG)
    ref.tell(message)
    assert isinstance(events.get(timeout=120), Token)
    ref.tell(Cancel(message.request_id))
    done: list[Done] = []
    while len(done) < 3:
        event = events.get(timeout=60)
        if isinstance(event, Done):
            done.append(event)
    assert sorted(d.index for d in done) == [0, 1, 2]
    assert {d.completion.stop_reason for d in done} == {"cancelled"}
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 0)


def test_one_failing_choice_fails_the_request_once(start_server: StartServer, caplog: Any) -> None:
    ref = start_server(n_parallel=3, n_ctx=4096)
    calls = {"n": 0}
    caplog.set_level(logging.ERROR, logger="llama_cpp_actors.engine")

    def break_the_fifth_sample(seq_id: int) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected sampler failure")

    faults.sample = break_the_fifth_sample
    try:
        with pytest.raises(EngineError, match="injected"):
            generate(ref, PROMPT, n=3, max_tokens=20, logit_bias=NO_EOG, timeout=60)
    finally:
        faults.reset()
    wait_until(lambda: ref.ask(GetStats())["active_slots"] == 0)
    # Only the injected failure: no row was sampled for a slot its request had left.
    failures = [r.getMessage() for r in caplog.records if "sampling failed" in r.getMessage()]
    assert len(failures) == 1 and "None" not in failures[0], failures
    assert generate(ref, "Still serving?", max_tokens=2).stop_reason in ("eog", "max_tokens")


@pytest.mark.parametrize("n", [0, 17, "2", 2.0, None])
def test_n_out_of_range_or_not_an_int_is_refused(server: pykka.ActorRef[Any], n: Any) -> None:
    with pytest.raises(InvalidRequest, match=r"n .completions of the prompt. must be an int from 1 to 16"):
        server.ask(Generate("x", n=n))


def test_text_streams_refuse_several_choices_and_events_carry_them(server: pykka.ActorRef[Any]) -> None:
    with pytest.raises(InvalidRequest, match="n must be 1"):
        next(iter(stream(server, "x", n=2)))
    with pytest.raises(InvalidRequest, match="n must be 1"):
        astream(server, "x", n=2)

    async def run() -> tuple[Any, list[Any]]:
        completions = await agenerate(server, PROMPT, n=2, max_tokens=4, temp=1.0)
        events = [e async for e in astream_events(server, PROMPT, n=3, max_tokens=3, temp=1.0)]
        return completions, events

    completions, events = asyncio.run(run())
    assert isinstance(completions, tuple) and [c.index for c in completions] == [0, 1]
    assert sorted(e.index for e in events if isinstance(e, Done)) == [0, 1, 2]
    assert isinstance(events[-1], Done)
