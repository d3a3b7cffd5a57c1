"""The docs site's tables name what the code has, its code runs, and every public name is documented."""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pykka
import pytest
from helpers import compare, reference

import actors
import strategies
import telemetry
import telemetry.logging as telemetry_logging
import telemetry.prometheus as telemetry_prometheus
from actors import ServerActor

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))

from check_docstrings import find_problems  # noqa: E402


def page(name: str) -> str:
    return (DOCS / name).read_text()


def anchors(markdown: str) -> set[str]:
    """The ids Python-Markdown's toc gives the headings of a page (and explicit ``{#id}``s)."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE):
        explicit = re.search(r"\{#([\w-]+)\}\s*$", heading)
        if explicit:
            ids.add(explicit.group(1))
            continue
        text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", text))
    return ids


def first_column(markdown: str, header: str) -> list[str]:
    """The backticked names in the first column of the table that starts with ``header``."""
    table = markdown.split(header + "\n")[1].split("\n\n")[0]
    rows = [line for line in table.splitlines()[1:] if line.startswith("| ")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", row.split(" | ")[0])]


@pytest.mark.timeout(180)
def test_the_request_features_snippet_runs(server: pykka.ActorRef[Any], reference_llama: Any) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page("guides/helpers.md"), re.DOTALL)
    snippet = next(b for b in blocks if "json_schema" in b)
    scope: dict[str, Any] = {"ref": server}
    exec(compile(snippet, "docs/guides/helpers.md", "exec"), scope)
    assert scope["second"].prefix_cache_tokens > 0
    assert scope["listing"].stop_reason in ("stop", "max_tokens", "eog")
    # The page shows ' Paris' on top; what is on top is the model's (and the CPU's) to say:
    # the answer is llama.cpp's own greedy answer (strictly, where this CPU's floor is zero)
    # and its top logprob.
    answer, top = scope["answer"], scope["top"]
    expected, margins = reference(reference_llama, "The capital of France is")
    compare(expected[:3], margins[:3], answer.token_ids)
    assert top[0].token_id == answer.token_ids[0] and top[0].logprob >= top[1].logprob
    assert scope["ids"]


@pytest.mark.model
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("name", "marker"),
    [
        ("guides/models.md", "ModelManager.start("),
        ("guides/speculative.md", "draft_model_path=default"),
        ("guides/speculative.md", 'spec_type="ngram"'),
    ],
)
def test_an_example_that_names_model_files_runs_as_copied(
    name: str, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A newcomer has the default model only: the examples use it (under several names).
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page(name), re.DOTALL) if marker in b]
    try:
        exec(compile(block, f"docs/{name}", "exec"), {})
    finally:
        pykka.ActorRegistry.stop_all()
    assert capsys.readouterr().out.strip()


# Every python block of the README and the docs runs as it stands: here, or in the test
# named (with the reason it runs there).
RUN_ELSEWHERE = {
    ("README.md", 0): "tests/project/test_readme.py (the first example)",
    ("README.md", 1): "tests/http/test_http.py (it needs a server on 8080)",
    ("docs/guides/helpers.md", 1): "test_the_request_features_snippet_runs (its answers are compared)",
    ("docs/guides/tools.md", 0): "tests/chat/test_tools.py (the tools guide's snippet)",
    ("docs/guides/models.md", 0): "test_an_example_that_names_model_files_runs_as_copied",
    ("docs/guides/speculative.md", 0): "test_an_example_that_names_model_files_runs_as_copied",
    ("docs/guides/speculative.md", 1): "test_an_example_that_names_model_files_runs_as_copied",
    ("docs/guides/lora.md", 0): "test_the_lora_guide_runs_with_adapters_written_for_it",
    (
        "docs/guides/scaling-out.md",
        0,
    ): "needs a Ray cluster (ray.init()): the ray extra, tests/scale/test_pool_ray.py",
}
SERVED_AT = "http://127.0.0.1:8080"  # blocks that talk to a server there run against one
LORA_GUIDE_ADAPTERS = ("support-bot.gguf", "legal.gguf")


@pytest.mark.model
@pytest.mark.timeout(180)
def test_the_lora_guide_runs_with_adapters_written_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiny_lora import write_lora

    (tmp_path / "adapters").mkdir()
    for seed, name in enumerate(LORA_GUIDE_ADAPTERS):
        write_lora(tmp_path / "adapters" / name, seed=seed)
    (block,) = re.findall(r"```python\n(.*?)```", page("guides/lora.md"), re.DOTALL)
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(block, "docs/guides/lora.md", "exec"), {})
    finally:
        pykka.ActorRegistry.stop_all()
    out = capsys.readouterr().out
    assert "('legal', 0.5)" in out and "('support-bot', 0.0)" in out


def _python_blocks() -> dict[tuple[str, int], str]:
    blocks = {}
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        name = str(path.relative_to(ROOT))
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.DOTALL)):
            blocks[(name, i)] = block
    return blocks


def test_every_python_example_is_run_by_the_suite() -> None:
    blocks = _python_blocks()
    assert set(RUN_ELSEWHERE) <= set(blocks)
    here = [key for key in blocks if key not in RUN_ELSEWHERE]
    assert len(here) >= 10, here


@pytest.mark.model
@pytest.mark.timeout(300)
def test_the_python_examples_run_as_they_stand(model_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    from http_server import Running

    from actors.http import HttpSettings

    blocks = {key: b for key, b in _python_blocks().items() if key not in RUN_ELSEWHERE}
    with Running.ready(
        HttpSettings(), lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=1024)
    ) as server:
        for (name, i), block in blocks.items():
            code = block.replace(SERVED_AT, server.url)
            try:
                exec(compile(code, f"{name} (block {i})", "exec"), {})
            except Exception as e:
                raise AssertionError(f"{name}, python block {i}, as it stands: {e!r}") from e
            finally:  # what a block left running (an example that forgot stop()) stops here
                for ref in pykka.ActorRegistry.get_all():
                    if ref.actor_urn != server.engine.actor_urn:
                        ref.stop()
    assert capsys.readouterr().out.strip()


def test_no_example_names_a_model_file_a_newcomer_lacks() -> None:
    # Code blocks that run (python, sh) name the default model, or no file at all.
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for block in re.findall(r"```(?:python|sh)\n(.*?)```", path.read_text(), re.DOTALL):
            for name in re.findall(r"[\w.-]+\.gguf\b", block):
                if path.name == "lora.md" and name in LORA_GUIDE_ADAPTERS:
                    continue  # written by the test that runs the guide, as a user has their own
                assert name == "SmolLM2-135M-Instruct.Q4_1.gguf", f"{path.name} names {name}"


@pytest.mark.timeout(120)
def test_the_stats_and_info_keys_are_what_the_engine_returns(server: pykka.ActorRef[Any]) -> None:
    table = page("reference/requests.md").split("| message | reply |\n")[1].split("\n\n")[0]
    for message in (actors.GetStats(), actors.GetInfo()):
        name = type(message).__name__
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}()` |"))
        documented = re.findall(r"`(\w+)`", row.split(" | ")[1].split("dict:")[1])
        assert set(documented) == set(server.ask(message)), name


def test_every_signal_in_the_table_exists_with_its_name() -> None:
    rows = re.findall(r"\| `telemetry\.(\w+)` \| `([\w.]+)` \|", page("reference/telemetry.md"))
    signals = {n for n in telemetry.__all__ if type(getattr(telemetry, n)).__name__ == "NamedSignal"}
    assert {name for name, _ in rows} == signals
    assert signals == {
        "tick",
        "request_start",
        "request_done",
        "request_exception",
        "kv_pressure",
        "ram_cache",
        "server_restart",
        "model_load",
        "model_unload",
    }
    for attr, name in rows:
        assert getattr(telemetry, attr).name == name


def _measurements(rows: dict[str, set[str]]) -> dict[str, set[str]]:
    """Resolve "as ``request_done``" to that signal's keys."""
    return {s: set().union(*(rows.get(k, {k}) for k in keys)) for s, keys in rows.items()}


