"""Resumable streams over HTTP (llama-server's ``X-Conversation-Id``, ``GET`` and
``DELETE /v1/stream``, ``POST /v1/streams/lookup``) on one server with two API keys and
small bounds: a client that drops goes on generating and gets the same bytes back from
any offset, a stop cancels the engine request (its ``request_done`` says so), another
key's id is unknown, hostile ids and offsets are 400s, and the bounds answer as the docs
say. The model's text is never asserted: a replay is compared with what was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers import wait_until
from http_server import Running, idle

import telemetry
from actors import ServerActor
from actors.http import HttpSettings, ResumeBounds

pytestmark = pytest.mark.timeout(120)

K1 = {"Authorization": "Bearer k1"}
K2 = {"Authorization": "Bearer k2"}
BOUNDS = ResumeBounds(max_events=48, max_streams=8, max_streams_per_client=2, max_readers=2)
LONG = {"prompt": "Tell a long story.", "n_predict": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def running(model_path: str) -> Iterator[Running]:
    with Running.ready(
        HttpSettings(api_keys=("k1", "k2"), resumable=BOUNDS),
        lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=2048, seed=7),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(running: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=running.url, timeout=60) as client:  # one SSL context, not one a request
        yield client


@pytest.fixture(scope="module")
def done() -> Iterator[dict[str, dict[str, Any]]]:
    """Every finished engine request's ``request_done``: its stop reason and tokens."""
    finished: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def on_done(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with lock:
            finished[metadata["request_id"]] = {**measurements, **metadata}

    subscription = telemetry.Subscription({telemetry.request_done: on_done})
    yield finished
    subscription.close()


def post_and_drop(
    client: httpx.Client, path: str, body: dict[str, Any], conv: str, keep: int
) -> tuple[bytes, str]:
    """Start a resumable stream, read at least ``keep`` bytes of it, and hang up (leaving
    a response unread closes its connection)."""
    headers = {**K1, "X-Conversation-Id": conv}
    with client.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        got = b""
        for chunk in response.iter_raw():
            got += chunk
            if len(got) >= keep:
                break
    return got, response.headers["x-request-id"]


def resume(
    client: httpx.Client, conv: str, offset: int | str = 0, headers: dict[str, str] = K1
) -> httpx.Response:
    return client.get("/v1/stream", params={"conv_id": conv, "from": offset}, headers=headers)


def stop(client: httpx.Client, conv: str, headers: dict[str, str] = K1) -> None:
    assert client.delete("/v1/stream", params={"conv_id": conv}, headers=headers).status_code == 204


def test_a_dropped_client_resumes_from_0_and_from_n_with_the_same_bytes(
    running: Running, client: httpx.Client, done: dict[str, dict[str, Any]]
) -> None:
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 32, "ignore_eos": True}
    got, request_id = post_and_drop(client, "/v1/chat/completions", {**body, "stream": True}, "drop", 300)
    assert request_id not in done  # dropped mid-generation...
    wait_until(lambda: request_id in done, seconds=30)
    assert done[request_id]["stop_reason"] == "max_tokens"  # ...which went on to its end
    assert done[request_id]["generated_tokens"] == 32

    whole = resume(client, "drop")  # after the end: the whole stream, as it was sent
    assert whole.status_code == 200 and whole.headers["content-type"] == "text/event-stream"
    assert whole.content.startswith(got) and whole.content.endswith(b"data: [DONE]\n\n")
    rest = resume(client, "drop", len(got))
    assert rest.status_code == 200 and rest.content == whole.content[len(got) :]
    assert resume(client, "drop", len(whole.content)).content == b""
    past = resume(client, "drop", len(whole.content) + 1)
    assert past.status_code == 400 and "past the" in past.json()["error"]["message"]
    found = client.post("/v1/streams/lookup", json={"conversation_ids": ["drop"]}, headers=K1)
    assert [(s["conversation_id"], s["is_done"], s["total_bytes"]) for s in found.json()] == [
        ("drop", True, len(whole.content))
    ]
    stop(client, "drop")
    assert resume(client, "drop").status_code == 404


def test_every_streaming_endpoint_is_resumable_and_a_failure_keeps_nothing(
    running: Running, client: httpx.Client
) -> None:
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    bodies = {
        "/completion": {"prompt": "Hello", "n_predict": 4},
        "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
        "/v1/chat/completions": {**chat, "max_tokens": 4},
        "/v1/messages": {**chat, "max_tokens": 4},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    }
    for path, body in bodies.items():
        headers = {**K1, "X-Conversation-Id": "every"}
        sent = client.post(path, json={**body, "stream": True}, headers=headers)
        assert sent.status_code == 200, (path, sent.text[:200])
        assert resume(client, "every").content == sent.content, path
    stop(client, "every")
    # The default model has no FIM tokens: /infill's 501 comes before any event.
    headers = {**K1, "X-Conversation-Id": "fails"}
    body = {"input_prefix": "a", "input_suffix": "b", "stream": True}
    assert client.post("/infill", json=body, headers=headers).status_code == 501
    assert resume(client, "fails").status_code == 404


