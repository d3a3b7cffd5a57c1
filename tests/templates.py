"""Where the chat templates of many model families are: test fixtures for tool calls.

llama.cpp keeps them in its ``models/templates/`` folder, which the pinned
llama-cpp-python sdist vendors. ``make install`` extracts that folder once into
``~/.cache/llama-cpp-actors/templates/<sdist version>/`` (``tests/fetch_templates.py``);
``bench/.peers`` (``make bench-peers``) has the whole sdist and serves as well.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _version() -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError("constraints.txt pins no llama-cpp-python")


def templates_dir() -> Path:
    """The folder of ``*.jinja`` templates; fails (never skips) when it is missing."""
    version = _version()
    candidates = [
        Path(os.environ["LLAMA_TEMPLATES_DIR"]) if os.environ.get("LLAMA_TEMPLATES_DIR") else None,
        Path.home() / ".cache" / "llama-cpp-actors" / "templates" / version,
        REPO
        / "bench"
        / ".peers"
        / f"llama_cpp_python-{version}"
        / "vendor"
        / "llama.cpp"
        / "models"
        / "templates",
    ]
    for path in candidates:
        if path is not None and any(path.glob("*.jinja")):
            return path
    raise AssertionError(
        "llama.cpp's chat templates are missing: run `make install` (or python tests/fetch_templates.py)"
    )


def template(name: str) -> str:
    """The text of ``<name>.jinja``."""
    return (templates_dir() / f"{name}.jinja").read_text()
