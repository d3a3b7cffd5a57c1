"""Every sampling option changes what the real model produces, and a server's defaults act
like the same values sent with each request.

Each test would fail if its option were ignored or reached llama.cpp in the wrong place.
None asserts text the model produced on one machine (llama.cpp picks its kernels per CPU):
a test compares two runs of the same server (one slot, no prompt cache, so a repeat is the
same computation), checks the sampled tokens against the log-probabilities of the same
request, or counts over several seeds with a wide margin.
"""

from __future__ import annotations

import json
import math
import queue
import re
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pykka
import pytest
from helpers import MARGIN, NO_EOG, drain

from actors import (
    Completion,
    Done,
    Generate,
    GetTokenizer,
    InvalidRequest,
    ServerActor,
    Stream,
    Token,
    Tokenizer,
    TokenLogprob,
    TopLogprob,
    chat,
    generate,
)

OPEN = "The best way to spend a sunny afternoon is"
"""A prompt with many likely continuations."""
PATTERN = " ".join(["one two three four five"] * 4) + " one two"
"""A prompt whose greedy continuation repeats it: every token it adds is in the prompt."""
ONES = "Repeat: 1111 1111 1111 1111 1111"
QUESTION = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
"""A chat the model answers briefly and ends with an end-of-generation token."""

DIGITS = "root ::= [0-9]{8}"
YES_NO = 'root ::= "yes" | "no"'
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
}

TAIL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
"""Selection over the whole vocabulary: with a high temperature, most picks come from the tail."""
HOT = 10.0
"""A temperature that makes the tokens a filter keeps nearly equally likely."""
EPS = 1e-3
"""Slack for llama.cpp's float32 softmax against the float64 log-probabilities."""


@pytest.fixture(scope="module")
def servers(model_path: str) -> Iterator[Callable[..., pykka.ActorRef[Any]]]:
    """Servers shared by this module's tests, one per set of start options.

    One slot and no prompt cache: every request starts from an empty cache in the same
    batch shape, so running the same request twice is the same computation, token for
    token, on any CPU. A server some test's teardown stopped is started again.
    """
    started: dict[tuple[tuple[str, Any], ...], pykka.ActorRef[Any]] = {}

    def get(**defaults: Any) -> pykka.ActorRef[Any]:
        key = tuple(sorted(defaults.items()))
        ref = started.get(key)
        if ref is None or not ref.is_alive():
            ref = started[key] = ServerActor.start(
                model_path=model_path, n_ctx=2048, n_parallel=1, cache_prompt=False, **defaults
            )
        return ref

    yield get
    for ref in started.values():
        if ref.is_alive():
            ref.stop()


@pytest.fixture
def engine(servers: Callable[..., pykka.ActorRef[Any]]) -> pykka.ActorRef[Any]:
    """The repeatable server with the library's sampling defaults."""
    return servers()


@pytest.fixture
def tokenizer(engine: pykka.ActorRef[Any]) -> Tokenizer:
    tokenizer: Tokenizer = engine.ask(GetTokenizer(), timeout=60)
    return tokenizer


@pytest.fixture(scope="module")
def pattern(servers: Callable[..., pykka.ActorRef[Any]]) -> tuple[list[int], Completion]:
    """PATTERN's tokens and their greedy continuation without penalties (10 tokens)."""
    ref = servers()
    tokenizer: Tokenizer = ref.ask(GetTokenizer(), timeout=60)
    prompt = tokenizer.tokenize(PATTERN)
    return prompt, run(ref, prompt, max_tokens=10, temp=0, logit_bias=NO_EOG)


@pytest.fixture(scope="module")
def repeated_digits(servers: Callable[..., pykka.ActorRef[Any]]) -> Completion:
    """ONES continued greedily under the DIGITS grammar, without penalties."""
    return run(servers(), ONES, max_tokens=12, temp=0, grammar=DIGITS)


def run(ref: pykka.ActorRef[Any], prompt: str | Sequence[int], **options: Any) -> Completion:
    return generate(ref, prompt, timeout=60, **options)


def rank(entry: TokenLogprob) -> int:
    """Where the sampled token stands in its step's top list (``len(top)``: below it)."""
    ids = [t.token_id for t in entry.top]
    return ids.index(entry.token_id) if entry.token_id in ids else len(ids)


