"""The model's training context, read from its GGUF header (no llama.cpp needed).

``serve`` without ``-c`` uses the model's training context, as llama-server does; this
reads ``<general.architecture>.context_length`` from the file's key-value header and
skips everything else, so it costs a few reads however large the model.
"""

from __future__ import annotations

import os
import struct
from typing import IO

__all__: list[str] = []


def _gguf_string(file: IO[bytes]) -> str:
    (size,) = struct.unpack("<Q", file.read(8))
    if size > 1 << 20:
        raise ValueError("implausible GGUF string")
    return file.read(size).decode("utf-8")


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _gguf_skip(file: IO[bytes], kind: int) -> None:
    if kind in _GGUF_SIZES:
        file.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    elif kind == 8:
        _gguf_string(file)
    elif kind == 9:
        item, count = struct.unpack("<IQ", file.read(12))
        if item in _GGUF_SIZES:
            file.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        elif item == 8:
            for _ in range(count):
                file.seek(struct.unpack("<Q", file.read(8))[0], os.SEEK_CUR)
        else:
            raise ValueError("nested GGUF array")
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def _training_context(path: str) -> int | None:
    """The model's training context, ``<general.architecture>.context_length`` in its
    GGUF header, or None if the file does not say (llama.cpp then reports the file)."""
    try:
        with open(path, "rb") as file:
            if file.read(4) != b"GGUF" or struct.unpack("<I", file.read(4))[0] < 2:
                return None
            _, n_kv = struct.unpack("<QQ", file.read(16))
            arch: str | None = None
            lengths: dict[str, int] = {}
            for _ in range(min(n_kv, 1 << 16)):
                key = _gguf_string(file)
                (kind,) = struct.unpack("<I", file.read(4))
                if key == "general.architecture" and kind == 8:
                    arch = _gguf_string(file)
                elif key.endswith(".context_length") and kind in _GGUF_INTS:
                    (lengths[key],) = struct.unpack(
                        _GGUF_INTS[kind], file.read(struct.calcsize(_GGUF_INTS[kind]))
                    )
                else:
                    _gguf_skip(file, kind)
                if arch is not None and f"{arch}.context_length" in lengths:
                    length = lengths[f"{arch}.context_length"]
                    return length if length >= 2 else None
    except (OSError, ValueError, struct.error):  # UnicodeDecodeError is a ValueError
        return None
    return None
