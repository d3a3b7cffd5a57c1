"""The hostile runner as a plugin: each case module's ``test_hostile(hostile_case)`` is
parametrized by the cases that module registered, every case is marked ``model`` and
``subprocess`` (it runs in a child on the default model), and the children of every
selected class start at the first case's request."""

from __future__ import annotations

import pytest
from hostile_runner import params, select


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hostile_case" in metafunc.fixturenames:
        metafunc.parametrize("hostile_case", params(metafunc.module.__name__))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    names = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "hostile_case" in callspec.params:
            names.append(callspec.params["hostile_case"])
            item.add_marker(pytest.mark.model)
            item.add_marker(pytest.mark.subprocess)
            item.add_marker(pytest.mark.timeout(110))
    select(names)
