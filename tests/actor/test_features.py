"""Per-request features on the default model: stop strings, UTF-8, chat, JSON, logprobs."""

from __future__ import annotations

import json
import math
import queue
import re
import threading
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pykka
import pytest
from helpers import NO_EOG, Recorder, compare, model_formatter, reference, same_greedy

from actors import (
    Chat,
    Completion,
    Done,
    EngineStopped,
    Generate,
    GetTokenizer,
    InvalidRequest,
    Progress,
    Stream,
    StreamChat,
    Token,
    Tokenizer,
    chat,
    generate,
    stream,
)

StartServer = Callable[..., pykka.ActorRef[Any]]


def stream_events(ref: pykka.ActorRef[Any], message_factory: Callable[[queue.Queue[Any]], Any]) -> list[Any]:
    q: queue.Queue[Any] = queue.Queue()
    ref.tell(message_factory(q))
    events = []
    while not events or not isinstance(events[-1], Done):
        events.append(q.get(timeout=60))
    return events


# -- stop strings --------------------------------------------------------------


# Stop strings are picked from what the model said in the same test (its greedy text
# differs between CPUs), on a server where the run with stops repeats it exactly.


def test_stop_string_ends_generation_just_before_it(repeatable_server: pykka.ActorRef[Any]) -> None:
    ref = repeatable_server
    full = generate(ref, "Once upon a time", max_tokens=30, temp=0, logit_bias=NO_EOG)
    text = full.text
    words = text.split()
    assert len(words) >= 8, text
    first = words[3]
    at = text.find(first)
    later = next(w for w in words[4:] if text.find(w) >= at + len(first))  # starts after `first` ends
    completion = generate(
        ref, "Once upon a time", max_tokens=30, temp=0, logit_bias=NO_EOG, stop=[later, first]
    )
    assert completion.text == text[:at]  # the earliest match wins, whatever the list's order
    assert completion.stop_reason == "stop" and completion.stop_string == first
    # Generation ended with the token that completed the match: nothing else changed.
    n = completion.generated_tokens
    assert completion.token_ids == full.token_ids[:n]
    tokenizer = ref.ask(GetTokenizer())
    assert first in tokenizer.detokenize(list(full.token_ids[:n]))
    assert first not in tokenizer.detokenize(list(full.token_ids[: n - 1]))


def held_back(text: str, stops: list[str]) -> str:
    """The longest end of ``text`` that could still become one of ``stops``."""
    return next((text[i:] for i in range(len(text)) if any(s.startswith(text[i:]) for s in stops)), "")


def test_stop_string_spanning_tokens_is_held_back_while_streaming(
    repeatable_server: pykka.ActorRef[Any],
) -> None:
    ref = repeatable_server
    full = generate(ref, "Once upon a time", max_tokens=40, temp=0, logit_bias=NO_EOG)
    tokenizer = ref.ask(GetTokenizer())
    pieces = [tokenizer.detokenize([t]) for t in full.token_ids]

    def spanning(k: int) -> list[str] | None:
        """Stops with one from inside token k to inside token k + 2, if this text allows it."""
        if any("\ufffd" in p for p in pieces[: k + 3]) or min(map(len, pieces[k : k + 3])) < 2:
            return None
        head = "".join(pieces[: k + 1])
        stops = [pieces[k][1:] + pieces[k + 1] + pieces[k + 2][:1], "zzz"]
        first_match = full.text.find(stops[0]) == len(head) - len(pieces[k]) + 1 and "zzz" not in full.text
        return stops if first_match and held_back(head, stops) == pieces[k][1:] else None

    k, stops = next((k, stops) for k in range(2, len(pieces) - 2) if (stops := spanning(k)))
    events = stream_events(
        ref,
        lambda q: Stream(
            "Once upon a time", reply_to=q, max_tokens=40, temp=0, logit_bias=NO_EOG, stop=stops
        ),
    )
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert done.completion.stop_string == stops[0]
    assert done.completion.text == "".join(pieces[:k]) + pieces[k][:1]
    assert "".join(t.text for t in tokens) == done.completion.text
    assert [t.token_id for t in tokens] == list(done.completion.token_ids) == list(full.token_ids[: k + 3])
    assert [t.text for t in tokens[-3:]] == [pieces[k][:1], "", ""]  # held back, then the match


