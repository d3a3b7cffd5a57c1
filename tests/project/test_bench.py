"""Each bench script runs at a tiny size, so it cannot rot (no timing is asserted).

All but the soak test are marked ``bench_smoke``: ``make bench-smoke`` runs them,
``make test`` (and CI) leaves them out to keep the suite within its time budget.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from strategies import DecodeMaximal

BENCH = Path(__file__).resolve().parents[2] / "bench"

# Each script is a child python on the default model.
pytestmark = [pytest.mark.model, pytest.mark.subprocess]


def run(script: str, out: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_throughput(tmp_path: Path) -> None:
    out = run(
        "throughput.py", tmp_path, "--levels", "1,2", "--max-tokens", "4", "--rounds", "1",
        "--systems", "engine,llama-lock,bare-loop",
    )  # fmt: skip
    table = (tmp_path / "throughput.md").read_text()
    for system in ("engine", "llama-lock", "bare-loop"):
        assert f"| {system} | 2 |" in table
    assert "tok/s vs bare-loop" in out
    assert (tmp_path / "throughput.png").stat().st_size > 10_000


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_strategies(tmp_path: Path) -> None:
    run("strategies.py", tmp_path, "--quick")
    table = (tmp_path / "strategies.md").read_text()
    for name in ("DecodeMaximal", "PrefillPriority", "Balanced"):
        assert f"| {name} |" in table
    assert (tmp_path / "strategies.png").exists()


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_scaling(tmp_path: Path) -> None:
    run("scaling.py", tmp_path, "--quick")
    assert "Fitted slopes" in (tmp_path / "scaling.md").read_text()
    assert (tmp_path / "scaling.png").exists()


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_multiturn(tmp_path: Path) -> None:
    run("multiturn.py", tmp_path, "--quick")
    table = (tmp_path / "multiturn.md").read_text()
    for mode in ("| off |", "| on |", "| on + RAM |"):
        assert mode in table
    assert (tmp_path / "multiturn.png").exists()


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_sharing(tmp_path: Path) -> None:
    out = run("sharing.py", tmp_path, "--quick", "--systems", "sharing,no-sharing")
    table = (tmp_path / "sharing.md").read_text()
    for row in ("| sharing | multi-turn x2 slots |", "| no-sharing | burst x2 slots |"):
        assert row in table
    assert "computed vs no-sharing" in table
    assert "computed within 1.1x of unique" in out


@pytest.mark.model
@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.timeout(450)
def test_soak() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(BENCH / "soak.py"),
            "--requests",
            "60",
            "--threads",
            "12",
            "--max-tokens",
            "6",
            "--max-rss-growth",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert "OK: every request had exactly one outcome" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    # The engine and the two-replica Ray pool: the rows and the prefix-affinity table
    # that need them both (tests/scale/test_pool*.py cover the other pools).
    run("pool.py", tmp_path, "--quick", "--systems", "engine,pool-ray-2")
    table = (tmp_path / "pool.md").read_text()
    for system in ("| engine | 1 |", "| pool-ray-2 | 2 x 1 |"):
        assert system in table
    assert "prefix-cache hit ratio" in table


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_fairness(tmp_path: Path) -> None:
    out = run("fairness.py", tmp_path, "--quick")
    table = (tmp_path / "fairness.md").read_text()
    for scenario in ("| alone |", "| 1 MB prompt |", "| 20k-value enum |", "| 500-value enum |"):
        assert scenario in table
    assert "x alone" in out


@pytest.mark.bench_smoke
@pytest.mark.timeout(120)
def test_http(tmp_path: Path) -> None:
    out = run("http.py", tmp_path, "--quick", "--servers", "ours")
    table = (tmp_path / "http.md").read_text()
    for row in ("| ours | 1 |", "| ours | 4 |", "| engine (in-process) |", "| ours over HTTP |"):
        assert row in table
    assert "| 0 / " in table  # the errors column: none
    assert "HTTP / in-process tok/s" in out


@pytest.mark.bench_smoke
@pytest.mark.timeout(300)
def test_speculative(tmp_path: Path) -> None:
    run("speculative.py", tmp_path, "--quick", "--systems", "engine", "engine-ngram", "engine-draft")
    table = (tmp_path / "speculative.md").read_text()
    for row in (
        "| grounded | 1 | engine |",
        "| grounded | 1 | engine-ngram |",
        "| open | 2 | engine-ngram |",
        "| open | 2 | engine-draft |",
    ):
        assert row in table
    assert "engine-ngram / engine" in table and "engine-draft / engine" in table


@pytest.mark.bench_smoke
def test_speculative_bound(tmp_path: Path) -> None:
    run("speculative_bound.py", tmp_path, "--requests", "1", "--max-tokens", "24")
    table = (tmp_path / "speculative_bound.md").read_text()
    for row in ("| grounded | oracle |", "| grounded | rule |", "| open | fixed 4 |"):
        assert row in table


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_embeddings(tmp_path: Path) -> None:
    out = run("embeddings.py", tmp_path, "--quick", "--systems", "engine,llama-lock")
    assert "engine / llama-lock" in out and "| engine |" in (tmp_path / "embeddings.md").read_text()


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_decisions(tmp_path: Path) -> None:
    out = run("decisions.py", tmp_path, "--state-tokens", "100", "--rounds", "1")
    assert "one Decide, 8 questions" in out and "| 8 chats" in (tmp_path / "decisions.md").read_text()


@pytest.mark.bench_smoke
@pytest.mark.timeout(450)
def test_lora(tmp_path: Path) -> None:
    quantum = str(DecodeMaximal.adapter_quantum)
    out = run(
        "lora.py", tmp_path, "--tenants", "2", "--quanta", quantum, "--requests", "1", "--max-tokens", "4"
    )
    assert (
        f"2 tenants, quantum {quantum} (default)" in out
        and "switch costs" in (tmp_path / "lora.md").read_text()
    )
