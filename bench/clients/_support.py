"""What every client script shares. Standard library only: it runs in the client's venv.

``bench/clients.py`` passes the proxy's address (``CLIENT_BASE_URL``), the served model's
id (``CLIENT_MODEL``) and where to write the steps (``CLIENT_RESULT``). A script runs
each step in ``with steps.step(name):``; a step that raises is recorded as failed and the
next one runs. ``steps.finish()`` writes the result and exits 0 when every step passed.

The decisions steps all ask the same three questions about ``DECISION_STATE``: a yes/no
(``REFUND_ASK``), a choice among ``TEAMS`` and a score on the levels ``MOODS``, and check
with ``check_distribution`` only that the client parsed the answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
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


DECISION_STATE = "Customer: I was charged twice for my order and nobody answers my emails. Fix it today."
REFUND_ASK = "Does the customer ask for money back?"
TEAM_ASK = "Which team should handle this message?"
TEAMS = {
    "billing": "payments, invoices and refunds",
    "technical": "bugs and errors in the product",
    "other": "anything else",
}
MOOD_ASK = "How upset is the customer?"
MOODS = ["calm", "annoyed", "angry"]


def get_weather(location: str) -> str:
    """The tool every script offers the model."""
    return f"{TOOL_RESULT} in {location}."


def check(condition: object, message: str) -> None:
    """An assertion that survives ``python -O`` and says what was wrong."""
    if not condition:
        raise AssertionError(message)


def probability(value: object) -> bool:
    """Whether ``value`` is a number from 0 to 1 (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def check_distribution(probabilities: Mapping[Any, Any], keys: Iterable[Any], what: str) -> None:
    """A parsed distribution has exactly ``keys``, each a probability (the sum is the
    server's business, not the parse's)."""
    wanted = set(keys)
    check(set(probabilities) == wanted, f"{what}: keys {set(probabilities)!r}, not {wanted!r}")
    check(all(probability(p) for p in probabilities.values()), f"{what}: {dict(probabilities)!r}")


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
