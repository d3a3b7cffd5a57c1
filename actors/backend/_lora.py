"""LoRA adapters before llama.cpp sees them: checking a file against the base model,
and resolving a request's ``lora`` to the adapter set it runs with (any thread).

llama.cpp checks an adapter when it loads it and returns NULL on a mismatch, but only
after reading it, and some mistakes (a tensor of a type it cannot add, a token
embedding's flipped pair) go further in. So every check it makes of the file is made
here first, on the GGUF headers alone, and a bad adapter is a ``ModelLoadError`` naming
the reason before the model is touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from actors.backend._gguf import GgufHeader, read_gguf_header
from actors.contract import MAX_LORA_SCALE, InvalidRequest, LoraAdapter, LoraScales, ModelLoadError

__all__ = ["check_adapter", "check_adapters", "default_scales", "resolve_lora"]


def check_adapters(model_path: str, adapters: Sequence[LoraAdapter]) -> None:
    """Refuse any of ``adapters`` that llama.cpp could not apply to the model at
    ``model_path`` (see :func:`check_adapter`; any thread).

    Raises:
        ModelLoadError: saying which and why.
    """
    if not adapters:
        return
    try:
        model = read_gguf_header(model_path, tensors=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model's tensors to check its LoRA adapters: {e}") from None
    for adapter in adapters:
        check_adapter(adapter, model)


def check_adapter(adapter: LoraAdapter, model: GgufHeader) -> None:
    """Refuse ``adapter`` unless llama.cpp can apply it to ``model`` (read with
    ``tensors=True``): a LoRA GGUF of the model's architecture, every ``lora_a`` /
    ``lora_b`` pair complete, of a weight the model has, and of its shape.

    Raises:
        ModelLoadError: saying what is wrong.
    """
    path = adapter.path
    if not os.path.isfile(path):
        raise ModelLoadError(f"LoRA adapter {adapter.name!r}: no file at {path!r}")
    try:
        header = read_gguf_header(path, tensors=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"LoRA adapter {adapter.name!r}: cannot read {path!r}: {e}") from None
    values = header.values
    if values.get("general.type") != "adapter" or values.get("adapter.type") != "lora":
        raise ModelLoadError(
            f"LoRA adapter {adapter.name!r}: {path!r} is not a LoRA adapter (general.type "
            f"{values.get('general.type')!r}, adapter.type {values.get('adapter.type')!r}; a model "
            "file is not an adapter)"
        )
    if header.architecture != model.architecture:
        raise ModelLoadError(
            f"LoRA adapter {adapter.name!r} is for a {header.architecture!r} model; the model is "
            f"{model.architecture!r}"
        )
    alpha = values.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, int | float) or not np.isfinite(alpha):
        raise ModelLoadError(f"LoRA adapter {adapter.name!r}: adapter.lora.alpha is {alpha!r}")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in header.tensors.items():
        for part in ("lora_a", "lora_b"):
            if name.endswith("." + part):
                pairs.setdefault(name[: -len(part) - 1], {})[part] = shape
                break
        else:
            if not name.endswith("_norm.weight"):  # llama.cpp skips those
                raise ModelLoadError(f"LoRA adapter {adapter.name!r}: tensor {name!r} is not a LoRA pair's")
    for weight, pair in pairs.items():
        if len(pair) != 2:
            raise ModelLoadError(f"LoRA adapter {adapter.name!r}: {weight!r} lacks its other half")
        base = model.tensors.get(weight)
        if base is None:
            raise ModelLoadError(
                f"LoRA adapter {adapter.name!r} adapts {weight!r}, which the model does not have "
                "(an adapter of another base model?)"
            )
        a, b = pair["lora_a"], pair["lora_b"]
        if len(a) != 2 or len(b) != 2 or len(base) < 2:
            raise ModelLoadError(f"LoRA adapter {adapter.name!r}: {weight!r}'s pair is not two matrices")
        if weight.endswith("token_embd.weight"):
            fits = base[0] == b[1] and base[1] == a[1]
        else:
            fits = base[0] == a[0] and base[1] == b[1] and a[1] == b[0]
        if not fits:
            raise ModelLoadError(
                f"LoRA adapter {adapter.name!r}: {weight!r} has lora_a {list(a)} and lora_b {list(b)}, "
                f"which do not fit the model's {list(base[:2])} (an adapter of another base model?)"
            )


def resolve_lora(
    lora: LoraScales | None, loaded: Sequence[LoraAdapter], defaults: Sequence[float] | None = None
) -> tuple[tuple[int, float], ...]:
    """The adapter set a request runs with: ``(id, scale)`` pairs, ids ascending, zero
    scales left out, scales as the float32 llama.cpp gets (any thread).

    Args:
        lora: the request's (checked) ``lora``: ids or names to scales; the adapters it
            does not name are off. None: ``defaults``.
        loaded: the server's adapters, in id order.
        defaults: the server's default scales, one per adapter (None: each adapter's own).

    Raises:
        InvalidRequest: ``lora`` names an adapter the server does not have.
    """
    if lora is None:
        scales = list(defaults) if defaults is not None else [a.scale for a in loaded]
    else:
        scales = [0.0] * len(loaded)
        names = {adapter.name: i for i, adapter in enumerate(loaded)}
        for key, scale in lora.items():
            # Checked by the message's constructor; again, for a message changed since.
            if not (isinstance(scale, float) and abs(scale) <= MAX_LORA_SCALE):
                raise InvalidRequest(f"lora's scale of {key!r} must be a finite number, got {scale!r}")
            if isinstance(key, str):
                index = names.get(key, -1)
            else:
                index = key if isinstance(key, int) and not isinstance(key, bool) else -1
            if not 0 <= index < len(loaded):
                have = ", ".join(f"{i}: {a.name!r}" for i, a in enumerate(loaded)) or "none"
                raise InvalidRequest(
                    f"lora names adapter {key!r}, which the server does not have (it has {have})"
                )
            scales[index] = scale
    as_llama = [float(np.float32(s)) for s in scales]  # the float32 llama.cpp gets
    return tuple((i, s) for i, s in enumerate(as_llama) if s != 0.0)


def default_scales(loaded: Sequence[LoraAdapter], lora: Mapping[int | str, float]) -> tuple[float, ...]:
    """The server's default scales after a ``SetLora``: those ``lora`` names, the rest 0."""
    return tuple(s for _, s in _dense(resolve_lora(lora, loaded), len(loaded)))


def _dense(adapters: tuple[tuple[int, float], ...], n: int) -> list[tuple[int, float]]:
    given = dict(adapters)
    return [(i, given.get(i, 0.0)) for i in range(n)]
