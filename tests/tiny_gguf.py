"""A small random-weight GGUF for tests that need a second, different model.

It takes the default model's tokenizer (so it tokenizes and renders chats like it) and
a llama architecture of a few layers with random weights: it loads and generates
(nonsense) in a fraction of the default model's memory and time. Made with the
``gguf`` package, never downloaded.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from actors import default_model_path

__all__ = ["write_tiny_model"]

_COPIED_PREFIXES = ("tokenizer.",)


def write_tiny_model(
    path: str | Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
) -> str:
    """Write the model to ``path`` (f16 weights, drawn from a fixed seed); return the path."""
    source = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(str(path), "llama")
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
    for key, field in source.fields.items():
        if not key.startswith(_COPIED_PREFIXES):
            continue
        kind = field.types[0]
        value = field.contents()
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(key, value, kind)
    writer.add_vocab_size(n_vocab)
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
