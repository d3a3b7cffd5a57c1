"""The stop-string matcher and the UTF-8 text stream, as plain functions (no model)."""

from __future__ import annotations

import pytest

from actors.engine._output import StopMatcher, TextStream


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None]:
    released = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        released.append(text)
        if stop is not None:
            return "".join(released), stop
    return "".join(released) + matcher.flush(), None


@pytest.mark.parametrize(
    ("stops", "pieces", "text", "stop"),
    [
        (["\n\n"], ["Hello", "\n", "\n", "more"], "Hello", "\n\n"),
        (["User:"], ["Hi! U", "se", "r: what"], "Hi! ", "User:"),
        (["ab"], ["a", "a", "b"], "a", "ab"),  # "aab": the second a starts the match
        (["ab"], ["aab"], "a", "ab"),
        (["abc", "bcd"], ["xab", "cd"], "x", "abc"),  # overlapping: the earliest wins
        (["bcd", "abc"], ["xab", "cd"], "x", "abc"),
        (["b", "abc"], ["xabc"], "x", "abc"),  # same start would be abc; abc starts earlier
        (["aaa"], ["a", "a", "x", "a", "a", "a", "z"], "aax", "aaa"),
        (["END"], ["no", " stop", " here"], "no stop here", None),
        (["END"], ["almost EN"], "almost EN", None),  # held, then flushed at the finish
        (["🍣"], ["x", "🍣"], "x", "🍣"),
    ],
)
def test_stop_matcher(stops: list[str], pieces: list[str], text: str, stop: str | None) -> None:
    assert feed_all(StopMatcher(stops), pieces) == (text, stop)


def test_held_text_is_released_as_soon_as_it_cannot_start_a_stop() -> None:
    matcher = StopMatcher(["User:"])
    assert matcher.feed("Hi U") == ("Hi ", None)
    assert matcher.held == "U"
    assert matcher.feed("nder") == ("Under", None)
    assert matcher.held == ""


def sushi_bytes() -> list[bytes]:
    raw = "🍣".encode()
    return [raw[:1], raw[1:3], raw[3:]]


def test_text_stream_never_splits_a_character() -> None:
    stream = TextStream()
    pieces = [stream.push(b) for b in [b"A ", *sushi_bytes(), " 東京".encode()]]
    assert [p for p, _ in pieces] == ["A ", "", "", "🍣", " 東京"]
    assert stream.flush() == ""


def test_bytes_that_never_complete_become_replacement_characters() -> None:
    stream = TextStream()
    assert stream.push(sushi_bytes()[0]) == ("", None)
    assert stream.flush() == "\ufffd"


def test_stop_strings_count_only_after_min_tokens() -> None:
    stream = TextStream(stops=["x"], min_tokens=2)
    assert stream.push(b"x") == ("x", None)
    assert stream.push(b"x") == ("x", None)
    assert stream.push(b"ax") == ("a", "x")


def test_flush_releases_held_text_then_broken_bytes() -> None:
    stream = TextStream(stops=["STOP"])
    assert stream.push(b"go ST") == ("go ", None)
    stream.push(sushi_bytes()[0])
    assert stream.flush() == "ST\ufffd"
