"""Test helpers shared by several test files."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import telemetry
from actors import Done, Failed

# Ban every end-of-generation token of the default model, so a request runs until
# max_tokens, a cancel or a stop: tests that need a busy slot must not race an EOG.
NO_EOG = {0: float("-inf"), 2: float("-inf"), 4: float("-inf")}

SIGNALS = {
    "tick": telemetry.tick,
    "start": telemetry.request_start,
    "done": telemetry.request_done,
    "exception": telemetry.request_exception,
    "kv_pressure": telemetry.kv_pressure,
    "ram_cache": telemetry.ram_cache,
    "restart": telemetry.server_restart,
    "model_load": telemetry.model_load,
}


class Recorder:
    """Collects every signal of the engine (held strongly by the test)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self._lock = threading.Lock()
        for kind, signal in SIGNALS.items():
            signal.connect(self._receiver(kind))

    def _receiver(self, kind: str) -> Callable[..., None]:
        def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
            with self._lock:
                self.events.append((kind, measurements, metadata))

        setattr(self, f"_keep_{len(self.__dict__)}", receive)  # blinker holds receivers weakly
        return receive

    def of(self, kind: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        with self._lock:
            return [(m, md) for k, m, md in self.events if k == kind]


def drain(q: queue.Queue[Any], timeout: float = 60) -> list[Any]:
    """A stream's events up to and with its Done or Failed."""
    events = []
    while True:
        event = q.get(timeout=timeout)
        events.append(event)
        if isinstance(event, Done | Failed):
            return events


def wait_until(condition: Callable[[], bool], seconds: float = 60) -> None:
    """Poll ``condition`` until it holds; fail the test after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
