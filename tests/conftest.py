"""Shared fixtures: the default model, servers that stop at teardown, a reference Llama.

The tree mirrors the packages (``tests/engine/`` for ``actors/engine/``...); support
modules (``helpers``, ``fake_backend``, ``tiny_gguf``...) sit here, importable from
every test file. A test that takes the ``model_path`` fixture, directly or through
another fixture, is marked ``model``; the others mark themselves (``model`` when a child
loads it, ``subprocess``, ``ray``, ``slow``). ``make test-fast`` runs what needs none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest

from actors import ServerActor, default_model_path


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "model_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))


def _worker_group(item: pytest.Item) -> str:
    """The tests that share one pytest-xdist worker under ``make test`` (``--dist
    loadgroup``): a file's tests, so its module fixtures (servers, models) start once;
    the Ray tests, one local cluster at a time; the hostile cases, whose runner starts
    the children of every selected case at the first one's request (``hostile_runner``).
    """
    path = item.nodeid.split("::")[0]
    if item.get_closest_marker("ray"):
        return "ray"
    if path.startswith("tests/hostile/"):
        return "hostile"
    return path


@pytest.fixture(scope="session")
def model_path() -> str:
    if os.environ.get("LLAMA_CPP_ACTORS_NO_MODEL"):  # make test-fast: no test there may load it
        pytest.fail("this test needs the model; it does not belong in make test-fast")
    return default_model_path()


@pytest.fixture
def start_server(model_path: str) -> Iterator[Callable[..., pykka.ActorRef[Any]]]:
    """Start ServerActors on the default model; every actor is stopped at teardown."""

    def start(**options: Any) -> pykka.ActorRef[Any]:
        options.setdefault("n_ctx", 2048)
        return ServerActor.start(model_path=model_path, **options)

    yield start
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def server(start_server: Callable[..., pykka.ActorRef[Any]]) -> pykka.ActorRef[Any]:
    """A 4-slot server on the default model."""
    return start_server(n_parallel=4)


@pytest.fixture
def repeatable_server(start_server: Callable[..., pykka.ActorRef[Any]]) -> pykka.ActorRef[Any]:
    """A 1-slot server that never reuses KV: every request starts from an empty cache.

    The same request is then the same computation (batches, KV cells), so its output
    repeats bit for bit on any CPU, whichever attention kernel llama.cpp has.
    """
    return start_server(n_parallel=1, cache_prompt=False)


@pytest.fixture(scope="session")
def reference_llama(model_path: str) -> Any:
    """One ``llama_cpp.Llama`` with all logits kept, for greedy references and margins."""
    from llama_cpp import Llama

    logging.getLogger("llama_cpp_actors").debug("loading the reference Llama")
    return Llama(model_path, n_ctx=2048, n_threads=1, logits_all=True, flash_attn=True, verbose=False)
