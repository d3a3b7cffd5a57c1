"""What a server says about itself: a banner once it serves, one access line per
request, and a request id that is the same in the log, the ``X-Request-Id`` header and
the telemetry signals."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_until
from http_server import Running

import telemetry
from actors import ServerActor
from actors.http import HttpSettings

pytestmark = [pytest.mark.timeout(120)]

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def running(model_path: str) -> Iterator[Running]:
    with Running.ready(
        HttpSettings(),
        lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=2048),
    ) as server:
        yield server


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "llama_cpp_actors.http.access"]


def test_each_request_has_one_access_line_and_its_id_everywhere(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    ends: list[str] = []

    def done(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        ends.append(metadata["request_id"])

    subscription = telemetry.Subscription({telemetry.request_done: done})
    caplog.set_level(logging.INFO, logger="llama_cpp_actors.http.access")
    try:
        ok = httpx.post(running.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        two = httpx.post(
            running.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "n": 2}
        )
        with httpx.stream(
            "POST", running.url + "/completion", json={"prompt": "Once", "n_predict": 5, "stream": True}
        ) as streamed:
            streamed.read()
        bad = httpx.post(running.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 4})
        missing = httpx.get(running.url + "/no/such/path")
    finally:
        subscription.close()
    responses = [ok, two, streamed, bad, missing]
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == 5 and all(len(i) == 32 for i in ids)
    # The engine's requests carry the HTTP request's id: the signals name it.
    assert ids[0] in ends and ids[2] in ends and ends.count(ids[1]) == 2  # n=2: one end each choice
    # A line is written once the response is done, which the client may see first.
    wait_until(lambda: set(ids) <= {r.access["request_id"] for r in _lines(caplog)}, 5)  # type: ignore[attr-defined]
    lines = {r.access["request_id"]: r for r in _lines(caplog)}  # type: ignore[attr-defined]
    first = lines[ids[0]].access  # type: ignore[attr-defined]
    assert first["status"] == 200 and first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert first["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert first["generated_tokens"] == ok.json()["usage"]["completion_tokens"] > 0
    assert lines[ids[1]].access["generated_tokens"] == two.json()["usage"]["completion_tokens"]  # type: ignore[attr-defined]
    assert lines[ids[2]].access["generated_tokens"] > 0  # type: ignore[attr-defined]
    assert lines[ids[0]].levelno == logging.INFO and f"id={ids[0]}" in lines[ids[0]].getMessage()
    # 4xx: a warning, with the error the client got.
    for rid, status, error in (
        (ids[3], 400, "'messages' must be a non-empty list"),
        (ids[4], 404, "/no/such/path"),
    ):
        record = lines[rid]
        assert record.levelno == logging.WARNING and record.access["status"] == status  # type: ignore[attr-defined]
        assert error in record.access["error"]  # type: ignore[attr-defined]
    # A path is the client's: it never writes a line of its own into the log.
    forged = httpx.get(running.url + "/x%0A12:00:00 INFO POST /v1/chat/completions 200")
    rid = forged.headers["x-request-id"]
    wait_until(lambda: any(r.access["request_id"] == rid for r in _lines(caplog)), 5)  # type: ignore[attr-defined]
    (line,) = [r for r in _lines(caplog) if r.access["request_id"] == rid]  # type: ignore[attr-defined]
    assert "\n" not in line.getMessage() and "/x\\n12:00:00" in line.getMessage()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve(*flags: str) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, "-m", "actors.http", "serve", "-c", "1024", "-np", "1", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return child, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    child.kill()
    raise AssertionError(child.communicate()[1][-2000:])


def _three_requests(url: str) -> list[str]:
    """One that works, one that is refused, one to a path that is not served: their ids."""
    return [
        httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}).headers[
            "x-request-id"
        ],
        httpx.post(url + "/v1/chat/completions", json={"messages": []}).headers["x-request-id"],
        httpx.get(url + "/v2/nothing").headers["x-request-id"],
    ]


def _stop(child: subprocess.Popen[str]) -> str:
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err[-2000:]
    return err


@pytest.mark.model
@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_serve_says_where_it_listens_and_logs_each_request(tmp_path: Path) -> None:
    child, url = _serve()
    ids = _three_requests(url)
    err = _stop(child)
    banner = [line for line in err.splitlines() if "listening on" in line]
    assert len(banner) == 1 and f"listening on {url}: model SmolLM2-135M-Instruct" in banner[0]
    assert "1 slots of 1024 tokens" in banner[0] or "1 slot" in banner[0]
    for rid, (level, status) in zip(
        ids, (("INFO", "200"), ("WARNING", "400"), ("WARNING", "404")), strict=True
    ):
        (line,) = [line for line in err.splitlines() if f"id={rid}" in line]
        assert f" {level} " in line and f" {status} " in line
    assert "llama_model_loader" not in err  # llama.cpp's own chatter only with -lv 3 or -v

    # The same as JSON lines, in a file; and nothing at all with --log-disable.
    log = tmp_path / "serve.jsonl"
    child, url = _serve("--log-file", str(log), "--log-format", "json")
    ids = _three_requests(url)
    err = _stop(child)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    access: dict[str, Any] = {r["request_id"]: r for r in records if "request_id" in r}
    assert [access[rid]["status"] for rid in ids] == [200, 400, 404]
    assert access[ids[0]]["generated_tokens"] > 0 and "error" in access[ids[1]]
    assert any("listening on" in r["message"] for r in records)
    assert "listening on" not in err
    child, url = _serve("--log-disable")
    _three_requests(url)
    assert _stop(child).strip() == ""
