"""A small random-weight GGUF for tests that need a second, different model.

It takes the default model's tokenizer (so it tokenizes and renders chats like it) and
a llama architecture of a few layers with random weights: it loads and generates
(nonsense) in a fraction of the default model's memory and time. Made with the
``gguf`` package, never downloaded; the tokenizer's keys are copied as their bytes
(``gguf.GGUFReader`` and the writer's packing take seconds over its 100k strings, this
a fraction of one).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from actors import default_model_path

__all__ = ["write_tiny_model"]

_COPIED_PREFIXES = ("tokenizer.",)
# GGUF value types of a fixed size, by size in bytes; 8 a string, 9 an array.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class _Raw(bytes):
    """A value already in GGUF's encoding (after its type)."""


class _RawWriter(gguf.GGUFWriter):
    """A writer that writes a ``_Raw`` value as it is."""

    def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
        if isinstance(val, _Raw):
            return (self._pack("I", vtype) if add_vtype else b"") + bytes(val)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _skip(data: memoryview, at: int, kind: int) -> int:
    """Where the value of type ``kind`` at ``at`` ends."""
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", data, at)[0]
    if kind != _ARRAY:
        return at + _SIZES[kind]
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SIZES:
        return at + count * _SIZES[item]
    for _ in range(count):
        at = _skip(data, at, item)
    return at


def _raw_values(path: str) -> Iterator[tuple[str, int, _Raw]]:
    """Each key of a GGUF file's header, its value type and its encoded value."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = memoryview(mapped)
        try:
            n_kv = struct.unpack_from("<Q", data, 16)[0]
            at = 24
            for _ in range(n_kv):
                end = at + 8 + struct.unpack_from("<Q", data, at)[0]
                key = bytes(data[at + 8 : end]).decode()
                kind = struct.unpack_from("<I", data, end)[0]
                at = _skip(data, end + 4, kind)
                yield key, kind, _Raw(data[end + 4 : at])
        finally:
            data.release()


def write_tiny_model(
    path: str | Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    fim: Mapping[str, int] | None = None,
) -> str:
    """Write the model to ``path`` (f16 weights, drawn from a fixed seed); return the path.

    ``fim`` names fill-in-the-middle tokens (``{"pre": 8, "suf": 9, ...}``: llama.cpp's
    ``tokenizer.ggml.fim_*_token_id``), which the default model's vocabulary lacks.
    """
    writer = _RawWriter(str(path), "llama")
    writer.add_name("tiny-random")
    writer.add_context_length(2048)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = 0
    for key, kind, raw in _raw_values(default_model_path()):
        if not key.startswith(_COPIED_PREFIXES):
            continue
        writer.add_key_value(key, raw, gguf.GGUFValueType(kind))
        if key == "tokenizer.ggml.tokens":
            n_vocab = struct.unpack_from("<Q", raw, 4)[0]
    writer.add_vocab_size(n_vocab)
    for name, token in (fim or {}).items():
        writer.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", token)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        # numpy shape is ggml's reversed: (rows, columns) = (ne1, ne0).
        data = (rng.standard_normal(shape) * 0.05).astype(np.float16 if len(shape) > 1 else np.float32)
        writer.add_tensor(name, data)

    head = n_embd // n_head
    tensor("token_embd.weight", n_vocab, n_embd)
    tensor("output_norm.weight", n_embd)
    for i in range(n_layer):
        tensor(f"blk.{i}.attn_norm.weight", n_embd)
        tensor(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        tensor(f"blk.{i}.attn_k.weight", n_head_kv * head, n_embd)
        tensor(f"blk.{i}.attn_v.weight", n_head_kv * head, n_embd)
        tensor(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        tensor(f"blk.{i}.ffn_norm.weight", n_embd)
        tensor(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
