"""The tree shows the layers, and the import contracts in ``.importlinter`` hold them.

Each contract is shown to bite: a copy of the packages with one import that breaks it
fails ``lint-imports`` with that contract named, so a contract that checks nothing (a
typo in a module name, a layer left out) cannot pass unnoticed.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import actors

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
LAYERS = ("contract", "chat", "backend", "engine", "actor", "client", "scale", "http")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_subpackage_is_a_layer_whose_docstring_says_what_it_may_import() -> None:
    found = {m.name for m in pkgutil.iter_modules(actors.__path__) if m.ispkg}
    assert found == set(LAYERS)
    for name in LAYERS:
        package = importlib.import_module(f"actors.{name}")
        doc = package.__doc__ or ""
        assert doc.count(".") >= 2, f"actors.{name} needs a docstring: what lives there, what it imports"
        assert "import" in doc, f"actors.{name}'s docstring does not say what it may import"
        for public in package.__all__:
            assert hasattr(package, public)


def test_each_public_name_comes_from_exactly_one_layer() -> None:
    exported = {
        name: [layer for layer in LAYERS if name in importlib.import_module(f"actors.{layer}").__all__]
        for name in actors.__all__
        if name != "__version__"
    }
    assert {name: homes for name, homes in exported.items() if len(homes) != 1} == {}
    for name, (layer,) in exported.items():
        assert getattr(actors, name) is getattr(importlib.import_module(f"actors.{layer}"), name)


@pytest.mark.subprocess
def test_the_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


LAYERED = "each layer imports only the layers below"
ONE_IMPORTER = "only actors.backend._llama imports llama_cpp"
# (file to plant the import in, the import, the contract that must break)
VIOLATIONS = [
    ("actors/engine/_slots.py", "from actors.client import _helpers", LAYERED),
    ("actors/contract/_results.py", "import actors.engine", LAYERED),
    ("actors/chat/_parse.py", "import actors.backend", LAYERED),
    ("actors/client/_aio.py", "import actors.actor._server", LAYERED),
    ("actors/engine/_batch.py", "import llama_cpp", ONE_IMPORTER),
    ("actors/http/_params.py", "from actors.contract import _checks", "actors.http imports only the public"),
    ("actors/http/_app.py", "import actors.engine", "actors.http imports only the public"),
    ("actors/actor/_server.py", "import llama_cpp.llama_grammar", ONE_IMPORTER),
    ("strategies/_builtin.py", "import telemetry", "strategies import nothing"),
    ("strategies/_base.py", "from actors.contract import _errors", "strategies import nothing"),
    ("telemetry/logging.py", "import actors.contract", "telemetry imports nothing"),
    ("actors/engine/_output_stage.py", "from actors.engine import _scheduler", "each part imports only"),
    (
        "actors/engine/_batch.py",
        "from actors.backend._rows import put_rows",
        "private modules are imported only",
    ),
    ("actors/scale/_pool.py", "from actors.engine import _slots", "private modules are imported only"),
    # The circles that were (each behind TYPE_CHECKING), planted back.
    ("actors/scale/_handle.py", "from actors.scale import _manager", "no import circles"),
    ("actors/http/_views.py", "from actors.http import _service", "no import circles"),
    ("actors/contract/_gbnf_cost.py", "from actors.contract import _gbnf", "no import circles"),
    ("strategies/_types.py", "from strategies import _base", "no import circles"),
]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("path", "line", "contract"), VIOLATIONS, ids=[v[1] for v in VIOLATIONS])
def test_a_planted_import_breaks_its_contract(tmp_path: Path, path: str, line: str, contract: str) -> None:
    for package in ("actors", "strategies", "telemetry"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    target = tmp_path / path
    target.write_text(target.read_text() + f"\n{line}\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = [row for row in result.stdout.splitlines() if row.endswith("BROKEN") or "BROKEN (" in row]
    assert any(contract in row for row in broken), result.stdout


def test_the_tick_diagram_names_functions_that_exist() -> None:
    from actors.actor._ref import EngineRef
    from actors.actor._server import ServerActor
    from actors.backend._llama import LlamaRows, LlamaSampling
    from actors.engine import _batch, _prepare
    from actors.engine._delivery import Courier
    from actors.engine._engine import Engine
    from actors.engine._lifecycle import Lifecycle
    from actors.engine._memory import KVMemory
    from actors.engine._output_stage import OutputStage
    from actors.engine._runner import Runner
    from actors.engine._scheduler import Scheduler
    from strategies import BatchStrategy

    classes = {c.__name__: c for c in (
        BatchStrategy, Courier, Engine, EngineRef, KVMemory, Lifecycle, LlamaRows, LlamaSampling,
        OutputStage, Runner, Scheduler, ServerActor,
    )}  # fmt: skip
    functions = {"check_plan": _batch.check_plan, "lay_out": _batch.lay_out, "prepare": _prepare.prepare}
    # One tick diagram, in one place: the tick's design page (the README links to it);
    # the request's path has its own, naming the same functions.
    assert "```\n caller's thread" not in (ROOT / "README.md").read_text()
    for name in ("tick.md", "request-path.md"):
        diagram = (ROOT / "docs" / "design" / name).read_text().split("```", 2)[1]
        methods = re.findall(r"\b([A-Z]\w+)\.(\w+)\(\)", diagram)
        bare = re.findall(r"(?<![.\w])([a-z_]\w*)\(\)", diagram)
        assert len(methods) >= 8 and bare, f"{name}: the diagram should name functions as Class.method()"
        for cls_name, attr in methods:
            cls = classes[cls_name]
            assert attr in vars(cls), f"{name}: {cls_name}.{attr} is not defined by {cls_name}"
        for function in bare:
            assert callable(functions[function]), function
    diagram = (ROOT / "docs" / "design" / "tick.md").read_text().split("```", 2)[1]
    # Every phase of Engine.step is in the picture.
    for phase in ("Scheduler.expire()", "Scheduler.dequeue()", "Scheduler.schedule()",
                  "Runner.execute()", "OutputStage.commit()", "Engine._emit_tick()"):  # fmt: skip
        assert phase in diagram