def test_held_text_is_flushed_on_max_tokens(server: pykka.ActorRef[Any]) -> None:
    # A bias makes the model say " city city city"; a stop " city of Paris" holds each
    # " city" back until the next one shows it is no match, and max_tokens ends it.
    (city,) = server.ask(GetTokenizer()).tokenize(" city", add_special=False)
    options = {"max_tokens": 3, "temp": 0, "logit_bias": {city: 100.0}, "stop": [" city of Paris"]}
    events = stream_events(server, lambda q: Stream("Once upon a time", reply_to=q, **options))
    assert [e.text for e in events if isinstance(e, Token)] == ["", " city", " city", " city"]
    assert events[-1].completion.stop_reason == "max_tokens"
    assert events[-1].completion.text == " city city city"
    pieces = list(stream(server, "Once upon a time", **options))
    assert "".join(pieces) == " city city city"


# -- clean UTF-8 ----------------------------------------------------------------


# What the model says is pinned by a grammar or a bias, not left to one CPU's greedy
# text. No token of the vocabulary holds a whole 🍣 or 東: each is split over tokens.


@pytest.mark.parametrize(
    ("prompt", "said"),
    [
        ("Here are some emoji: 🍣🍣🍣🍣🍣🍣", "🍣🍣🍣"),
        ("日本語の文章を書いてください。東京は", "東京は日本の首都です。"),
    ],
    ids=["emoji", "cjk"],
)
def test_streamed_pieces_are_whole_characters_and_join_to_the_text(
    server: pykka.ActorRef[Any], prompt: str, said: str
) -> None:
    grammar = f'root ::= "{said}"'
    events = stream_events(
        server, lambda q: Stream(prompt, reply_to=q, max_tokens=30, temp=0, grammar=grammar)
    )
    pieces = [e.text for e in events if isinstance(e, Token)]
    text = events[-1].completion.text
    assert text == said and events[-1].completion.stop_reason == "eog"
    assert "".join(pieces) == text
    assert "\ufffd" not in text
    assert pieces[0] == ""  # the first token ends inside the first character: held until complete


def test_a_character_cut_by_max_tokens_is_flushed_as_replacement(server: pykka.ActorRef[Any]) -> None:
    tokenizer = server.ask(GetTokenizer())
    lead = tokenizer.tokenize("🍣", add_special=False)[0]  # the first bytes of 🍣
    events = stream_events(
        server,
        lambda q: Stream("Here are some emoji:", reply_to=q, max_tokens=1, temp=0, logit_bias={lead: 100.0}),
    )
    assert events[-1].completion.token_ids == (lead,)
    text = events[-1].completion.text
    assert text == "\ufffd"  # the start of 🍣, never completed
    assert [e.text for e in events if isinstance(e, Token)] == ["", "\ufffd"]  # held, then flushed


# -- chat ----------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user"])
def test_greedy_chat_equals_create_chat_completion(
    start_server: StartServer, reference_llama: Any, messages: list[dict[str, str]]
) -> None:
    llm = reference_llama
    formatter = model_formatter(llm)
    prompt = llm.tokenize(formatter(messages=messages).prompt.encode(), add_bos=False, special=True)
    expected, margins = reference(llm, prompt)
    first_step = log_softmax(llm.scores[len(prompt) - 1])
    llm.reset()
    text = llm.create_chat_completion(messages, max_tokens=len(expected), temperature=0)["choices"][0][
        "message"
    ]["content"]
    # Our reference is create_chat_completion's path (which drops a cut last character).
    assert text == llm.detokenize(expected).decode(errors="ignore")
    ref = start_server(n_parallel=2, cache_prompt=False)
    completion = chat(ref, messages, max_tokens=len(expected) or 1, temp=0, logprobs=5)
    # The same prompt: its length, and the same next-token distribution (a different
    # rendering would move these by far more than float noise).
    assert completion.prompt_tokens == len(prompt)
    assert completion.logprobs
    for top in completion.logprobs[0].top:
        assert top.logprob == pytest.approx(first_step[top.token_id], abs=0.05)
    # Equal tokens where this CPU's floor is zero; elsewhere chat replies open with
    # near-ties (top-2 margins under 0.1 in the first steps here) and only where the two
    # diverge is checked.
    compare(expected, margins, completion.token_ids)


