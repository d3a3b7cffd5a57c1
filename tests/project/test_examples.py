"""Every example runs on the default model (at a small size, so it cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Each example is a child python on the default model.
pytestmark = [pytest.mark.model, pytest.mark.subprocess]


def run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(300)
def test_generate() -> None:
    out = run("generate.py", "--max-tokens", "12")
    assert out.startswith("Once upon a time")
    # It samples (temp=0.7, no seed): the model may end before max_tokens.
    summary = re.search(r"\[(\d+) tokens, stop: (max_tokens|eog), first token after \d+ ms", out)
    assert summary, out
    assert int(summary[1]) == 12 if summary[2] == "max_tokens" else int(summary[1]) < 12


@pytest.mark.timeout(300)
def test_stream() -> None:
    out = run("stream.py", "Say hello.", "--max-tokens", "8")
    assert out.strip()


@pytest.mark.timeout(300)
def test_concurrent() -> None:
    out = run("concurrent.py", "--threads", "4", "--max-tokens", "8")
    assert re.search(r"decode batch per tick: max 4", out), out
    assert re.search(r"ratio engine / locked Llama: \d+\.\d\dx", out), out


@pytest.mark.timeout(300)
def test_telemetry_status() -> None:
    out = run("telemetry_status.py", "--requests", "6", "--max-tokens", "6")
    assert "done 6/6" in out and "failed 0" in out


@pytest.mark.timeout(300)
def test_custom_strategy() -> None:
    out = run("custom_strategy.py", "--max-tokens", "4")
    assert len(re.findall(r"-token prompt: first token after", out)) == 3


@pytest.mark.timeout(300)
def test_chat() -> None:
    out = run("chat.py", "--max-tokens", "12")
    assert "assistant:" in out and "json: {" in out and "stop at" in out and "tokens: [" in out


@pytest.mark.timeout(300)
def test_dashboard_live_view() -> None:
    pytest.importorskip("rich", reason="the dashboard extra is not installed")
    args = ["--requests", "4", "--concurrency", "2", "--max-tokens", "6", "--n-parallel", "2"]
    out = run("dashboard.py", *args)
    assert re.search(r"started 4\s+done 4\s+failed 0", out), out
    assert len(re.findall(r"│ -\s+│\s+[01] │ idle", out)) == 2, out  # both slots, idle at the end
    assert re.search(r"│\s+4 │\s+\d+ ms │", out), out  # four TTFTs in the percentiles


@pytest.mark.timeout(300)
def test_dashboard_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the dashboard extra is not installed")
    png = tmp_path / "run.png"
    out = run("dashboard.py", "--requests", "4", "--concurrency", "2", "--max-tokens", "6", "--png", str(png))
    assert "4 done, 0 failed" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_dashboard_watches_a_pool() -> None:
    pytest.importorskip("rich", reason="the dashboard extra is not installed")
    args = ["--requests", "4", "--concurrency", "4", "--max-tokens", "4", "--n-parallel", "2"]
    args += ["--replicas", "2"]
    out = run("dashboard.py", *args)
    assert re.search(r"started 4\s+done 4\s+failed 0", out), out
    for replica in ("replica-0", "replica-1"):
        assert len(re.findall(rf"│ {replica}\s+│\s+[01] │ idle", out)) == 2, out