def gap(entry: TokenLogprob) -> float:
    """How much less likely than the step's most likely token the sampled one was (nats)."""
    return entry.top[0].logprob - entry.logprob


def mass_above(entry: TokenLogprob) -> float:
    """The probability of the tokens ranked above the sampled one (all the list if it is below)."""
    return sum(math.exp(t.logprob) for t in entry.top[: rank(entry)])


def in_nucleus(entries: Sequence[TokenLogprob], p: float) -> bool:
    """Whether every pick may lie in its step's top-``p`` nucleus, most within the top list.

    The nucleus is the most likely tokens until their mass reaches ``p`` (the last one
    crosses it). A pick below the list fits only where the list holds under ``p``; a
    sampler that ignored ``top_p`` at a high temperature would pick below it nearly always.
    """
    below = sum(rank(e) == len(e.top) for e in entries)
    return all(mass_above(e) < p + EPS for e in entries) and below <= len(entries) // 4


def repeats(history: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of ``tokens`` were already in ``history`` or earlier in ``tokens``."""
    seen = set(history)
    count = 0
    for token in tokens:
        count += token in seen
        seen.add(token)
    return count


def single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = tokenizer.tokenize(text, add_special=False)
    assert len(ids) == 1, f"{text!r} is {ids}"
    return ids[0]


# -- selection: temperature, top-k, top-p, min-p, seed ------------------------------


@pytest.mark.parametrize(
    "options", [{}, {"penalty_repeat": 1.5, "penalty_last_n": 0}], ids=["numpy", "llama.cpp-chain"]
)
def test_temp_0_picks_the_argmax_of_its_own_logprobs(
    engine: pykka.ActorRef[Any], options: dict[str, Any]
) -> None:
    # Penalties switched off by penalty_last_n=0 still take llama.cpp's greedy sampler.
    completion = run(engine, OPEN, max_tokens=10, temp=0, logprobs=2, **options)
    assert completion.logprobs is not None and len(completion.logprobs) >= 5
    for entry in completion.logprobs:
        assert entry.token_id == entry.top[0].token_id
        assert entry.logprob == entry.top[0].logprob


def test_temperature_scales_how_far_samples_stray_from_the_argmax(engine: pykka.ActorRef[Any]) -> None:
    cold = run(engine, OPEN, max_tokens=10, temp=0.05, seed=1, logprobs=20, **TAIL)
    hot = run(engine, OPEN, max_tokens=10, temp=3.0, seed=1, logprobs=20, **TAIL)
    assert cold.logprobs is not None and hot.logprobs is not None
    assert len(cold.logprobs) >= 5 and len(hot.logprobs) >= 5
    # At temp 0.05 a token 0.5 nats behind the argmax is e^-10 times as likely: only
    # near-ties may go either way.
    assert all(gap(e) < 0.5 for e in cold.logprobs)
    # At temp 3 over the whole vocabulary most picks are over 5x less likely than the
    # argmax (what min_p=0.2 drops) and below the 20 most likely tokens.
    assert sum(gap(e) > math.log(5) for e in hot.logprobs) >= len(hot.logprobs) // 2
    assert sum(rank(e) == len(e.top) for e in hot.logprobs) >= len(hot.logprobs) // 2


def test_top_k_1_at_a_high_temperature_is_greedy(engine: pykka.ActorRef[Any]) -> None:
    greedy = run(engine, OPEN, max_tokens=10, temp=0)
    top1 = run(engine, OPEN, max_tokens=10, temp=HOT, top_k=1, top_p=1.0, min_p=0.0, seed=1, logprobs=1)
    assert top1.token_ids == greedy.token_ids
    assert top1.logprobs is not None and all(rank(e) == 0 for e in top1.logprobs)


def test_top_k_keeps_the_k_most_likely_tokens(engine: pykka.ActorRef[Any]) -> None:
    ranks = []
    for seed in (1, 2):
        completion = run(
            engine, OPEN, max_tokens=10, temp=HOT, top_k=3, top_p=1.0, min_p=0.0, seed=seed, logprobs=5
        )
        assert completion.logprobs is not None
        ranks += [rank(e) for e in completion.logprobs]
    # Nearly uniform over the top 3: each rank comes up, none beyond.
    assert set(ranks) == {0, 1, 2}, ranks


def test_a_tiny_top_p_or_a_min_p_of_1_keeps_only_the_most_likely_token(engine: pykka.ActorRef[Any]) -> None:
    for options in ({"top_p": 0.01, "min_p": 0.0}, {"top_p": 1.0, "min_p": 1.0}):
        completion = run(engine, OPEN, max_tokens=8, temp=HOT, top_k=0, seed=1, logprobs=1, **options)
        assert completion.logprobs is not None and len(completion.logprobs) >= 5
        assert all(rank(e) == 0 for e in completion.logprobs), options


def test_top_p_samples_only_from_the_nucleus(engine: pykka.ActorRef[Any]) -> None:
    entries: list[TokenLogprob] = []
    for seed in (1, 2):
        completion = run(
            engine, OPEN, max_tokens=10, temp=HOT, top_k=0, top_p=0.6, min_p=0.0, seed=seed, logprobs=20
        )
        assert completion.logprobs is not None
        entries += completion.logprobs
    assert in_nucleus(entries, 0.6), [(rank(e), round(mass_above(e), 3)) for e in entries]
    assert sum(rank(e) > 0 for e in entries) >= 4  # more than the top token is kept


def test_min_p_samples_only_tokens_near_the_most_likely(engine: pykka.ActorRef[Any]) -> None:
    entries: list[TokenLogprob] = []
    for seed in (1, 2):
        completion = run(
            engine, OPEN, max_tokens=10, temp=HOT, top_k=0, top_p=1.0, min_p=0.2, seed=seed, logprobs=20
        )
        assert completion.logprobs is not None
        entries += completion.logprobs
    # min_p=0.2 keeps the tokens at least 1/5 as likely as the most likely one.
    assert all(gap(e) <= math.log(5) + EPS for e in entries), [round(gap(e), 3) for e in entries]
    assert sum(rank(e) > 0 for e in entries) >= 4


def test_post_sampling_probs_are_the_distribution_the_chain_drew_from(engine: pykka.ActorRef[Any]) -> None:
    options = {
        "max_tokens": 8,
        "temp": 1.0,
        "top_k": 5,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 3,
        "logprobs": 10,
    }
    raw = run(engine, OPEN, **options)
    post = run(engine, OPEN, **options, post_sampling_probs=True)
    assert post.token_ids == raw.token_ids  # the same draws: only what is reported differs
    assert raw.logprobs is not None and post.logprobs is not None
    for before, after in zip(raw.logprobs, post.logprobs, strict=True):
        # top_k=5 kept five tokens; at temperature 1 their probabilities are the raw
        # softmax renormalized over them, and they are all there is.
        kept = before.top[:5]
        norm = math.log(sum(math.exp(t.logprob) for t in kept))
        assert {t.token_id: pytest.approx(t.logprob - norm, abs=EPS) for t in kept} == {
            t.token_id: t.logprob for t in after.top
        }
        assert sum(math.exp(t.logprob) for t in after.top) == pytest.approx(1.0, abs=EPS)
        assert after.logprob == next(t.logprob for t in after.top if t.token_id == after.token_id)
    greedy = run(engine, OPEN, max_tokens=3, temp=0, logprobs=5, post_sampling_probs=True)
    assert greedy.logprobs is not None
    for entry in greedy.logprobs:  # one-hot
        assert entry.logprob == 0.0 and [(t.token_id, t.logprob) for t in entry.top] == [
            (entry.token_id, 0.0)
        ]
    with pytest.raises(InvalidRequest, match="post_sampling_probs needs logprobs"):
        Generate(OPEN, post_sampling_probs=True)
    with pytest.raises(InvalidRequest, match="post_sampling_probs must be a bool"):
        Generate(OPEN, logprobs=1, post_sampling_probs=1)  # type: ignore[arg-type]


def test_a_seed_makes_sampling_repeatable_and_seeds_differ(engine: pykka.ActorRef[Any]) -> None:
    def sample(seed: int | None) -> tuple[int, ...]:
        return run(engine, OPEN, max_tokens=6, temp=1.5, seed=seed, **TAIL).token_ids

    assert sample(1) == sample(1)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) >= 3
    assert sample(None) != sample(None)  # no seed: a fresh random one per request


def test_the_largest_seed_is_repeatable_too(engine: pykka.ActorRef[Any]) -> None:
    first = run(engine, OPEN, max_tokens=8, temp=1.5, seed=2**32 - 2, **TAIL)
    assert run(engine, OPEN, max_tokens=8, temp=1.5, seed=2**32 - 2, **TAIL).token_ids == first.token_ids
    # 2**32 - 1 is llama.cpp's "draw a random seed": refused rather than silently random.
    with pytest.raises(InvalidRequest, match="seed"):
        Generate("x", seed=2**32 - 1)


def test_a_tiny_temperature_is_greedy(engine: pykka.ActorRef[Any]) -> None:
    greedy = run(engine, OPEN, max_tokens=8, temp=0)
    assert run(engine, OPEN, max_tokens=8, temp=1e-38, seed=1, **TAIL).token_ids == greedy.token_ids


# -- repetition penalties -------------------------------------------------------------


@pytest.mark.parametrize(
    "penalty",
    [{"penalty_repeat": 1.5}, {"penalty_freq": 2.0}, {"penalty_present": 3.0}],
    ids=lambda p: next(iter(p)),
)
def test_a_penalty_breaks_a_repetitive_greedy_continuation(
    engine: pykka.ActorRef[Any], pattern: tuple[list[int], Completion], penalty: dict[str, float]
) -> None:
    prompt, plain = pattern
    penalized = run(engine, prompt, max_tokens=10, temp=0, logit_bias=NO_EOG, **penalty)
    assert repeats(prompt, plain.token_ids) >= 8  # the model continues the pattern
    assert repeats(prompt, penalized.token_ids) <= 3


@pytest.mark.parametrize(
    ("last_n", "pattern_kept"),
    [(0, True), (3, True), (64, False), (-1, False)],
    ids=["0-off", "3-shorter-than-the-period", "64", "-1-whole-context"],
)
def test_penalty_last_n_is_the_window_the_penalty_sees(
    engine: pykka.ActorRef[Any], pattern: tuple[list[int], Completion], last_n: int, pattern_kept: bool
) -> None:
    prompt, plain = pattern
    penalized = run(
        engine, prompt, max_tokens=10, temp=0, logit_bias=NO_EOG, penalty_repeat=1.5, penalty_last_n=last_n
    )
    if last_n == 0:
        assert penalized.token_ids == plain.token_ids  # off: the same tokens
    elif pattern_kept:
        # The pattern's next token is 5 back, outside a window of 3: the pattern goes on.
        assert repeats(prompt, penalized.token_ids) >= 8
    else:
        assert repeats(prompt, penalized.token_ids) <= 3


def _greedy_picks(
    top: Sequence[TopLogprob], counts: Counter[int], per_count: float, per_token: float
) -> set[int]:
    """The tokens greedy may pick once each token's log-probability loses ``per_count`` for
    every time it occurs in ``counts`` and ``per_token`` if it occurs at all: the best and
    those within a near-tie of it."""
    values = {
        t.token_id: t.logprob - per_count * counts[t.token_id] - per_token * (counts[t.token_id] > 0)
        for t in top
    }
    best = max(values.values())
    # Penalties only lower values: a token below the list cannot come near the best.
    assert best > top[-1].logprob + MARGIN
    return {token for token, value in values.items() if value > best - MARGIN}


def test_frequency_and_presence_penalties_subtract_per_occurrence_and_once(
    engine: pykka.ActorRef[Any], pattern: tuple[list[int], Completion]
) -> None:
    prompt = pattern[0]  # each of its words 4 or 5 times
    counts = Counter(prompt)
    first = run(engine, prompt, max_tokens=1, temp=0, logprobs=20).logprobs
    assert first is not None
    top = first[0].top
    # A value at which subtracting it per occurrence and subtracting it once pick apart.
    value, freq_picks, present_picks = next(
        (v, f, p)
        for v in (0.5, 1.0, 1.5, 2.0, 3.0)
        if not (f := _greedy_picks(top, counts, v, 0.0)) & (p := _greedy_picks(top, counts, 0.0, v))
    )
    by_freq = run(engine, prompt, max_tokens=1, temp=0, penalty_freq=value)
    by_presence = run(engine, prompt, max_tokens=1, temp=0, penalty_present=value)
    assert by_freq.token_ids[0] in freq_picks
    assert by_presence.token_ids[0] in present_picks


@pytest.mark.subprocess
@pytest.mark.skipif(sys.platform != "linux", reason="bounds the address space with RLIMIT_AS")
def test_a_huge_penalty_last_n_does_not_abort_the_process(model_path: str) -> None:
    # In a subprocess with 4 GB of address space, so the buffer fails at once instead of
    # zeroing 8 GB of this machine's memory.
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from actors import InvalidRequest, ServerActor, generate
        ref = ServerActor.start(model_path={model_path!r}, n_ctx=512, n_parallel=1)
        try:
            generate(ref, "one two one two", max_tokens=2, temp=0, penalty_repeat=1.5,
                     penalty_last_n=2**31 - 1, timeout=60)
        except InvalidRequest:
            pass
        assert generate(ref, "Still serving", max_tokens=2, temp=0, timeout=60).generated_tokens
        ref.stop()
        print("served")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and "served" in done.stdout, done.stderr[-1000:]


# -- logit bias -------------------------------------------------------------------------

PATHS = {
    "greedy": {"temp": 0},
    "greedy-with-penalty": {"temp": 0, "penalty_present": 0.5},
    "sampled": {"temp": 1.0, "seed": 1},
}


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_a_large_positive_bias_forces_its_token(
    engine: pykka.ActorRef[Any], tokenizer: Tokenizer, path: dict[str, Any]
) -> None:
    banana = single_token(tokenizer, " banana")
    completion = run(engine, OPEN, max_tokens=4, logit_bias={banana: 100.0}, **path)
    assert completion.token_ids == (banana,) * 4


@pytest.mark.parametrize("path", [*PATHS.values(), {"temp": 1.0, "seed": 2}], ids=[*PATHS, "sampled-2"])
def test_a_minus_inf_bias_bans_its_tokens(
    engine: pykka.ActorRef[Any], pattern: tuple[list[int], Completion], path: dict[str, Any]
) -> None:
    prompt = pattern[0]
    banned = set(prompt)
    bias = {token: -math.inf for token in banned} | NO_EOG
    completion = run(engine, prompt, max_tokens=8, logit_bias=bias, logprobs=20, **path)
    assert completion.generated_tokens == 8 and completion.logprobs is not None
    assert not banned & set(completion.token_ids)
    # The raw log-probabilities show what the ban took away: the pattern's next word
    # was the model's favourite, and the banned words most of the probability.
    first = completion.logprobs[0].top
    assert first[0].token_id in banned
    assert sum(math.exp(t.logprob) for t in first if t.token_id in banned) > 0.5


# -- grammar and JSON Schema ----------------------------------------------------------


@pytest.mark.parametrize("path", [{"temp": 0}, {"temp": 1.0, "seed": 1}], ids=["greedy", "sampled"])
def test_a_grammar_decides_the_text(engine: pykka.ActorRef[Any], path: dict[str, Any]) -> None:
    digits = run(engine, OPEN, max_tokens=12, grammar=DIGITS, **path)
    assert re.fullmatch("[0-9]{8}", digits.text) and digits.stop_reason == "eog"
    answer = run(engine, "Is the sky blue? Answer:", max_tokens=4, grammar=YES_NO, **path)
    assert answer.text in ("yes", "no") and answer.stop_reason == "eog"


@pytest.mark.parametrize("path", [{"temp": 0}, {"temp": 1.0, "seed": 1}], ids=["greedy", "sampled"])
def test_json_schema_output_is_valid_under_the_schema(
    engine: pykka.ActorRef[Any], path: dict[str, Any]
) -> None:
    completion = run(engine, "A JSON object:", max_tokens=48, json_schema=SCHEMA, **path)
    assert completion.stop_reason == "eog"
    document = json.loads(completion.text)
    assert set(document) == {"color", "n"}
    assert document["color"] in ("red", "green", "blue") and type(document["n"]) is int


CODE = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
DOTS = {
    "type": "object",
    "properties": {"code": {"type": "string", "pattern": "^a.*$"}},
    "required": ["code"],
}


@pytest.mark.parametrize("schema", [CODE, DOTS], ids=["string", "pattern"])
def test_a_json_schema_string_never_holds_a_raw_control_character(
    engine: pykka.ActorRef[Any], tokenizer: Tokenizer, schema: dict[str, Any]
) -> None:
    # Every token with a control character in it pushed far above the rest: a string
    # rule that admits one (llama-cpp-python's converter does) lets the model write a
    # raw newline inside the string, and the document is not JSON.
    control = {
        t: 100.0
        for t in range(tokenizer.n_vocab)
        if any(b < 0x20 or b == 0x7F for b in tokenizer.token_bytes(t)) and t not in tokenizer.eog_token_ids
    }
    assert len(control) > 10
    completion = run(
        engine, "Python code that prints pi:", max_tokens=24, temp=0, json_schema=schema, logit_bias=control
    )
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in completion.text), completion.text
    # The grammar's object (its spaces optional: the model's choice on each CPU).
    assert re.match(r'\{ ?"code" ?: ?"', completion.text), completion.text


@pytest.mark.parametrize(
    "penalty",
    [{"penalty_present": 50.0}, {"penalty_freq": 50.0}, {"penalty_repeat": 3.0}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_apply_within_a_grammar(
    engine: pykka.ActorRef[Any], tokenizer: Tokenizer, repeated_digits: Completion, penalty: dict[str, float]
) -> None:
    assert tokenizer.tokenize("0123456789", add_special=False) == list(range(32, 42))  # a token a digit
    plain = repeated_digits
    penalized = run(engine, ONES, max_tokens=12, temp=0, grammar=DIGITS, **penalty)
    assert re.fullmatch("[0-9]{8}", plain.text) and re.fullmatch("[0-9]{8}", penalized.text)
    assert len(set(plain.text)) <= 3  # the prompt's 1s come back
    assert len(set(penalized.text)) >= 6


@pytest.mark.parametrize("seed", [1, 2])
def test_sampling_with_a_grammar_and_logit_bias(
    engine: pykka.ActorRef[Any], tokenizer: Tokenizer, seed: int
) -> None:
    grammar = "root ::= [0-9]{6}"
    low_digits = {token: -math.inf for token in tokenizer.tokenize("12345", add_special=False)}
    letter = single_token(tokenizer, "x")
    plain = run(engine, ONES, max_tokens=8, temp=1.0, seed=seed, grammar=grammar)
    assert re.fullmatch("[0-9]{6}", plain.text) and set(plain.text) & set("12345")
    # Bans hold, and a token the grammar forbids gains nothing from its bias.
    banned = run(
        engine,
        ONES,
        max_tokens=8,
        temp=1.0,
        seed=seed,
        grammar=grammar,
        logit_bias=low_digits | {letter: 100.0},
    )
    assert re.fullmatch("[06789]{6}", banned.text), banned.text
    seven = single_token(tokenizer, "7")
    boosted = run(engine, ONES, max_tokens=8, temp=1.0, seed=seed, grammar=grammar, logit_bias={seven: 100.0})
    assert boosted.text == "777777"


# -- stop, min_tokens, ignore_eos, max_tokens -------------------------------------------


def test_a_stop_string_ends_the_text_before_it(engine: pykka.ActorRef[Any]) -> None:
    plain = run(engine, OPEN, max_tokens=12, temp=0, logit_bias=NO_EOG)
    middle = len(plain.text) // 2
    stop = plain.text[middle : middle + 4]
    stopped = run(engine, OPEN, max_tokens=12, temp=0, logit_bias=NO_EOG, stop=["\x00never", stop])
    assert stopped.stop_reason == "stop" and stopped.stop_string == stop
    assert stopped.text == plain.text[: plain.text.find(stop)]
    assert stopped.generated_tokens < plain.generated_tokens
    unmatched = run(engine, OPEN, max_tokens=12, temp=0, logit_bias=NO_EOG, stop=["\x00never"])
    assert unmatched.stop_reason == "max_tokens" and unmatched.text == plain.text


@pytest.mark.parametrize("path", [{"temp": 0}, {"temp": 0.3, "seed": 1}], ids=["greedy", "sampled"])
def test_min_tokens_and_ignore_eos_postpone_the_end(
    engine: pykka.ActorRef[Any], path: dict[str, Any]
) -> None:
    plain = chat(engine, QUESTION, max_tokens=32, timeout=60, **path)
    assert plain.stop_reason == "eog"
    n = plain.generated_tokens
    longer = chat(engine, QUESTION, max_tokens=n + 6, min_tokens=n + 3, logprobs=1, timeout=60, **path)
    assert longer.generated_tokens >= n + 3
    endless = chat(engine, QUESTION, max_tokens=n + 4, ignore_eos=True, timeout=60, **path)
    assert endless.generated_tokens == n + 4 and endless.stop_reason == "max_tokens"
    if path["temp"] == 0:
        # Only the end was banned: the same picks, and where the plain run ended the
        # model's favourite is still the end-of-generation token.
        assert longer.token_ids[:n] == endless.token_ids[:n] == plain.token_ids
        assert longer.logprobs is not None and longer.logprobs[n].top[0].token_id in NO_EOG


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_is_the_number_of_tokens_generated(engine: pykka.ActorRef[Any], max_tokens: int) -> None:
    completion = run(engine, OPEN, max_tokens=max_tokens, temp=0, logit_bias=NO_EOG)
    assert completion.generated_tokens == len(completion.token_ids) == max_tokens
    assert completion.stop_reason == "max_tokens"


# -- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [{"temp": 0}, {"temp": 3.0, "seed": 1, **TAIL}], ids=["greedy", "sampled"])
def test_logprobs_are_consistent(engine: pykka.ActorRef[Any], path: dict[str, Any]) -> None:
    completion = run(engine, OPEN, max_tokens=8, logprobs=5, **path)
    assert completion.logprobs is not None
    assert [e.token_id for e in completion.logprobs] == list(completion.token_ids)
    for entry in completion.logprobs:
        values = [t.logprob for t in entry.top]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values) and entry.logprob <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        if entry.token_id in [t.token_id for t in entry.top]:
            assert entry.logprob == entry.top[rank(entry)].logprob
        else:
            assert entry.logprob <= values[-1]
    bare = run(engine, OPEN, max_tokens=8, logprobs=0, **path)
    assert bare.logprobs is not None and all(e.top == () for e in bare.logprobs)
    assert [e.logprob for e in bare.logprobs] == [e.logprob for e in completion.logprobs]
    assert run(engine, OPEN, max_tokens=2, **path).logprobs is None


def test_logprobs_are_the_models_before_any_bias(engine: pykka.ActorRef[Any], tokenizer: Tokenizer) -> None:
    banana = single_token(tokenizer, " banana")
    completion = run(engine, OPEN, max_tokens=3, temp=0, logprobs=1, logit_bias={banana: 100.0})
    assert completion.logprobs is not None
    for entry in completion.logprobs:
        assert (
            entry.token_id == banana
            and entry.top[0].token_id != banana
            and entry.logprob < entry.top[0].logprob
        )


def test_stream_and_chat_take_the_same_options(engine: pykka.ActorRef[Any]) -> None:
    options: dict[str, Any] = {"max_tokens": 6, "temp": 1.0, "seed": 3, "logprobs": 2, "logit_bias": NO_EOG}
    generated = run(engine, OPEN, **options)
    events: queue.Queue[Any] = queue.Queue()
    engine.tell(Stream(OPEN, reply_to=events, **options))
    *tokens, done = drain(events)
    assert isinstance(done, Done) and all(isinstance(t, Token) for t in tokens)
    assert tuple(t.token_id for t in tokens) == generated.token_ids == done.completion.token_ids
    assert tuple(t.logprob for t in tokens) == generated.logprobs
    answer = chat(
        engine, [{"role": "user", "content": "Is the sky blue?"}], grammar=YES_NO, temp=1.0, timeout=60
    )
    assert answer.text in ("yes", "no")


# -- server defaults --------------------------------------------------------------------

NEUTRAL: dict[str, Any] = {
    "temp": 0.0,
    **TAIL,
    "seed": 1,
    "penalty_last_n": 64,
    "penalty_repeat": 1.0,
    "penalty_freq": 0.0,
    "penalty_present": 0.0,
}
"""Request values that leave every sampling option out of the way (greedy, no filter)."""

DEFAULTS: dict[str, Any] = {
    "temp": 0.0,
    "top_k": 2,
    "top_p": 0.5,
    "min_p": 0.3,
    "seed": 4321,
    "penalty_last_n": 3,
    "penalty_repeat": 1.1,
    "penalty_freq": 2.0,
    "penalty_present": 3.0,
}
"""A server's sampling defaults, each unlike the library's."""


def _pattern_kept(history: Sequence[int], completion: Completion) -> bool:
    return repeats(history, completion.token_ids) >= len(completion.token_ids) - 1


@dataclass(frozen=True)
class DefaultCase:
    """How to see a server default ``option``: a request that leaves only it unset, the
    value that overrides it, and what it does (``None``: the tokens differ)."""

    option: str
    override: Any
    base: dict[str, Any]
    prompt: str
    shows: Callable[[Sequence[int], Completion], bool] | None


def _all_argmax(_: Sequence[int], c: Completion) -> bool:
    return all(rank(e) == 0 for e in c.logprobs or ())


DEFAULT_CASES = [
    DefaultCase("temp", HOT, {}, OPEN, _all_argmax),
    DefaultCase("top_k", 0, {"temp": HOT}, OPEN, lambda _, c: all(rank(e) < 2 for e in c.logprobs or ())),
    DefaultCase(
        "top_p",
        1.0,
        {"temp": HOT},
        OPEN,
        lambda _, c: in_nucleus(c.logprobs or (), 0.5),
    ),
    DefaultCase(
        "min_p",
        0.0,
        {"temp": HOT},
        OPEN,
        lambda _, c: all(gap(e) <= -math.log(0.3) + EPS for e in c.logprobs or ()),
    ),
    DefaultCase("seed", 1, {"temp": 1.5}, OPEN, None),
    DefaultCase("penalty_last_n", 64, {"penalty_repeat": 1.5}, PATTERN, _pattern_kept),
    DefaultCase("penalty_repeat", 1.0, {}, PATTERN, lambda h, c: not _pattern_kept(h, c)),
    DefaultCase("penalty_freq", 0.0, {}, PATTERN, lambda h, c: not _pattern_kept(h, c)),
    DefaultCase("penalty_present", 0.0, {}, PATTERN, lambda h, c: not _pattern_kept(h, c)),
]


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=[c.option for c in DEFAULT_CASES])
def test_a_server_default_acts_like_the_request_value_and_a_request_overrides_it(
    servers: Callable[..., pykka.ActorRef[Any]], case: DefaultCase
) -> None:
    ref = servers(**DEFAULTS)
    tokenizer: Tokenizer = ref.ask(GetTokenizer(), timeout=60)
    prompt = tokenizer.tokenize(case.prompt)
    request = {k: v for k, v in (NEUTRAL | case.base).items() if k != case.option}
    request |= {"max_tokens": 6, "logprobs": 20}
    inherited = run(ref, prompt, **request)
    explicit = run(ref, prompt, **request, **{case.option: DEFAULTS[case.option]})
    overridden = run(ref, prompt, **request, **{case.option: case.override})
    assert inherited.token_ids == explicit.token_ids
    assert inherited.token_ids != overridden.token_ids
    if case.shows is not None:
        assert case.shows(prompt, inherited) and not case.shows(prompt, overridden)


def test_a_server_started_with_penalty_repeat_serves_and_penalizes(
    servers: Callable[..., pykka.ActorRef[Any]],
) -> None:
    ref = servers(penalty_repeat=1.1)
    tokenizer: Tokenizer = ref.ask(GetTokenizer(), timeout=60)
    prompt = tokenizer.tokenize(PATTERN)
    assert run(ref, prompt, max_tokens=4).generated_tokens >= 1  # every other option the library's
    penalized = run(ref, prompt, max_tokens=8, temp=0, logit_bias=NO_EOG)
    plain = run(ref, prompt, max_tokens=8, temp=0, logit_bias=NO_EOG, penalty_repeat=1.0)
    assert repeats(prompt, plain.token_ids) >= 7 and repeats(prompt, penalized.token_ids) <= 3


def test_a_server_default_grammar_holds_until_a_request_brings_its_own(
    servers: Callable[..., pykka.ActorRef[Any]],
) -> None:
    ref = servers(grammar=DIGITS)
    assert re.fullmatch("[0-9]{8}", run(ref, OPEN, max_tokens=12).text)
    assert re.fullmatch("[0-9]{8}", run(ref, OPEN, max_tokens=12, temp=0).text)
    assert run(ref, "Is the sky blue? Answer:", max_tokens=4, grammar=YES_NO).text in ("yes", "no")
    document = json.loads(run(ref, "A JSON object:", max_tokens=48, temp=0, json_schema=SCHEMA).text)
    assert set(document) == {"color", "n"}