def test_chat_streams_and_reuses_the_previous_turn(server: pykka.ActorRef[Any]) -> None:
    turn = [{"role": "user", "content": "Tell me about cats."}]
    first = chat(server, turn, max_tokens=40, temp=0)
    turn += [
        # Stripped: a reply that opened with a newline would merge with the template's "\n".
        {"role": "assistant", "content": first.text.lstrip()},
        {"role": "user", "content": "And dogs?"},
    ]
    events = stream_events(server, lambda q: StreamChat(turn, reply_to=q, max_tokens=12, temp=0, logprobs=2))
    second = events[-1].completion
    assert "".join(e.text for e in events if isinstance(e, Token)) == second.text
    assert second.prefix_cache_tokens >= first.prompt_tokens
    again = chat(server, turn, max_tokens=12, temp=0)  # reuses the streamed turn, in other batches
    assert again.prefix_cache_tokens == again.prompt_tokens - 1
    same_greedy(second, again.token_ids)


def test_chat_message_variants(server: pykka.ActorRef[Any]) -> None:
    future = server.ask(Chat([{"role": "user", "content": "Hi"}], max_tokens=3, logit_bias=NO_EOG))
    assert future.get(timeout=60).generated_tokens == 3
    events = stream_events(
        server, lambda q: StreamChat([{"role": "user", "content": "Hi"}], reply_to=q, max_tokens=3)
    )
    assert isinstance(events[-1], Done)