def test_the_payload_keys_are_those_of_telemetrys_own_table() -> None:
    # The telemetry package documents each signal's measurements in its docstring (next to
    # the signals); the docs page must name the same keys.
    lines = (telemetry.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    columns = [m.span() for m in re.finditer(r"=+", lines[rules[0]])]
    in_code: dict[str, set[str]] = {}
    for line in lines[rules[1] + 1 : rules[2]]:
        signal = re.findall(r"``(\w+)``", line[: columns[1][0]])
        if signal:
            current = signal[0]
            in_code[current] = set()
        in_code[current] |= set(re.findall(r"``(\w+)``", line[columns[1][0] : columns[2][0]]))
    in_docs = {}
    for row in re.findall(r"^\| `telemetry\.\w+` .*$", page("reference/telemetry.md"), re.MULTILINE):
        cells = row.split(" | ")
        in_docs[cells[0].removeprefix("| `telemetry.").rstrip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    assert _measurements(in_docs) == _measurements(in_code)


def test_every_strategy_in_the_table_is_exported() -> None:
    section = page("reference/strategies.md").split("## The built-in strategies")[1].split("\n## ")[0]
    names = re.findall(r"^\| `(\w+)\(\)`", section, re.MULTILINE)
    assert names == ["DecodeMaximal", "PrefillPriority", "Balanced", "Adaptive"]
    for name in names:
        assert name in strategies.__all__
    built_in = {
        n
        for n in strategies.__all__
        if isinstance(getattr(strategies, n), type)
        and issubclass(getattr(strategies, n), strategies.BatchStrategy)
        and getattr(strategies, n) is not strategies.BatchStrategy
    }
    assert built_in == set(names)


def test_every_server_option_is_in_the_table() -> None:
    names = first_column(page("reference/options.md"), "| option | default | meaning |")
    options = [f.name for f in dataclasses.fields(actors.ServerOptions) if f.init]
    assert sorted(names) == sorted(options)


def test_every_request_option_is_in_the_table() -> None:
    text = page("reference/requests.md").split("## Request options")[1]
    names = first_column(text, "| option | default | meaning |")
    options = {f.name for f in dataclasses.fields(actors.Generate)} - {"prompt"}
    assert sorted(names) == sorted(options)
    others = (actors.GenerateTokens, actors.Stream, actors.StreamTokens, actors.Chat, actors.StreamChat)
    for message in others:
        assert options <= {f.name for f in dataclasses.fields(message)}


def stream_options() -> list[str]:
    text = page("reference/requests.md").split("## Stream options")[1]
    return first_column(text, "| option | default | meaning |")


def test_every_chat_option_is_in_the_table() -> None:
    text = page("reference/requests.md").split("## Chat options")[1]
    names = first_column(text, "| option | default | meaning |")
    shared = {f.name for f in dataclasses.fields(actors.Generate)}
    streams = {"messages", "reply_to", *stream_options()}
    for message, own in ((actors.Chat, {"messages"}), (actors.StreamChat, streams)):
        assert sorted(names) == sorted({f.name for f in dataclasses.fields(message)} - shared - own)


def test_every_stream_option_is_in_the_table() -> None:
    names = stream_options()
    shared = {f.name for f in dataclasses.fields(actors.Generate)} | {"reply_to"}
    for message, own in ((actors.Stream, {"prompt"}), (actors.StreamTokens, {"tokens"})):
        assert sorted(names) == sorted({f.name for f in dataclasses.fields(message)} - shared - own)
    assert set(names) <= {f.name for f in dataclasses.fields(actors.StreamChat)}


def test_every_completion_field_is_in_the_table() -> None:
    names = first_column(page("reference/requests.md"), "| field | meaning |")
    assert names == [f.name for f in dataclasses.fields(actors.Completion)]


def test_the_error_tree_is_the_exception_classes() -> None:
    tree = page("reference/errors.md").split("```\nEngineError")[1].split("```")[0]
    rows = re.findall(r"^([│ ]*)[├└]── (\w+)(?: \((\w+)\))?", tree, re.MULTILINE)
    exported = {
        n
        for n in actors.__all__
        if isinstance(getattr(actors, n), type) and issubclass(getattr(actors, n), actors.EngineError)
    }
    assert {name for _, name, _ in rows} == exported - {"EngineError"}
    parents = ["EngineError"]  # the class each indentation level hangs from
    for indent, name, also in rows:
        depth = len(indent) // 4
        del parents[depth + 1 :]
        cls = getattr(actors, name)
        assert getattr(actors, parents[depth]) in cls.__bases__, f"{name} is not a child of {parents[depth]}"
        parents.append(name)
        if also:
            assert issubclass(cls, getattr(builtins, also)), f"{name} is not a {also}"


def test_every_prometheus_metric_is_in_the_table() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from telemetry.prometheus import PrometheusExporter

    table = page("reference/metrics.md").split("| metric | type | labels |\n")[1].split("\n\n")[0]
    documented = set()
    for row in table.splitlines()[1:]:
        for name in re.findall(r"`(\w+)`", row.split(" | ")[0]):
            documented.add(name if name.startswith("llama_cpp_actors_") else "llama_cpp_actors" + name)
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(registry=registry)
    try:
        exported = {
            family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()
        }
    finally:
        exporter.close()
    assert documented == exported


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


def test_the_api_pages_cover_every_public_name_by_its_public_path() -> None:
    directives = set()
    for api_page in (DOCS / "api").glob("*.md"):
        directives |= set(re.findall(r"^::: ([\w.]+)\s*$", api_page.read_text(), re.MULTILINE))
    assert not {d for d in directives if "._" in d}, "the API pages name private modules"
    public = {
        f"{module.__name__}.{name}"
        for module in (actors, strategies, telemetry)
        for name in module.__all__
        if not name.startswith("__")
    }
    for module in (telemetry_logging, telemetry_prometheus):
        public |= {
            f"{module.__name__}.{name}"
            for name, obj in vars(module).items()
            if inspect.isclass(obj) and not name.startswith("_") and obj.__module__ == module.__name__
        }
    assert directives == public


def test_the_benchmark_pages_show_every_result() -> None:
    pages = "".join(p.read_text() for p in (DOCS / "benchmarks").glob("*.md"))
    for result in (ROOT / "bench" / "results").iterdir():
        if result.suffix == ".md":
            assert f'--8<-- "{result.name}"' in pages, f"no docs page includes bench/results/{result.name}"
        elif result.suffix == ".png":
            assert f"(results/{result.name})" in pages, f"no docs page shows bench/results/{result.name}"


def test_every_source_file_and_module_the_pages_name_exists() -> None:
    texts = {p.relative_to(ROOT): p.read_text() for p in [ROOT / "README.md", *DOCS.rglob("*.md")]}
    for name, text in texts.items():
        for path in re.findall(r"`((?:actors|strategies|telemetry|tests)/[\w/.]+)`", text):
            assert (ROOT / path).exists(), f"{name} names {path}, which does not exist"
        for module in re.findall(r"`(actors(?:\.\w+)*\._\w+)`", text):
            assert importlib.util.find_spec(module) is not None, f"{name} names {module}: no such module"


def test_every_public_name_has_a_docstring_of_its_own() -> None:
    assert find_problems() == []


def test_the_docstring_check_finds_each_kind_of_gap(tmp_path: Path) -> None:
    package = tmp_path / "fakepkg"
    package.mkdir()
    (package / "_impl.py").write_text(
        '''
from dataclasses import dataclass
from blinker import Namespace

NAMESPACE = Namespace()
"""Documented."""
quiet = NAMESPACE.signal("quiet")
loud = NAMESPACE.signal("loud", doc="Documented by its doc=.")


def documented() -> None:
    """Documented."""


def bare() -> None:
    pass


@dataclass
class Record:
    value: int


class Base:
    """Documented."""

    def run(self) -> None:
        """Documented here, on the base."""

    @property
    def size(self) -> int:
        """Documented."""
        return 0

    def base_only(self) -> None:
        pass


class Child(Base):
    """Documented."""

    def run(self) -> None:
        pass

    @property
    def size(self) -> int:
        return 1

    def _private(self) -> None:
        pass
'''
    )
    (package / "__init__.py").write_text(
        "from fakepkg._impl import NAMESPACE, Base, Child, Record, bare, documented, loud, quiet\n"
        "__version__ = '1'\n"
        "__all__ = ['NAMESPACE', 'Base', 'Child', 'Record', 'bare', 'documented', 'loud', 'quiet',"
        " '__version__']\n"
    )
    problems = find_problems(packages=["fakepkg"], modules=[], search_paths=[tmp_path])
    assert sorted(p.split(":")[0] for p in problems) == [
        "fakepkg.Base.base_only",
        "fakepkg.Child.base_only",
        "fakepkg.Child.run",
        "fakepkg.Child.size",
        "fakepkg.Record",
        "fakepkg.bare",
        "fakepkg.quiet",
    ]


def test_the_http_flag_tables_are_the_command_lines_options() -> None:
    from actors.http import _cli_options, _flags

    text = page("guides/http.md")
    documented = [
        re.findall(r"`(-[^`]+)`", row.split(" | ")[0]) for row in text.splitlines() if row.startswith("| `-")
    ]
    table = _flags.by_spelling()
    expected = [
        [*table[option.flag].spellings, *table[option.flag].negations] for option in _cli_options._OPTIONS
    ] + [list(spellings) for spellings, *_ in _cli_options._OURS]
    assert documented == expected
