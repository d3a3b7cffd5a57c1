"""The hostile runner: cases of hostile input and faults (issue 12) run in child pythons,
and nothing a caller sends may abort, crash or hang the engine.

llama.cpp aborts the process instead of raising, so every case that touches a model
runs in a child python (:func:`child_main`), several cases to a child: a case that
kills its child is reported as crashed (with the signal) and the child is started
again for the cases after it, so one crash never hides another. Every case asserts

- that its child lived (return code 0, no signal),
- the documented outcome: an ``EngineError`` subclass, or a normal finish with a
  defined ``stop_reason``,
- exactly one outcome per request: a stream's events are drained up to its
  ``Done``/``Failed`` and looked at again when the child ends; telemetry counts at
  most one ``request_done``/``request_exception`` per request id,
- and, after it (the child checks this for every case), that the shared engine is
  idle and serves a normal request and that an unrelated pykka actor still answers.

``HOSTILE_TIMES=1`` prints each case's seconds (keep the file under ~90 s on 2 cores).

Cases are grouped by the class of issue 12 they defend (``c01`` grammar dead ends,
``c02`` huge JSON schemas, ``c04`` told messages, ``c05`` blocking consumers, ``c06``
full queues, ``c09`` strategies, ``c12`` ``BaseException`` from callbacks, ``c14``
errors escaping the tree, ``c15`` forged control tokens). The property tests of the
message constructors run in this process: they need no model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import pytest

from actors import (
    Done,
    Failed,
    StopReason,
    Token,
)

if TYPE_CHECKING:
    from hostile_child import Child

HOSTILE = Path(__file__).resolve().parent
TESTS = HOSTILE.parent
ROOT = TESTS.parent
STOP_REASONS = frozenset(get_args(StopReason))
LONE = "\ud83d"  # json.loads('"\\ud83d"') makes one from an ordinary JSON body
CASE_TIMEOUT_S = 40.0  # a case still running after this hangs: its child ends itself
HUNG = 97  # ... with this return code
CHILD_TIMEOUT_S = 100.0
_MARK = "@@hostile "

Event = Token | Done | Failed

# -- the registry of cases ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One hostile case: ``run`` executes in a child python, in ``group``'s children."""

    name: str
    group: str
    run: Callable[[Child], None]
    module: str
    """The test module that registered it: a child imports it to find the case."""
    xfail: str | None = None


CASES: dict[str, Case] = {}


def case(group: str, name: str | None = None, *, xfail: str | None = None) -> Callable[..., Any]:
    """Register a case of ``group``; ``xfail`` names the bug it shows while the engine has it."""

    def register(run: Callable[[Child], None]) -> Callable[[Child], None]:
        key = f"{group}-{name or run.__name__.removeprefix('_').replace('_', '-')}"
        assert key not in CASES, key
        CASES[key] = Case(key, group, run, run.__module__, xfail)
        return run

    return register


# -- the parent: children and their reports ------------------------------------------------

_CHILD = (
    "import sys; sys.path[:0] = sys.argv[1:4]; import hostile_child; hostile_child.child_main(sys.argv[4])"
)
BATCH = 16  # cases per child: children of one group run in parallel too
_futures: dict[str, list[Future[dict[str, list[str]]]]] = {}
_selected: list[str] = []  # the groups of the selected tests, in order


def _describe(returncode: int | None) -> str:
    if returncode is None:
        return f"hung: killed after {CHILD_TIMEOUT_S:.0f} s"
    if returncode == HUNG:
        return f"hung: a case ran over {CASE_TIMEOUT_S:.0f} s"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name} (returncode {returncode})"
    return f"exited with returncode {returncode}"


def _run_child(names: list[str]) -> tuple[list[dict[str, Any]], int | None, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(HOSTILE), str(TESTS), str(ROOT), _pairs(names)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        returncode = None
    finally:  # pytest-timeout may interrupt the wait: no child outlives its test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line[len(_MARK) :]) for line in out.splitlines() if line.startswith(_MARK)]
    return records, returncode, err


def _pairs(names: list[str]) -> str:
    return json.dumps([[CASES[name].module, name] for name in names])


def _batches(group: str) -> list[list[str]]:
    """The cases of ``group`` in children of at most ``BATCH`` cases each."""
    names = [c.name for c in CASES.values() if c.group == group]
    return [names[i : i + BATCH] for i in range(0, len(names), BATCH)]


def results(group: str) -> dict[str, list[str]]:
    """Every case of ``group`` run in children: its problems (empty when it passed).

    The first call starts the children of every selected group, two at a time (most
    cases wait on a stream or a timer more than they compute), or one at a time under
    pytest-xdist (``make test``), whose other worker has the other core: three busy
    processes on two cores put a child's case past ``CASE_TIMEOUT_S``.
    """
    if not _futures:
        workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
        executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hostile-children")
        for name in [group, *(g for g in _selected if g != group)]:
            _futures[name] = [executor.submit(_run_cases, batch) for batch in _batches(name)]
        executor.shutdown(wait=False)
    if group not in _futures:
        _futures[group] = [ThreadPoolExecutor(max_workers=1).submit(_run_cases, b) for b in _batches(group)]
    found: dict[str, list[str]] = {}
    for future in _futures[group]:
        found.update(future.result())
    return found


def _run_cases(names: list[str]) -> dict[str, list[str]]:
    """Run ``names`` in children, again after a crash for the cases it did not reach."""
    found: dict[str, list[str]] = {}
    pending = list(names)
    while pending:
        records, returncode, err = _run_child(pending)
        started = [r["start"] for r in records if "start" in r]
        for record in records:
            if "end" in record:
                found.setdefault(record["end"], []).extend(record["problems"])
                if "seconds" in record and os.environ.get("HOSTILE_TIMES"):
                    print(f"{record['seconds']:6.2f} s  {record['end']}", file=sys.stderr)
        if returncode != 0 or not any(r.get("done") for r in records):
            why = f"the child {_describe(returncode)}; its stderr ends:\n{err[-3000:]}"
            # The case under way when it died; or, if it died after its last case (in the
            # final checks), every case it ran; or, before any, the first.
            culprits = [n for n in started if n not in found] or started or pending[:1]
            for name in culprits:
                found.setdefault(name, []).append(why)
        pending = [n for n in pending if n not in found]
    return found


def params(module: str) -> list[Any]:
    """The cases ``module`` registered, as ``hostile_case`` parameters (the runner's own
    ``m00`` cases are run by their own test)."""
    return [
        pytest.param(
            c.name, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else []
        )
        for c in CASES.values()
        if c.module == module and c.group != "m00"
    ]


def select(names: Sequence[str]) -> None:
    """The cases the session will run, so every selected group's children start at the
    first one's request."""
    for name in names:
        if name in CASES and CASES[name].group not in _selected:
            _selected.append(CASES[name].group)


def check(name: str) -> None:
    """The test of one case: it reported, with no problem."""
    problems = results(CASES[name].group).get(name)
    assert problems is not None, f"{name} never reported"
    assert not problems, "\n".join(problems)
