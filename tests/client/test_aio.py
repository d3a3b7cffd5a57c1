"""The asyncio helpers never block the event loop; cancelling a task cancels its request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pykka
import pytest
from helpers import NO_EOG

from actors import (
    Done,
    GetStats,
    InvalidRequest,
    Progress,
    Token,
    achat,
    agenerate,
    astream,
    astream_chat,
    astream_events,
    generate,
)


async def stall_probe(stop: asyncio.Event, stalls: list[float]) -> None:
    """Sleeps 10 ms at a time and records how late each wake-up is."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(0.01)
        stalls.append(loop.time() - t0 - 0.01)


def test_fifty_tasks_on_one_loop_keep_it_responsive(server: pykka.ActorRef[Any]) -> None:
    async def main() -> tuple[list[Any], float]:
        stop, stalls = asyncio.Event(), []
        probe = asyncio.create_task(stall_probe(stop, stalls))
        jobs = [agenerate(server, f"Async {i}", max_tokens=4, logit_bias=NO_EOG) for i in range(50)]
        results = await asyncio.gather(*jobs)
        stop.set()
        await probe
        return results, max(stalls)

    results, worst = asyncio.run(main())
    assert all(r.generated_tokens == 4 for r in results)
    print(f"worst event-loop stall with 50 tasks: {worst * 1000:.1f} ms")
    assert worst < 0.25  # the engine works in its own thread; the loop only moves events


def test_astream_and_chat_variants(repeatable_server: pykka.ActorRef[Any]) -> None:
    server = repeatable_server  # each text is compared with a run of the same computation

    async def main() -> tuple[str, str, Any, str]:
        pieces = [p async for p in astream(server, "Once upon a time", max_tokens=12, temp=0)]
        chat_pieces = [
            p async for p in astream_chat(server, [{"role": "user", "content": "Hi"}], max_tokens=6, temp=0)
        ]
        reply = await achat(server, [{"role": "user", "content": "Hi"}], max_tokens=6, temp=0)
        return "".join(pieces), "".join(chat_pieces), reply, ""

    text, chat_text, reply, _ = asyncio.run(main())
    assert text == generate(server, "Once upon a time", max_tokens=12, temp=0).text
    assert chat_text == reply.text


def test_astream_events_passes_progress_and_the_text_helpers_skip_it(
    repeatable_server: pykka.ActorRef[Any],
) -> None:
    server = repeatable_server
    chat = [{"role": "user", "content": "Hi"}]

    async def main() -> tuple[list[Any], list[Any], str, Any]:
        asked = [e async for e in astream_events(server, messages=chat, max_tokens=4, temp=0, progress=True)]
        plain = [e async for e in astream_events(server, "Hi", max_tokens=2, temp=0)]
        pieces = [p async for p in astream_chat(server, chat, max_tokens=4, temp=0, progress=True)]
        reply = await achat(server, chat, max_tokens=4, temp=0, progress=True)
        return asked, plain, "".join(pieces), reply

    asked, plain, text, reply = asyncio.run(main())
    kinds = [type(e) for e in asked]
    assert kinds[0] is Progress and kinds[-1] is Done and Token in kinds
    assert kinds.index(Token) == kinds.count(Progress)  # every Progress before the first Token
    assert asked[kinds.index(Token) - 1].processed == asked[-1].completion.prompt_tokens
    assert Progress not in [type(e) for e in plain]
    assert text == reply.text == asked[-1].completion.text


def test_cancelling_the_task_cancels_the_request(server: pykka.ActorRef[Any]) -> None:
    async def main() -> None:
        task = asyncio.create_task(agenerate(server, "An endless essay", max_tokens=2000, logit_bias=NO_EOG))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while server.ask(GetStats())["active_slots"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.ask(GetStats())["active_slots"] == 0


def test_errors_reach_the_awaiting_task(server: pykka.ActorRef[Any]) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequest):
            await agenerate(server, "hi", max_tokens=0)
        with pytest.raises(InvalidRequest):
            await agenerate(server, [1, 10**7], max_tokens=2)

    asyncio.run(main())
