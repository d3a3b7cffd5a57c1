"""llama.cpp behind the backend's interface: the only code that imports ``llama_cpp``.

:class:`LlamaBackend` (``_backend``) loads the model and context and is made of one
part per concern: the vocabulary (``_vocab``), the KV sequences and the batch
(``_context``), the samplers (``_sampling``) and the chat template (``_chat``).
"""

from __future__ import annotations

from actors.backend._llama._backend import EMBED_LANES, LlamaBackend, exact_attention, llama_cpp_version
from actors.backend._llama._chat import LlamaChat
from actors.backend._llama._context import LlamaKv, LlamaRows
from actors.backend._llama._sampling import LlamaSampling, SamplerChain
from actors.backend._llama._vocab import LlamaVocab

__all__ = [
    "EMBED_LANES",
    "LlamaBackend",
    "LlamaChat",
    "LlamaKv",
    "LlamaRows",
    "LlamaSampling",
    "LlamaVocab",
    "SamplerChain",
    "exact_attention",
    "llama_cpp_version",
]
