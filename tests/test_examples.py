"""Every example runs on the default model (at a small size, so it cannot rot)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
    assert re.search(r"\[12 tokens, stop: max_tokens", out)


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
