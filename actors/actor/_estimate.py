"""What an engine will hold in host memory, estimated before its model loads.

Runs in the caller's thread: it reads the GGUF header (a few reads, see
:mod:`actors.backend._gguf`) and does arithmetic. The formula follows what llama.cpp
allocates on the CPU and what a busy engine really touches (measured with
SmolLM2-135M-Instruct on this project's machines, 2026-12-03; docs/guides/models.md
has the table)::

    weights   = the GGUF file's size (mmapped; every page is read by the first passes)
    kv        = cells x layers x kv_heads x (key_length x size(type_k)
                                             + value_length x size(type_v))
                cells = n_ctx rounded up to 256 (llama.cpp pads the unified cache)
    compute   = n_ubatch x (6 x n_embd + 3 x n_ff) x 4           activations of a ubatch
              + cells x n_ubatch x 2                            the attention mask
              + without flash attention: cells x n_ubatch x (2 + heads x 6)
                                            the scores (f32) and their f16 copy
              + n_parallel x n_vocab x 4                        the logits buffer
              + min(256, n_batch) x n_vocab x 6.4       an embedding pass's rows, logits included
    overhead  = 10 MiB + n_vocab x 320 B + cells x 300 B
                                the vocabulary, graph contexts, our per-cell arrays
    total     = weights + kv + compute + overhead (+ the same for a draft model)
              + prompt_cache_ram_mb (the RAM cache's cap)

llama.cpp reserves a larger compute buffer than an engine touches (its worst-case
graph); the estimate counts what a context-filling workload and an embedding pass make
resident, since that is what competes with the other models for the machine's memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from actors.actor._options import StartOptions, check_options
from actors.backend import GgufHeader, read_gguf_header, resolve_model_path
from actors.contract import ModelLoadError

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_options", "kv_file_bound"]

_MIB = 1 << 20
# ggml_type -> bytes per element of the KV types llama.cpp accepts for its cache.
_TYPE_BYTES = {
    0: 4.0,
    1: 2.0,
    2: 18 / 32,
    3: 20 / 32,
    6: 22 / 32,
    7: 24 / 32,
    8: 34 / 32,
    20: 18 / 32,
    30: 2.0,
}
_CELL_PAD = 256
_EMBED_PASS_ROWS = 256  # actors.engine._embedding.MAX_PASS_ROWS
_OVERHEAD_FIXED = 10 * _MIB
_OVERHEAD_PER_CELL = 300
_OVERHEAD_PER_TOKEN = 320
_KV_FILE_FALLBACK = 1 << 31  # when the header gives no estimate


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """An engine's host memory, in MiB, by part (see :mod:`actors.actor._estimate`).

    Attributes:
        model_path: the model file.
        weights_mb: the model's weights (its file).
        kv_mb: the KV cache.
        compute_mb: what the forward pass touches (activations, attention, logits).
        overhead_mb: the vocabulary and fixed structures.
        draft_mb: a draft model's own weights, cache, compute and overhead (0 without one).
        ram_cache_mb: the RAM prompt cache's cap.
    """

    model_path: str
    weights_mb: float
    kv_mb: float
    compute_mb: float
    overhead_mb: float
    draft_mb: float = 0.0
    ram_cache_mb: float = 0.0

    @property
    def total_mb(self) -> float:
        """Every part together."""
        return (
            self.weights_mb
            + self.kv_mb
            + self.compute_mb
            + self.overhead_mb
            + self.draft_mb
            + self.ram_cache_mb
        )


def _parts(header: GgufHeader, options: StartOptions) -> tuple[float, float, float, float]:
    """Weights, KV, compute and overhead of one model in a context made from ``options``."""
    n_embd = header.arch_int("embedding_length", 0)
    n_layer = header.arch_int("block_count", 0)
    n_head = max(header.arch_int("attention.head_count", 1), 1)
    n_head_kv = header.arch_int("attention.head_count_kv", n_head)
    n_ff = header.arch_int("feed_forward_length", 4 * n_embd)
    head_k = header.arch_int("attention.key_length", n_embd // n_head)
    head_v = header.arch_int("attention.value_length", n_embd // n_head)
    n_vocab = header.arch_int("vocab_size", 0) or int(header.values.get("tokenizer.ggml.tokens#len", 0))
    shape = {"embedding_length": n_embd, "block_count": n_layer, "vocabulary": n_vocab}
    odd = {key: value for key, value in shape.items() if not 0 < value < 1 << 24}
    sizes = (n_head_kv, n_ff, head_k, head_v)
    if odd or not all(0 <= size < 1 << 24 for size in sizes):
        # A header that makes no model (missing or negative sizes) would estimate nothing
        # or less than nothing, and make room in the budget for others.
        raise ModelLoadError(
            f"cannot estimate {header.path!r}: implausible sizes in its header {odd or sizes}"
        )
    cells = math.ceil(options.n_ctx / _CELL_PAD) * _CELL_PAD
    size_k = _TYPE_BYTES.get(1 if options.type_k is None else options.type_k, 2.0)
    size_v = _TYPE_BYTES.get(1 if options.type_v is None else options.type_v, 2.0)
    kv = cells * n_layer * n_head_kv * (head_k * size_k + head_v * size_v)
    ubatch = options.n_ubatch
    compute = ubatch * (6 * n_embd + 3 * n_ff) * 4 + cells * ubatch * 2 + options.n_parallel * n_vocab * 4
    if options.flash_attn is False:  # None is llama.cpp's "auto": on, on a CPU
        compute += cells * ubatch * (2 + n_head * 6)
    # An embedding pass (actors.engine._embedding) outputs every row it decodes, logits
    # included: llama.cpp's output buffer and the pass's logits grow to that many rows
    # at its first pass, for good (measured: 76 MiB for 256 rows at 49,152 tokens).
    compute += min(_EMBED_PASS_ROWS, options.n_batch, options.n_ctx) * n_vocab * 32 // 5  # x 4 B x 1.6
    overhead = _OVERHEAD_FIXED + n_vocab * _OVERHEAD_PER_TOKEN + cells * _OVERHEAD_PER_CELL
    return header.file_bytes / _MIB, kv / _MIB, compute / _MIB, overhead / _MIB


def _header(path: str) -> GgufHeader:
    try:
        return read_gguf_header(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model file {path!r}: {e}") from None


def estimate_options(options: StartOptions) -> MemoryEstimate:
    """The estimate for checked start options (caller's thread).

    Raises:
        ModelLoadError: a model file is missing or its header unreadable.
    """
    path = resolve_model_path(options.model_path)
    weights, kv, compute, overhead = _parts(_header(path), options)
    draft = 0.0
    if options.draft_model_path is not None:
        # The draft context takes the target's context options, with f16 KV.
        draft_options = dataclasses.replace(options, type_k=None, type_v=None)
        draft = sum(
            _parts(_header(resolve_model_path(options.draft_model_path, "draft_model_path=")), draft_options)
        )
    return MemoryEstimate(
        model_path=path,
        weights_mb=weights,
        kv_mb=kv,
        compute_mb=compute,
        overhead_mb=overhead,
        draft_mb=draft,
        ram_cache_mb=options.ram_budget_bytes / _MIB,
    )


def estimate_memory(
    model_path: str | os.PathLike[str] | None = None, **server_options: Any
) -> MemoryEstimate:
    """The host memory a ``ServerActor.start(model_path=..., **server_options)`` engine
    will hold once busy, estimated from the GGUF header without loading the model.

    Runs in the caller's thread and reads only the file's header.

    Raises:
        ConfigError: bad options (as ``ServerActor.start`` would raise).
        ModelLoadError: the model file is missing or its header unreadable.
    """
    return estimate_options(check_options(model_path=model_path, **server_options))


def kv_file_bound(options: StartOptions) -> int:
    """The most bytes of KV state a slot file may hold for an engine of ``options``
    (caller's thread): no sequence holds more than the whole KV cache, so twice its
    estimate and 1 MiB (llama.cpp's per-cell positions and header) bound any true one.
    2 GiB when the header gives no estimate."""
    try:
        kv_mb = _parts(_header(resolve_model_path(options.model_path)), options)[1]
    except ModelLoadError:
        return _KV_FILE_FALLBACK
    return int(2 * kv_mb * _MIB) + _MIB
