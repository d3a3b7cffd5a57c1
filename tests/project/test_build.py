"""The first build says what it does: the wheel's long compile reports that it goes on,
and the project declares its license as setuptools now wants it."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRESS = ROOT / "actors" / "backend" / "patches" / "with_progress.sh"

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(60)]


def _run(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(PROGRESS), str(tmp_path / "build.log"), "bash", "-c", script],
        env={"PATH": "/usr/bin:/bin", "PROGRESS_EVERY_S": "0.3"},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_long_build_says_it_goes_on_with_its_last_step(tmp_path: Path) -> None:
    done = _run(tmp_path, 'echo "[ 12%] Building C object"; sleep 0.8; echo "[ 97%] Linking"')
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    progress = [line for line in lines if line.startswith("  still building:")]
    assert len(progress) >= 2 and all(line.endswith(" [ 12%]") for line in progress), lines
    assert lines[-1].startswith("done in 0m")
    assert "Linking" in (tmp_path / "build.log").read_text()  # the output is kept, not shown


def test_a_failed_build_shows_the_end_of_its_log_and_fails(tmp_path: Path) -> None:
    failed = _run(tmp_path, "echo 'error: no compiler'; exit 3")
    assert failed.returncode == 1
    assert "error: no compiler" in failed.stdout and "the build failed" in failed.stderr


def test_the_metadata_uses_an_spdx_license_expression() -> None:
    # setuptools deprecates a license table ({text = ...}), an error from 2027-02; an SPDX
    # string needs setuptools 77.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert "setuptools>=77" in project["build-system"]["requires"]
