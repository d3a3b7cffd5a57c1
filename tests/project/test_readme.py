"""The README's first example runs as written, its links resolve, its figures are the results'."""

from __future__ import annotations

import re
from pathlib import Path

import pykka
import pytest
from test_docs import anchors

import actors

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.model
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


def test_the_readme_is_what_a_newcomer_reads_first() -> None:
    assert len(README.splitlines()) < 150  # a pitch: the rest is in the docs
    for heading in ("## Two commands", "## Headline benchmark", "## How it works", "## Documentation"):
        assert heading in README


def test_every_relative_link_points_to_a_file_or_a_docs_page() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert relative, "the README links into the docs"
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else ROOT / "README.md"
        assert target.exists(), f"README links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target.read_text()), f"{path} has no heading #{anchor}"
    pages = {link for link in relative if link.startswith("docs/") and link.endswith(".md")}
    assert len(pages) >= 10, "the README links into the docs pages"


def test_the_headline_benchmark_is_the_results_file() -> None:
    results = (ROOT / "bench" / "results" / "throughput.md").read_text()
    section = README.split("## Headline benchmark")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| system | concurrency | tokens/s | TTFT p50 ms |")
    for row in rows:
        assert row in results.splitlines(), f"{row!r} is not in bench/results/throughput.md"
    body = rows[1:]
    assert body and all(row.split(" | ")[1] == "8" for row in body)
    assert {row.split(" | ")[0][2:] for row in body} >= {"engine", "llama-lock", "bare-loop"}
    # The date and the machine the README names are those of the results file.
    date = re.search(r"\((\d{4}-\d{2}-\d{2}), (\d+) cores", section)
    assert date is not None
    assert results.splitlines()[2].startswith(f"{date.group(1)}, {date.group(2)} cores")


def test_the_version_matches_the_package_metadata() -> None:
    from importlib.metadata import version

    assert actors.__version__ == version("llama-cpp-actors")
    assert f"## {actors.__version__}" in (ROOT / "CHANGELOG.md").read_text()
