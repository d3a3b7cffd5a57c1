"""The llama.cpp backend: the model, context, batch and samplers behind one small
interface, the thread-safe tokenizer, and where the default model is found.

It imports only the request contract; ``actors/backend/_llama.py`` is the one module
in the project that imports ``llama_cpp``.
"""

from __future__ import annotations

from actors.backend._faults import faults
from actors.backend._gguf import GgufHeader, read_gguf_header
from actors.backend._greedy import DeadEnd
from actors.backend._llama import LlamaBackend, SamplerChain, Triggers, exact_attention
from actors.backend._model import default_model_path, resolve_model_path
from actors.backend._options import BackendOptions, default_n_threads
from actors.backend._rows import put_rows
from actors.backend._template import check_chat_template
from actors.backend._tokenizer import Tokenizer

__all__ = [
    "BackendOptions",
    "DeadEnd",
    "GgufHeader",
    "LlamaBackend",
    "SamplerChain",
    "Tokenizer",
    "Triggers",
    "check_chat_template",
    "default_model_path",
    "default_n_threads",
    "exact_attention",
    "faults",
    "put_rows",
    "read_gguf_header",
    "resolve_model_path",
]
