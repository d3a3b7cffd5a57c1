"""bench/http.py's tools run: what streaming with ``tools`` costs per token.

One more ``llama-cpp-actors serve``, on the default model with Qwen 2.5's chat template
(a Hermes-style format: ``<tool_call>`` marks a call), serves the same streaming chat
requests two ways, alternating within each round, both with one tool described in the
prompt (so both prompts are the same tokens): ``tool_choice`` "none" (nothing parsed)
and "auto". The model answers in prose either way (it calls nothing on these prompts),
so the "auto" run does the same decoding plus the per-token work tools add: the reply
parser watching for the call marker, and the lazy grammar's trigger check. Decode rate
(tokens after the first per second of decoding) and inter-token latency are compared.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}
TEMPLATE = "Qwen-Qwen2.5-7B-Instruct.jinja"


def template_path() -> Path:
    """Qwen 2.5's chat template: from ``make install``'s cache or the sdist in bench/.peers."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from templates import templates_dir  # the tests' own lookup
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return Path(templates_dir()) / TEMPLATE


def add_tools(body: dict[str, Any], choice: str) -> dict[str, Any]:
    """``body`` (a streaming chat request) with the tool offered under ``choice``."""
    return {**body, "tools": [TOOL], "tool_choice": choice}


def decode_rate(run: Any) -> float:
    """Tokens after each request's first, per second of inter-token time."""
    total_ms = sum(run.itl_ms)
    return 1000.0 * len(run.itl_ms) / total_ms if total_ms else float("nan")
