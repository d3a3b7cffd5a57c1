"""The resumable streams' ring (``_replay``) and registry (``_replays``), without a
server: byte offsets over whole events, readers that follow, the bounds and who may
evict whom, the time to live. Each test runs its own event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.responses import Response

from actors.http._errors import HttpError
from actors.http._replay import Phase, Replay
from actors.http._replays import MAX_ID_CHARS, Replays, check_conv_id
from actors.http._settings import ResumeBounds

pytestmark = pytest.mark.timeout(20)


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(test())  # type: ignore[arg-type]


def ring(max_bytes: int = 1024, max_events: int = 100) -> Replay:
    return Replay("c", "", "client", max_bytes=max_bytes, max_events=max_events, on_idle=lambda r: None)


async def read_all(replay: Replay, offset: int) -> bytes:
    return b"".join([chunk async for chunk in replay.follow(offset, lambda at: b"LOST %d" % at)])


def test_the_ring_drops_whole_events_past_its_bounds_and_keeps_the_newest() -> None:
    async def test() -> None:
        replay = ring(max_bytes=1024, max_events=3)
        for i in range(5):
            replay.append(b"%d" % i * 100)
        assert (replay.first, replay.end) == (200, 500)  # the three newest events
        assert replay.kept(250) == b"2" * 50 + b"3" * 100 + b"4" * 100  # mid-event offsets slice
        replay.append(b"x" * 2000)  # larger than max_bytes alone: kept, alone
        assert (replay.first, replay.end) == (500, 2500)

    run(test)


def test_readers_follow_from_their_offset_to_the_end_and_one_behind_is_told() -> None:
    async def test() -> None:
        replay = ring(max_bytes=1024, max_events=4)
        replay.enter(Phase.STREAMING)
        replay.append(b"data: 0\n\n")
        early = asyncio.ensure_future(read_all(replay, 0))
        late = asyncio.ensure_future(read_all(replay, 3))
        await asyncio.sleep(0)
        assert replay.readers == 2
        replay.append(b"data: 1\n\n")
        replay.enter(Phase.DONE)
        assert await early == b"data: 0\n\ndata: 1\n\n"
        assert await late == b"a: 0\n\ndata: 1\n\n"
        assert replay.readers == 0

        behind = ring(max_bytes=1024, max_events=1)
        behind.enter(Phase.STREAMING)
        behind.append(b"a")
        behind.append(b"b")
        assert await read_all(behind, 0) == b"LOST 0"

    run(test)


def test_a_stream_that_fails_before_its_first_event_ends_its_readers_with_the_error() -> None:
    async def test() -> None:
        replay = ring()
        reader = asyncio.ensure_future(read_all(replay, 0))
        await asyncio.sleep(0)
        replay.fail(Response(b'{"error":{"code":503}}', status_code=503))
        assert await reader == b'data: {"error":{"code":503}}\n\n'
        assert replay.phase is Phase.FAILED

    run(test)


def test_conversation_ids_are_checked() -> None:
    assert (
        check_conv_id("conv-1::ggml-org/tinygemma3-GGUF:Q8_0", "X") == "conv-1::ggml-org/tinygemma3-GGUF:Q8_0"
    )
    for bad in ("", "a b", "tab\there", "é", "x" * (MAX_ID_CHARS + 1), "nul\x00"):
        with pytest.raises(HttpError) as caught:
            check_conv_id(bad, "X-Conversation-Id")
        assert caught.value.status == 400 and "X-Conversation-Id must be 1 to 256" in caught.value.message


def _ended(replays: Replays, owner: str, conv_id: str, client: str) -> Replay:
    replay = replays.open(owner, conv_id, client)
    replay.enter(Phase.STREAMING)
    replay.append(b"data: x\n\n")
    replay.enter(Phase.DONE)
    return replay


def test_a_client_at_its_bound_evicts_its_own_oldest_ended_stream_never_a_live_one() -> None:
    async def test() -> None:
        replays = Replays(ResumeBounds(max_streams=10, max_streams_per_client=2))
        _ended(replays, "", "a1", "A")
        _ended(replays, "", "a2", "A")
        replays.open("", "a3", "A")  # evicts a1, the oldest ended
        assert replays.get("", "a1") is None and replays.get("", "a2") is not None
        replays.open("", "a4", "A")  # evicts a2; a3 and a4 are live
        with pytest.raises(HttpError) as caught:
            replays.open("", "a5", "A")
        assert caught.value.status == 429 and "limit of 2" in caught.value.message
        live = replays.get("", "a4")
        assert live is not None and replays.open("", "a4", "A") is not live  # its own: replaced
        assert live.phase is Phase.STOPPED

    run(test)


def test_a_full_server_evicts_from_the_client_that_keeps_the_most_never_from_a_smaller_one() -> None:
    async def test() -> None:
        replays = Replays(ResumeBounds(max_streams=4, max_streams_per_client=3))
        _ended(replays, "", "b1", "B")
        for i in range(3):
            _ended(replays, "", f"a{i}", "A")
        replays.open("", "c1", "C")  # A keeps the most: its oldest ended goes
        assert replays.get("", "a0") is None and replays.get("", "b1") is not None
        replays.open("", "c2", "C")  # A (2) >= C's 2 after: A's next
        assert replays.get("", "a1") is None and replays.get("", "b1") is not None
        # C keeps 2, would keep 3: neither A (1) nor B (1) keeps as many.
        with pytest.raises(HttpError) as caught:
            replays.open("", "c3", "C")
        assert caught.value.status == 503 and "limit of 4" in caught.value.message
        assert len(replays) == 4

    run(test)


def test_a_new_stream_of_the_same_id_replaces_and_stops_the_old_one_of_that_owner_only() -> None:
    async def test() -> None:
        replays = Replays(ResumeBounds())
        old = replays.open("key#0", "same", "key#0")
        other = replays.open("key#1", "same", "key#1")
        old.producer = asyncio.ensure_future(asyncio.sleep(60))
        new = replays.open("key#0", "same", "key#0")
        await asyncio.sleep(0)
        assert old.phase is Phase.STOPPED and old.producer.cancelled()
        assert replays.get("key#0", "same") is new and replays.get("key#1", "same") is other
        assert replays.get("", "same") is None

    run(test)


def test_an_ended_stream_lives_ttl_after_its_last_reader_left() -> None:
    async def test() -> None:
        replays = Replays(ResumeBounds(ttl_s=0.2))
        replay = _ended(replays, "", "t", "A")
        reader = replay.follow(0, lambda at: b"")
        assert await reader.__anext__() == b"data: x\n\n"  # reading, past the ttl
        await asyncio.sleep(0.3)
        assert replays.get("", "t") is replay
        await reader.aclose()  # the last reader left: the ttl starts again
        await asyncio.sleep(0.1)
        assert replays.get("", "t") is replay
        await asyncio.sleep(0.2)
        assert len(replays) == 0  # the timer dropped it, nobody had to look

    run(test)


def test_a_lookup_finds_an_owners_ids_and_their_per_model_ids_only() -> None:
    async def test() -> None:
        replays = Replays(ResumeBounds())
        exact = replays.open("key#0", "c1", "key#0")
        per_model = replays.open("key#0", "c1::ggml-org/m:Q8_0", "key#0")
        replays.open("key#0", "c10", "key#0")
        replays.open("key#1", "c1", "key#1")
        assert {id(r) for r in replays.owned("key#0", ["c1"])} == {id(exact), id(per_model)}
        assert replays.owned("key#0", ["c"]) == [] and replays.owned("", ["c1"]) == []

    run(test)