# -- structured output -------------------------------------------------------------

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "pet": {"type": "string", "enum": ["cat", "dog", "fish"]},
            "owner": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "adult": {"type": "boolean"}},
                "required": ["city", "adult"],
            },
        },
        "required": ["pet", "owner"],
    },
    {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested-enum", "array"])
@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_json_schema_output_parses_and_validates(
    server: pykka.ActorRef[Any], schema: dict[str, Any], temp: float
) -> None:
    messages = [{"role": "user", "content": "Answer in JSON: describe something."}]
    # Every token is at least one byte, and none of these grammars allows over 170 bytes:
    # whatever the model writes, the JSON closes and only the end may follow.
    completion = chat(server, messages, max_tokens=200, temp=temp, seed=7, json_schema=schema)
    assert completion.stop_reason == "eog", completion
    jsonschema.validate(json.loads(completion.text), schema)


def test_grammar_requests_batch_with_plain_ones(server: pykka.ActorRef[Any]) -> None:
    recorder = Recorder()
    grammar = 'root ::= ("yes" | "no") (", " ("yes" | "no"))*'
    futures = [server.ask(Generate("Will it rain?", max_tokens=30, grammar=grammar, logit_bias=NO_EOG))]
    futures += [server.ask(Generate(f"Story {i}:", max_tokens=30, logit_bias=NO_EOG)) for i in range(2)]
    answer = futures[0].get(timeout=60).text
    assert re.fullmatch(r"(yes|no)(, (yes|no))*(, ?(y|ye|n)?)?", answer), answer
    for future in futures[1:]:
        future.get(timeout=60)
    assert max(m["decode_tokens"] for m, _ in recorder.of("tick")) == 3


def test_a_schema_that_does_not_convert_is_invalid_at_admission(server: pykka.ActorRef[Any]) -> None:
    with pytest.raises(InvalidRequest, match="json_schema"):
        server.ask(Generate("hi", json_schema={"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}))


# -- log-probabilities -----------------------------------------------------------


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def test_logprobs_are_the_log_softmax_of_the_raw_logits(
    start_server: StartServer, reference_llama: Any
) -> None:
    server = start_server(n_parallel=1)
    completion = generate(server, "The capital of France is", max_tokens=6, temp=0, logprobs=5)
    assert completion.logprobs is not None and len(completion.logprobs) == completion.generated_tokens
    for entry, token in zip(completion.logprobs, completion.token_ids, strict=True):
        assert entry.token_id == token
        assert len(entry.top) == 5
        values = [t.logprob for t in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.top[0].token_id == token and entry.top[0].logprob == entry.logprob  # greedy
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6
    llm = reference_llama
    llm.reset()
    prompt = llm.tokenize(b"The capital of France is", add_bos=True, special=True)
    llm.eval(prompt)
    expected = log_softmax(llm.scores[len(prompt) - 1])
    first = completion.logprobs[0]
    assert first.logprob == pytest.approx(expected[first.token_id], abs=0.05)
    for top in first.top:
        assert top.logprob == pytest.approx(expected[top.token_id], abs=0.05)


def test_logprobs_are_taken_before_sampling_transforms(repeatable_server: pykka.ActorRef[Any]) -> None:
    # Both runs are the same computation: the raw numbers agree to the last bit.
    server = repeatable_server
    plain = generate(server, "The capital of France is", max_tokens=1, temp=0, logprobs=2)
    assert plain.logprobs is not None
    favourite = plain.logprobs[0].token_id
    biased = generate(
        server,
        "The capital of France is",
        max_tokens=1,
        temp=0,
        logprobs=2,
        logit_bias={favourite: -math.inf},
    )
    assert biased.logprobs is not None
    assert biased.token_ids[0] != favourite
    assert biased.logprobs[0].top[0].token_id == favourite  # the raw distribution, unbiased
    assert biased.logprobs[0].logprob == pytest.approx(plain.logprobs[0].top[1].logprob, abs=1e-6)


def test_streamed_tokens_carry_logprobs_and_zero_gives_no_alternatives(server: pykka.ActorRef[Any]) -> None:
    events = stream_events(server, lambda q: Stream("Hello", reply_to=q, max_tokens=4, logprobs=0, temp=0))
    completion = events[-1].completion
    tokens = [e for e in events if isinstance(e, Token)]
    n = completion.generated_tokens
    assert len(tokens) - n in (0, 1)  # and one more if a cut last character was flushed
    assert all(t.logprob is not None and t.logprob.top == () for t in tokens[:n])
    assert [t.logprob for t in tokens[:n]] == list(completion.logprobs)
    assert generate(server, "Hello", max_tokens=2).logprobs is None


# -- prefill progress -----------------------------------------------------------------


def test_a_stream_that_asks_gets_its_prefill_progress_before_the_first_token(
    start_server: StartServer,
) -> None:
    server = start_server(n_parallel=1, chunk_size=16)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    for warm in (False, True):  # the second run finds all but the last prompt token cached
        events = stream_events(
            server, lambda q: Stream(prompt, reply_to=q, max_tokens=3, logit_bias=NO_EOG, progress=True)
        )
        done = events[-1].completion
        first_token = next(i for i, e in enumerate(events) if isinstance(e, Token))
        progress = events[:first_token]
        assert all(isinstance(e, Progress) for e in progress)
        assert not any(isinstance(e, Progress) for e in events[first_token:])
        total, cached = done.prompt_tokens, done.prefix_cache_tokens
        assert cached == (total - 1 if warm else 0)
        assert progress[0].processed == cached and progress[0].prefill_ms == 0.0
        assert [p.processed for p in progress] == [*range(cached, total, 16), total]  # one per chunk
        assert all(p.total == total and p.cached == cached for p in progress)
        assert all(p.request_id == done.request_id for p in progress)
        ms = [p.prefill_ms for p in progress]
        assert ms == sorted(ms) and ms[-1] > 0
    plain = stream_events(server, lambda q: Stream(prompt, reply_to=q, max_tokens=3, logit_bias=NO_EOG))
    assert not any(isinstance(e, Progress) for e in plain)
    # The blocking helper yields text only, with or without progress events.
    assert (
        "".join(stream(server, prompt, max_tokens=3, temp=0, progress=True))
        == generate(server, prompt, max_tokens=3, temp=0).text
    )


# -- tokenizer, seeds, min_tokens, ignore_eos -----------------------------------------


def test_tokenizer_runs_in_the_callers_thread(server: pykka.ActorRef[Any], reference_llama: Any) -> None:
    tokenizer = server.ask(GetTokenizer())
    assert isinstance(tokenizer, Tokenizer) and tokenizer.n_vocab == 49152
    text = "<|im_start|>user\nHello, world!<|im_end|>"
    assert tokenizer.tokenize(text) == reference_llama.tokenize(text.encode(), add_bos=True, special=True)
    assert tokenizer.tokenize(text, parse_special=False) != tokenizer.tokenize(text)
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    by_ids = server.ask(Generate("x", max_tokens=1)).get(timeout=60)  # the engine still answers
    assert by_ids.prompt_tokens == len(tokenizer.tokenize("x"))
    with pytest.raises(InvalidRequest):
        tokenizer.detokenize([10**7])


def test_tokenizing_from_many_threads_while_the_engine_decodes(server: pykka.ActorRef[Any]) -> None:
    tokenizer = server.ask(GetTokenizer())
    expected = tokenizer.tokenize("The quick brown fox jumps over the lazy dog. " * 20)
    running = [server.ask(Generate(f"Story {i}:", max_tokens=40, logit_bias=NO_EOG)) for i in range(4)]
    mismatches: list[int] = []

    def work() -> None:
        for _ in range(50):
            if tokenizer.tokenize("The quick brown fox jumps over the lazy dog. " * 20) != expected:
                mismatches.append(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches
    for future in running:
        assert future.get(timeout=60).generated_tokens == 40


def test_a_tokenizer_of_a_stopped_engine_raises(start_server: StartServer) -> None:
    ref = start_server(n_parallel=1)
    tokenizer = ref.ask(GetTokenizer())
    ref.stop()
    with pytest.raises(EngineStopped):
        tokenizer.tokenize("hello")


def assert_same_sample(alone: Completion, beside: Completion) -> None:
    """Seeded samples of one request in two batches: equal, or first different where the
    logits differed and the two picks are neighbours in the ranking (both need logprobs=20).

    The same seed draws the same random numbers, so a pick can only move if llama.cpp's
    floats moved (some CPUs' kernels depend on the batch shape), and a small move shifts
    one boundary of the cumulative distribution: the pick goes to the next token over.
    """
    pairs = enumerate(zip(alone.token_ids, beside.token_ids, strict=False))
    diverged = next((i for i, (a, b) in pairs if a != b), None)
    if diverged is None:
        assert alone.token_ids == beside.token_ids
        return
    assert alone.logprobs is not None and beside.logprobs is not None
    here, there = alone.logprobs[diverged], beside.logprobs[diverged]
    theirs = {t.token_id: t.logprob for t in there.top}
    assert any(theirs.get(t.token_id) != t.logprob for t in here.top), (
        f"step {diverged}: the logits were identical, yet the same seed picked another token"
    )
    ranking = [t.token_id for t in here.top]
    assert here.token_id in ranking and there.token_id in ranking
    assert abs(ranking.index(here.token_id) - ranking.index(there.token_id)) == 1, (
        f"step {diverged}: {here.token_id} and {there.token_id} are not neighbours in {ranking}"
    )


def test_a_seed_gives_the_same_text_alone_and_beside_others(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, cache_prompt=False)
    options = {"max_tokens": 24, "temp": 0.9, "seed": 4242, "logprobs": 20}
    alone = generate(ref, "My favourite animal is", **options)
    futures = [ref.ask(Generate(f"Noise {i}:", max_tokens=24, temp=0.9)) for i in range(3)]
    beside = ref.ask(Generate("My favourite animal is", **options)).get(timeout=60)
    for future in futures:
        future.get(timeout=60)
    assert_same_sample(alone, beside)
    assert generate(ref, "My favourite animal is", **{**options, "seed": 4243}).token_ids != alone.token_ids


# When the model would end is up to the model (and the CPU); a bias on <|im_end|> makes
# it want to end at every step, so min_tokens and ignore_eos alone decide.
END_NOW = {2: 100.0}


def test_min_tokens_and_ignore_eos(server: pykka.ActorRef[Any]) -> None:
    chat_prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    short = generate(server, chat_prompt, max_tokens=150, temp=0, logit_bias=END_NOW)
    assert short.stop_reason == "eog" and short.generated_tokens == 0
    for n in (1, 10):
        longer = generate(server, chat_prompt, max_tokens=150, temp=0, logit_bias=END_NOW, min_tokens=n)
        assert longer.stop_reason == "eog" and longer.generated_tokens == n
        assert not {0, 2, 4} & set(longer.token_ids)
    endless = generate(server, chat_prompt, max_tokens=60, temp=0, logit_bias=END_NOW, ignore_eos=True)
    assert endless.generated_tokens == 60 and endless.stop_reason == "max_tokens"
    sampled = generate(server, chat_prompt, max_tokens=150, temp=0.8, logit_bias=END_NOW, min_tokens=5)
    assert sampled.stop_reason == "eog" and sampled.generated_tokens == 5  # the sampler chain too


def test_stop_strings_are_ignored_until_min_tokens(server: pykka.ActorRef[Any]) -> None:
    # A bias makes every token a ",": the stop matches the first one unless min_tokens says not yet.
    (comma,) = server.ask(GetTokenizer()).tokenize(",", add_special=False)
    options = {"max_tokens": 12, "temp": 0, "logit_bias": {comma: 100.0}, "stop": [","]}
    early = generate(server, "Once upon a time", **options)
    assert early.text == "" and early.stop_string == "," and early.generated_tokens == 1
    late = generate(server, "Once upon a time", **options, min_tokens=2)
    assert late.text == ",," and late.stop_string == "," and late.generated_tokens == 3