def test_delete_cancels_the_engine_request_and_ends_its_readers(
    running: Running, client: httpx.Client, done: dict[str, dict[str, Any]]
) -> None:
    headers = {**K1, "X-Conversation-Id": "stopped"}
    with client.stream("POST", "/completion", json=LONG, headers=headers, timeout=60) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        next(lines)
        stop(client, "stopped", K2)  # another key's stop: not its stream, nothing happens
        assert next(lines) is not None and request_id not in done
        stop(client, "stopped")
        rest = list(lines)  # the reader ends at once, without a final event
        assert not any('"stop":true' in line for line in rest)
    wait_until(lambda: request_id in done, seconds=10)
    assert done[request_id]["stop_reason"] == "cancelled"
    wait_until(lambda: idle(running), seconds=10)
    assert resume(client, "stopped").status_code == 404


def test_another_keys_stream_is_unknown_to_it(running: Running, client: httpx.Client) -> None:
    headers = {**K1, "X-Conversation-Id": "mine"}
    sent = client.post("/completion", json={"prompt": "Hi", "n_predict": 4, "stream": True}, headers=headers)
    assert resume(client, "mine", headers=K2).status_code == 404
    lookup = client.post("/v1/streams/lookup", json={"conversation_ids": ["mine"]}, headers=K2)
    assert lookup.json() == []
    assert resume(client, "mine", headers={}).status_code == 401
    # k2 may use the same id for a stream of its own; k1's is untouched.
    theirs = client.post(
        "/completion",
        json={"prompt": "Yo", "n_predict": 2, "stream": True},
        headers={**K2, "X-Conversation-Id": "mine"},
    )
    assert resume(client, "mine", headers=K2).content == theirs.content
    assert resume(client, "mine").content == sent.content
    stop(client, "mine")
    stop(client, "mine", K2)


def test_hostile_ids_and_offsets_are_400s(running: Running, client: httpx.Client) -> None:
    body = {"prompt": "Hi", "n_predict": 2, "stream": True}
    for bad in (b"a b", b"x" * 257, "caf\xe9".encode("latin-1")):
        headers = {**K1, "X-Conversation-Id": bad}
        answer = client.post("/completion", json=body, headers=headers)
        assert answer.status_code == 400 and "X-Conversation-Id must be" in answer.json()["error"]["message"]
    for params in ({}, {"conv_id": ""}, {"conv_id": "a\nb"}, {"conv_id": "y" * 257}):
        answer = client.get("/v1/stream", params=params, headers=K1)
        assert answer.status_code == 400, params
    for offset in ("-1", "1e3", "9" * 21, "\u0661"):
        answer = resume(client, "any", offset)
        assert answer.status_code == 400 and "Invalid 'from' offset" in answer.json()["error"]["message"]
    unknown = resume(client, "never-started")
    assert unknown.status_code == 404 and "kept 300 s after it ended" in unknown.json()["error"]["message"]
    for ids in ("x", ["ok", 3], ["a"] * 257, ["a b"]):
        lookup = client.post("/v1/streams/lookup", json={"conversation_ids": ids}, headers=K1)
        assert lookup.status_code == 400, ids
    # The header on a request that does not stream changes nothing.
    plain = client.post(
        "/completion",
        json={"prompt": "Hi", "n_predict": 2},
        headers={**K1, "X-Conversation-Id": "plain"},
    )
    assert plain.status_code == 200 and resume(client, "plain").status_code == 404


def test_the_bounds_answer_as_documented(
    running: Running, client: httpx.Client, done: dict[str, dict[str, Any]]
) -> None:
    # Events: a stream of 60 tokens keeps its newest 48 events; from 0 is lost.
    headers = {**K1, "X-Conversation-Id": "long"}
    body = {"prompt": "Go", "n_predict": 60, "ignore_eos": True, "stream": True}
    sent = client.post("/completion", json=body, headers=headers)
    lost = resume(client, "long")
    assert lost.status_code == 400
    message = lost.json()["error"]["message"]
    assert message.startswith("Stream offset lost, please restart") and "48 events" in message
    tail = sent.content.split(b"\n\n")[-49:]  # the last 48 events, and the empty piece after them
    assert resume(client, "long", len(sent.content) - len(b"\n\n".join(tail))).status_code == 200
    stop(client, "long")

    # Streams per client: k2's two live streams, no room for a third; readers per stream: 2.
    ids = []
    for conv in ("live1", "live2"):
        with client.stream(
            "POST",
            "/completion",
            json=LONG,
            headers={**K2, "X-Conversation-Id": conv},
        ) as response:
            ids.append(response.headers["x-request-id"])
    third = client.post("/completion", json=LONG, headers={**K2, "X-Conversation-Id": "live3"})
    assert third.status_code == 429 and "limit of 2" in third.json()["error"]["message"]
    with (
        client.stream("GET", "/v1/stream", params={"conv_id": "live1"}, headers=K2) as one,
        client.stream("GET", "/v1/stream", params={"conv_id": "live1"}, headers=K2) as two,
    ):
        assert one.status_code == two.status_code == 200
        extra = resume(client, "live1", headers=K2)
        assert extra.status_code == 429 and "limit of 2" in extra.json()["error"]["message"]
    stop(client, "live1", K2)
    stop(client, "live2", K2)
    wait_until(lambda: all(i in done for i in ids), seconds=10)
    assert [done[i]["stop_reason"] for i in ids] == ["cancelled", "cancelled"]
