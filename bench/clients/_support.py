"""What every client script shares. Standard library only: it runs in the client's venv.

``bench/clients.py`` passes the proxy's address (``CLIENT_BASE_URL``), the served model's
id (``CLIENT_MODEL``) and where to write the steps (``CLIENT_RESULT``). A script runs
each step in ``with steps.step(name):``; a step that raises is recorded as failed and the
next one runs. ``steps.finish()`` writes the result and exits 0 when every step passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import urllib.request
from collections.abc import Iterator
from typing import Any, NoReturn

BASE_URL = os.environ.get("CLIENT_BASE_URL", "http://127.0.0.1:8080")
MODEL = os.environ.get("CLIENT_MODEL", "default")
QUESTION = "What is the weather in Paris?"
TOOL_RESULT = "Sunny, 21 C"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"location": {"type": "string", "description": "A city"}},
    "required": ["location"],
}


def get_weather(location: str) -> str:
    """The tool every script offers the model."""
    return f"{TOOL_RESULT} in {location}."


def check(condition: object, message: str) -> None:
    """An assertion that survives ``python -O`` and says what was wrong."""
    if not condition:
        raise AssertionError(message)


def _mark(name: str) -> None:
    """Tell the recording proxy that the exchanges from now on belong to step ``name``."""
    request = urllib.request.Request(
        f"{BASE_URL}/__step",
        data=json.dumps({"step": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=10):
        pass


class Steps:
    """The steps of one script: each one's name, outcome, time and error."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        _mark(name)
        print(f"--- {name}", flush=True)
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"name": name, "ok": True, "seconds": 0.0, "error": "", "detail": ""}
        try:
            yield
        except Exception as e:
            entry["ok"] = False
            entry["error"] = f"{type(e).__name__}: {e}"[:600]
            entry["detail"] = traceback.format_exc()[-4000:]
            traceback.print_exc()
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"--- {name}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s)", flush=True)
        self.results.append(entry)
        _mark("")

    def note(self, text: str) -> None:
        """A line in the script's log (what the model did, which the report does not judge)."""
        print(f"    {text}", flush=True)

    def finish(self) -> NoReturn:
        path = os.environ.get("CLIENT_RESULT")
        if path:
            with open(path, "w") as f:
                json.dump({"steps": self.results}, f, indent=1)
        sys.exit(0 if all(entry["ok"] for entry in self.results) else 1)
