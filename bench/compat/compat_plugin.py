"""A pytest plugin that ``bench/compat.py`` loads into llama.cpp's server test suite.

It does these things, all outside the suite's tests themselves:

- It turns the suite's session warm-up ``ServerPreset.load_all()`` into a no-op. The
  warm-up starts every preset once (an embedding server, a reranker, a vision model,
  a router) only to fill the download cache; with the wrapper there is nothing to
  download, and a server that rejects a preset's flag (``--embedding``, say) would
  otherwise fail the whole session instead of the tests that use that preset.
- It maps the files the suite downloads with ``utils.download_file(url)`` to local
  files (``DOWNLOADS``, by the URL's file name): ``test_speculative.py``'s draft model
  ``stories15M-q4_0.gguf`` becomes ``$COMPAT_MODEL``, the default model, the model its
  main model is mapped to as well (so a draft with the same vocabulary). Any other URL
  goes to the suite's own ``download_file``, which fails without a network.
- It writes each test's outcome, by node id, to the JSON file ``$COMPAT_OUTCOMES``:
  ``{"node id": {"outcome": "passed|failed|error|skipped", "message": "..."}}``, where
  ``error`` is a failure in setup or teardown and ``message`` the first line of the
  failure (or the reason for a skip), and ``duration`` the seconds its setup, call and
  teardown took.
- It deselects the tests marked ``slow`` except in the files named (comma-separated) in
  ``$COMPAT_SLOW_FILES``, so the marker selection is per file.
- It gives the tests of each file in ``$COMPAT_TIMEOUTS`` (JSON: ``{"file name": seconds}``)
  that pytest-timeout timeout instead of ``--timeout``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_outcomes: dict[str, dict[str, Any]] = {}

# The suite's downloads, by the URL's last path component: the environment variable
# naming the local file that stands for it.
DOWNLOADS: dict[str, str] = {
    "stories15M-q4_0.gguf": "COMPAT_MODEL",  # test_speculative.py's draft model
}


def local_file(url: str) -> str | None:
    """The local file that stands for the download ``url``, if ``DOWNLOADS`` maps it."""
    variable = DOWNLOADS.get(url.rpartition("/")[2])
    if variable is None:
        return None
    return os.environ.get(variable) or None


def pytest_sessionstart(session: pytest.Session) -> None:
    # The suite's conftest.py has imported ``utils`` (its directory is on sys.path); the
    # test modules, collected after this, take ``download_file`` with ``from utils import *``.
    import utils  # type: ignore[import-not-found]

    utils.ServerPreset.load_all = staticmethod(lambda: None)
    download = utils.download_file

    def download_file(url: str, output_file_path: str | None = None) -> str:
        path = local_file(url)
        return path if path is not None else download(url, output_file_path)

    utils.download_file = download_file


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files = {name for name in os.environ.get("COMPAT_SLOW_FILES", "").split(",") if name}
    timeouts: dict[str, int] = json.loads(os.environ.get("COMPAT_TIMEOUTS") or "{}")
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        name = item.path.name
        if item.get_closest_marker("slow") is not None and name not in slow_files:
            dropped.append(item)
            continue
        if name in timeouts:
            item.add_marker(pytest.mark.timeout(timeouts[name]), append=False)
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return text.strip().splitlines()[0] if text.strip() else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry: dict[str, Any] = _outcomes.setdefault(
        report.nodeid, {"outcome": "passed", "message": "", "duration": 0.0}
    )
    entry["duration"] = round(entry["duration"] + report.duration, 2)
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
