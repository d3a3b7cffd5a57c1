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
from helpers import NO_EOG, Recorder
from test_greedy import compare, reference

from actors import (
    Chat,
    Done,
    EngineStopped,
    Generate,
    GetTokenizer,
    InvalidRequest,
    Stream,
    StreamChat,
    Token,
    Tokenizer,
    chat,
    generate,
    stream,
    stream_chat,
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


def test_stop_string_ends_generation_just_before_it(server: pykka.ActorRef[Any]) -> None:
    full = generate(server, "Once upon a time", max_tokens=30, temp=0).text
    assert full.startswith(", the city of New Haven")
    completion = generate(server, "Once upon a time", max_tokens=30, temp=0, stop=["New", "Haven"])
    assert completion.text == ", the city of "
    assert completion.stop_reason == "stop" and completion.stop_string == "New"


def test_stop_string_spanning_tokens_is_held_back_while_streaming(server: pykka.ActorRef[Any]) -> None:
    stop = "thriving metro"  # three tokens: " thriving", " metro", "polis"
    events = stream_events(
        server, lambda q: Stream("Once upon a time", reply_to=q, max_tokens=40, temp=0, stop=[stop, "zzz"])
    )
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert done.completion.stop_string == stop
    assert done.completion.text == ", the city of New Haven was a "
    assert "".join(t.text for t in tokens) == done.completion.text
    assert [t.token_id for t in tokens] == list(done.completion.token_ids)
    assert tokens[-1].text == ""  # the token that completed the match releases nothing


def test_held_text_is_flushed_on_max_tokens(server: pykka.ActorRef[Any]) -> None:
    # ", the city" ends in " city"; a stop " city of Paris" holds it back, max_tokens ends it.
    pieces = list(stream(server, "Once upon a time", max_tokens=3, temp=0, stop=[" city of Paris"]))
    assert "".join(pieces) == ", the city"


# -- clean UTF-8 ----------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    ["Here are some emoji: 🍣🍣🍣🍣🍣🍣", "日本語の文章を書いてください。東京は"],
    ids=["emoji", "cjk"],
)
def test_streamed_pieces_are_whole_characters_and_join_to_the_text(
    server: pykka.ActorRef[Any], prompt: str
) -> None:
    events = stream_events(server, lambda q: Stream(prompt, reply_to=q, max_tokens=30, temp=0))
    pieces = [e.text for e in events if isinstance(e, Token)]
    text = events[-1].completion.text
    assert "".join(pieces) == text
    assert "\ufffd" not in text
    assert any(ord(ch) > 0x2FFF for ch in text)  # it did produce multi-byte characters
    assert "" in pieces  # ...split over tokens, held until complete


def test_a_character_cut_by_max_tokens_is_flushed_as_replacement(server: pykka.ActorRef[Any]) -> None:
    prompt = "Here are some emoji: 🍣🍣🍣🍣🍣🍣"
    events = stream_events(server, lambda q: Stream(prompt, reply_to=q, max_tokens=2, temp=0))
    text = events[-1].completion.text
    assert text == "\ufffd"  # two of the three bytes of 🍣
    assert "".join(e.text for e in events if isinstance(e, Token)) == text


# -- chat ----------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user"])
def test_greedy_chat_equals_create_chat_completion(
    start_server: StartServer, reference_llama: Any, messages: list[dict[str, str]]
) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = reference_llama
    formatter = Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        eos_token=llm._model.token_get_text(llm.token_eos()),
        bos_token=llm._model.token_get_text(llm.token_bos()),
    )
    prompt = llm.tokenize(formatter(messages=messages).prompt.encode(), add_bos=False, special=True)
    expected, margins = reference(llm, prompt)
    llm.reset()
    text = llm.create_chat_completion(messages, max_tokens=len(expected), temperature=0)["choices"][0][
        "message"
    ]["content"]
    assert text == llm.detokenize(expected).decode()  # our reference is create_chat_completion's path
    ref = start_server(n_parallel=2, flash_attn=False, cache_prompt=False)
    completion = chat(ref, messages, max_tokens=len(expected) or 1, temp=0)
    assert completion.prompt_tokens == len(prompt)
    assert compare(expected, margins, completion.token_ids) >= len(expected) // 2


def test_chat_streams_and_reuses_the_previous_turn(server: pykka.ActorRef[Any]) -> None:
    turn = [{"role": "user", "content": "Tell me about cats."}]
    first = chat(server, turn, max_tokens=40, temp=0)
    turn += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And dogs?"},
    ]
    pieces = list(stream_chat(server, turn, max_tokens=12, temp=0))
    second = chat(server, turn, max_tokens=12, temp=0)
    assert "".join(pieces) == second.text
    assert second.prefix_cache_tokens >= first.prompt_tokens


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
    completion = chat(server, messages, max_tokens=120, temp=temp, seed=7, json_schema=schema)
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
    server = start_server(n_parallel=1, flash_attn=False)  # Llama's kernel, for the numbers
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


def test_logprobs_are_taken_before_sampling_transforms(server: pykka.ActorRef[Any]) -> None:
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
    tokens = [e for e in events if isinstance(e, Token)]
    assert all(t.logprob is not None and t.logprob.top == () for t in tokens)
    assert [t.logprob for t in tokens] == list(events[-1].completion.logprobs)
    assert generate(server, "Hello", max_tokens=2).logprobs is None


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


def test_a_seed_gives_the_same_text_alone_and_beside_others(start_server: StartServer) -> None:
    ref = start_server(n_parallel=4, cache_prompt=False)
    options = {"max_tokens": 24, "temp": 0.9, "seed": 4242}
    alone = generate(ref, "My favourite animal is", **options)
    futures = [ref.ask(Generate(f"Noise {i}:", max_tokens=24, temp=0.9)) for i in range(3)]
    beside = ref.ask(Generate("My favourite animal is", **options)).get(timeout=60)
    for future in futures:
        future.get(timeout=60)
    assert beside.token_ids == alone.token_ids
    assert generate(ref, "My favourite animal is", **{**options, "seed": 4243}).token_ids != alone.token_ids


def test_min_tokens_and_ignore_eos(server: pykka.ActorRef[Any]) -> None:
    chat_prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    short = generate(server, chat_prompt, max_tokens=150, temp=0)
    assert short.stop_reason == "eog" and short.generated_tokens < 100
    n = short.generated_tokens + 10
    longer = generate(server, chat_prompt, max_tokens=150, temp=0, min_tokens=n)
    assert longer.generated_tokens >= n
    endless = generate(server, chat_prompt, max_tokens=60, temp=0, ignore_eos=True)
    assert endless.generated_tokens == 60 and endless.stop_reason == "max_tokens"


def test_stop_strings_are_ignored_until_min_tokens(server: pykka.ActorRef[Any]) -> None:
    full = generate(server, "Once upon a time", max_tokens=12, temp=0).text  # ", the city of New Haven..."
    early = generate(server, "Once upon a time", max_tokens=12, temp=0, stop=[","])
    assert early.text == "" and early.stop_string == ","
    late = generate(server, "Once upon a time", max_tokens=12, temp=0, stop=[","], min_tokens=2)
    assert late.text == full[: len(late.text)] and late.text.startswith(", the")
