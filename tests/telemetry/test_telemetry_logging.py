"""telemetry.logging logs one line per finished request, and stops when closed."""

from __future__ import annotations

import logging
from typing import Any

import pykka
import pytest

from actors import generate
from telemetry.logging import RequestLogger


def test_one_line_per_finished_request(server: pykka.ActorRef[Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llama_cpp_actors.requests")
    request_log = RequestLogger()
    try:
        completion = generate(server, "Hello", max_tokens=3, temp=0)
    finally:
        request_log.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "llama_cpp_actors.requests"]
    assert len(lines) == 1
    assert lines[0].startswith(f"{completion.request_id} generate {completion.stop_reason}: ")
    generate(server, "Hello again", max_tokens=2)
    assert len([r for r in caplog.records if r.name == "llama_cpp_actors.requests"]) == 1
