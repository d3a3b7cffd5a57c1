"""The llama.cpp backend: the model, context, batch and samplers behind one small
interface, the thread-safe tokenizer (with llama-server's fill-in-the-middle prompts),
and where the default model is found.

It imports the chat formats and the request contract; ``actors/backend/_llama/`` is the
only code in the project that imports ``llama_cpp``.
"""

from __future__ import annotations

from actors.backend._digest import file_digest
from actors.backend._faults import faults
from actors.backend._gguf import GgufHeader, read_gguf_header
from actors.backend._greedy import DeadEnd
from actors.backend._infill import InfillText, infill_prompt
from actors.backend._llama import LlamaBackend, SamplerChain, exact_attention
from actors.backend._lora import check_adapter, check_adapters, default_scales, resolve_lora
from actors.backend._model import default_model_path, resolve_model_path
from actors.backend._options import BackendOptions, default_n_threads
from actors.backend._protocol import (
    Adapters,
    Backend,
    BatchRows,
    ChatPrompts,
    FimTokens,
    KvIdentity,
    KvSequences,
    Sampler,
    Samplers,
    Triggers,
    Vocabulary,
)
from actors.backend._rows import put_rows
from actors.backend._template import check_chat_template
from actors.backend._tokenizer import Tokenizer

__all__ = [
    "Adapters",
    "Backend",
    "BackendOptions",
    "BatchRows",
    "ChatPrompts",
    "DeadEnd",
    "FimTokens",
    "GgufHeader",
    "InfillText",
    "KvIdentity",
    "KvSequences",
    "LlamaBackend",
    "Sampler",
    "SamplerChain",
    "Samplers",
    "Tokenizer",
    "Triggers",
    "Vocabulary",
    "check_adapter",
    "check_adapters",
    "check_chat_template",
    "default_model_path",
    "default_n_threads",
    "default_scales",
    "exact_attention",
    "faults",
    "file_digest",
    "infill_prompt",
    "put_rows",
    "read_gguf_header",
    "resolve_lora",
    "resolve_model_path",
]
