"""The llama.cpp backend: the model, context, batch and samplers behind one small
interface, the thread-safe tokenizer, and where the default model is found.

It imports only the request contract; ``actors/backend/_llama.py`` is the one module
in the project that imports ``llama_cpp``.
"""

from __future__ import annotations

from actors.backend._llama import LlamaBackend, exact_attention
from actors.backend._model import default_model_path
from actors.backend._tokenizer import Tokenizer

__all__ = ["LlamaBackend", "Tokenizer", "default_model_path", "exact_attention"]
