"""A pytest plugin that ``bench/compat.py`` loads into llama.cpp's server test suite.

It does two things, both outside the suite's tests themselves:

- It turns the suite's session warm-up ``ServerPreset.load_all()`` into a no-op. The
  warm-up starts every preset once (an embedding server, a reranker, a vision model,
  a router) only to fill the download cache; with the wrapper there is nothing to
  download, and a server that rejects a preset's flag (``--embedding``, say) would
  otherwise fail the whole session instead of the tests that use that preset.
- It writes each test's outcome, by node id, to the JSON file ``$COMPAT_OUTCOMES``:
  ``{"node id": {"outcome": "passed|failed|error|skipped", "message": "..."}}``, where
  ``error`` is a failure in setup or teardown and ``message`` the first line of the
  failure (or the reason for a skip).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_outcomes: dict[str, dict[str, str]] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    # The suite's conftest.py has imported ``utils`` (its directory is on sys.path).
    import utils  # type: ignore[import-not-found]

    utils.ServerPreset.load_all = staticmethod(lambda: None)


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return text.strip().splitlines()[0] if text.strip() else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if entry["outcome"] != "passed":
        return  # the first thing that went wrong is the one to report
    if report.skipped:
        entry.update(outcome="skipped", message=_message(report))
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        entry.update(outcome=outcome, message=_message(report))


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("COMPAT_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
