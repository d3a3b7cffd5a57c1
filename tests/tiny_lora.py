"""Random-weight LoRA adapters for the default model, written with the ``gguf`` package.

An adapter here has the layout llama.cpp's ``convert_lora_to_gguf.py`` writes:
``general.type = "adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``, and for
each adapted weight ``W`` (ggml shape ``[n_in, n_out]``) a pair ``W.lora_a``
(``[n_in, rank]``) and ``W.lora_b`` (``[rank, n_out]``); llama.cpp adds
``scale * alpha / rank * B(A x)`` to ``W x``. The weights are drawn from a seed, so two
seeds make two different fine-tunes of one base model. Never downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from actors import default_model_path
from actors.backend import read_gguf_header

__all__ = ["write_lora"]

_TARGETS = ("attn_q", "attn_v", "ffn_up")


def _base_shapes(base: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    header = read_gguf_header(base, tensors=True)  # the header alone: gguf's reader maps it all
    return header.architecture, dict(header.tensors)


def write_lora(
    path: str | Path,
    *,
    seed: int = 0,
    rank: int = 4,
    strength: float = 0.05,
    targets: Sequence[str] = _TARGETS,
    base: str | None = None,
    architecture: str | None = None,
    n_in_delta: int = 0,
) -> str:
    """Write an adapter for ``base`` (the default model) to ``path``; return the path.

    Args:
        seed: draws the weights (another seed, another adapter).
        rank: the adapter's rank.
        strength: the standard deviation of ``B``'s entries (``A``'s are scaled by the
            input size): 0.05 moves the default model's logits by about a logit.
        targets: which weights of every layer it adapts (``attn_q`` is ``blk.N.attn_q``).
        base: the model it is for (its architecture and shapes are copied).
        architecture: write another ``general.architecture`` (a mismatched adapter).
        n_in_delta: add this to every ``A``'s input size (a mis-shaped adapter).
    """
    arch, shapes = _base_shapes(base or default_model_path())
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    writer.add_name(f"tiny-lora-{seed}")
    for name in sorted(shapes):
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in targets or parts[3] != "weight":
            continue
        n_in, n_out = shapes[name][0] + n_in_delta, shapes[name][1]
        # numpy's shape is ggml's reversed: A is [n_in, rank] in ggml, (rank, n_in) here.
        a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
        b = rng.standard_normal((n_out, rank)) * strength
        writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
