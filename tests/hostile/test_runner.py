"""The runner's own cases: a crash or a hang in a child is reported, and hides no case after it.

Each case runs in a child python (``hostile_runner``); see its docstring for what
every case must show.
"""

from __future__ import annotations

import importlib
import os
import threading

import pytest
from hostile_child import (
    Child,
)
from hostile_runner import (
    CASES,
    HOSTILE,
    case,
    results,
)

# -- the runner's own cases: a crash or a hang is reported and hides nothing --------------------


@case("m00")
def _aborts(c: Child) -> None:
    os.abort()


@case("m00")
def _runs_after_an_abort(c: Child) -> None:
    c.serves(c.ref)


@case("m00")
def _hangs(c: Child) -> None:
    threading.Event().wait()


@case("m00")
def _fails(c: Child) -> None:
    raise AssertionError("as it should")


@case("m00")
def _runs_after_a_hang(c: Child) -> None:
    c.serves(c.ref)


@pytest.mark.model
@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_the_runner_reports_crashes_and_hangs_and_runs_the_cases_after_them() -> None:
    found = results("m00")
    assert "SIGABRT" in found["m00-aborts"][0]
    assert "hung" in found["m00-hangs"][0]
    assert "as it should" in found["m00-fails"][0]
    assert found["m00-runs-after-an-abort"] == found["m00-runs-after-a-hang"] == []


CASE_MODULES = (
    "test_dead_ends", "test_told_messages", "test_consumers", "test_strategy_plans",
    "test_base_exceptions", "test_error_tree", "test_control_tokens", "test_properties",
)  # fmt: skip


def test_every_class_has_several_cases() -> None:
    for module in CASE_MODULES:
        importlib.import_module(module)
    groups: dict[str, int] = {}
    for item in CASES.values():
        groups[item.group] = groups.get(item.group, 0) + 1
    for group in ("c01", "c02", "c04", "c05", "c06", "c09", "c12", "c14", "c15"):
        assert groups.get(group, 0) >= 3, group
    found = {p.stem for p in HOSTILE.glob("test_*.py")} - {"test_runner"}
    assert found == set(CASE_MODULES)
