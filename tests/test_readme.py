"""The README's code runs as written, and its tables name what the packages export."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pykka
import pytest
from helpers import compare
from test_greedy import reference

import actors
import strategies
import telemetry

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.mark.timeout(180)
def test_the_first_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = re.search(r"```python\n(.*?)```", README, re.DOTALL)
    assert code is not None
    try:
        exec(compile(code.group(1), "README.md", "exec"), {})
    finally:
        pykka.ActorRegistry.stop_all()
    out = capsys.readouterr().out
    assert "'active_slots': 0" in out


@pytest.mark.timeout(180)
def test_the_request_features_snippet_runs(server: pykka.ActorRef[Any], reference_llama: Any) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    snippet = next(b for b in blocks if "json_schema" in b)
    scope: dict[str, Any] = {"ref": server}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["second"].prefix_cache_tokens > 0
    assert scope["listing"].stop_reason in ("stop", "max_tokens", "eog")
    # The README shows ' Paris' on top; what is on top is the model's (and the CPU's) to say:
    # the answer is llama.cpp's own greedy answer up to a near-tie, and its top logprob.
    answer, top = scope["answer"], scope["top"]
    expected, margins = reference(reference_llama, "The capital of France is")
    compare(expected[:3], margins[:3], answer.token_ids)
    assert top[0].token_id == answer.token_ids[0] and top[0].logprob >= top[1].logprob
    assert scope["ids"]


def test_every_signal_in_the_table_exists_with_its_name() -> None:
    rows = re.findall(r"\| `telemetry\.(\w+)` \| `([\w.]+)` \|", README)
    assert {name for name, _ in rows} == {
        "tick",
        "request_start",
        "request_done",
        "request_exception",
        "kv_pressure",
        "ram_cache",
        "server_restart",
        "model_load",
    }
    for attr, name in rows:
        assert getattr(telemetry, attr).name == name


def test_every_strategy_in_the_table_is_exported() -> None:
    section = README.split("## Batch strategies")[1].split("## Telemetry")[0]
    names = re.findall(r"^\| `(\w+)\(\)`", section, re.MULTILINE)
    assert names == ["DecodeMaximal", "PrefillPriority", "Balanced", "Adaptive"]
    for name in names:
        assert name in strategies.__all__


def test_all_lists_exactly_the_public_names() -> None:
    for module in (actors, strategies, telemetry):
        public = {
            n for n in vars(module) if not n.startswith("_") and not isinstance(vars(module)[n], type(re))
        }
        exported = set(module.__all__)
        assert exported <= set(vars(module)), exported - set(vars(module))
        missing = {
            n
            for n in public - exported
            if getattr(vars(module)[n], "__module__", "").startswith(module.__name__)
        }
        assert not missing, f"{module.__name__} exports these without __all__: {missing}"


def test_the_version_matches_the_package_metadata() -> None:
    from importlib.metadata import version

    assert actors.__version__ == version("llama-cpp-actors")
    assert f"## {actors.__version__}" in (Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()
