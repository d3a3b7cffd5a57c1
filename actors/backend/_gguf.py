"""A GGUF file's key-value header, read without llama.cpp (any thread).

What a model needs in memory can be known before it loads: the weights are the file,
the KV cache follows from the header's layer count, KV heads and head sizes. This reads
the header's scalars (and short numeric arrays, such as a per-layer KV head count) and
skips the rest, so it costs a few reads however large the model. A file that is not a
GGUF, or whose header is implausible, raises ``ValueError``: a hostile path must never
make us read gigabytes or allocate them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import IO, Any

__all__ = ["GgufHeader", "read_gguf_header"]

# GGUF value types: the fixed-size ones by struct format.
_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 20  # a longer key or value is not a real header (chat templates are ~10 KB)
_MAX_KEYS = 1 << 16
_MAX_ITEMS = 1 << 24
_MAX_KEPT_ARRAY = 4096  # numeric arrays up to this long are kept (per-layer values)
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """What a GGUF file says of itself.

    Attributes:
        path: the file.
        file_bytes: its size (the weights are nearly all of it).
        n_tensors: how many tensors it holds.
        values: every scalar key, every numeric array of at most 4096 items (a tuple),
            and for every other array its length (as ``"<key>#len"``).
        tensors: each tensor's ggml shape (``ne``, innermost first) by name, when asked
            for (``read_gguf_header(path, tensors=True)``); else empty.
    """

    path: str
    file_bytes: int
    n_tensors: int
    values: Mapping[str, Any]
    tensors: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``, ...), or ``""``."""
        arch = self.values.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The architecture's ``<arch>.<key>`` value, e.g. ``arch_value("block_count")``."""
        return self.values.get(f"{self.architecture}.{key}", default)

    def arch_int(self, key: str, default: int) -> int:
        """``arch_value(key)`` as an int; a per-layer array gives its largest item."""
        value = self.arch_value(key)
        if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
            return int(max(value))
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return default


def _string(file: IO[bytes]) -> str:
    (size,) = struct.unpack("<Q", _read(file, 8))
    if size > _MAX_STRING:
        raise ValueError("implausible GGUF string length")
    return _read(file, size).decode("utf-8")


def _read(file: IO[bytes], size: int) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise ValueError("the GGUF header ends early")
    return data


def _scalar(file: IO[bytes], kind: int) -> Any:
    if kind == _STRING:
        return _string(file)
    fmt = _FORMATS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {kind}")
    return struct.unpack(fmt, _read(file, struct.calcsize(fmt)))[0]


def _array(file: IO[bytes], key: str, values: dict[str, Any], file_bytes: int) -> None:
    item, count = struct.unpack("<IQ", _read(file, 12))
    # Every item takes a byte at least, and no vocabulary or merge list is near 2**24:
    # a lie that would loop for minutes over a large file.
    if count > min(file_bytes, _MAX_ITEMS):
        raise ValueError(f"implausible GGUF array {key!r} of {count} items")
    values[f"{key}#len"] = count
    if item == _STRING:
        for _ in range(count):
            (size,) = struct.unpack("<Q", _read(file, 8))
            if size > _MAX_STRING:
                raise ValueError("implausible GGUF string length")
            file.seek(size, os.SEEK_CUR)
        return
    fmt = _FORMATS.get(item)
    if fmt is None:
        raise ValueError(f"unsupported GGUF array item type {item}")
    size = struct.calcsize(fmt)
    if count <= _MAX_KEPT_ARRAY:
        values[key] = tuple(v for (v,) in struct.iter_unpack(fmt, _read(file, size * count)))
    else:
        file.seek(size * count, os.SEEK_CUR)


def _tensor_infos(file: IO[bytes], n_tensors: int) -> dict[str, tuple[int, ...]]:
    if n_tensors > _MAX_TENSORS:
        raise ValueError(f"implausible GGUF header: {n_tensors} tensors")
    shapes: dict[str, tuple[int, ...]] = {}
    for _ in range(n_tensors):
        name = _string(file)
        (n_dims,) = struct.unpack("<I", _read(file, 4))
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"implausible GGUF tensor {name!r} of {n_dims} dimensions")
        shapes[name] = struct.unpack(f"<{n_dims}Q", _read(file, 8 * n_dims))
        _read(file, 12)  # its type and data offset
    return shapes


def read_gguf_header(path: str | os.PathLike[str], *, tensors: bool = False) -> GgufHeader:
    """Read ``path``'s GGUF header (any thread); with ``tensors``, its tensors' names
    and shapes too (what a LoRA adapter is checked against).

    Raises:
        ValueError: not a GGUF file (version 2 or later), or an implausible header.
        OSError: the file cannot be read.
    """
    path = os.fspath(path)
    with open(path, "rb") as file:
        file_bytes = os.fstat(file.fileno()).st_size
        try:
            if file.read(4) != b"GGUF":
                raise ValueError(f"{path!r} is not a GGUF file")
            (version,) = struct.unpack("<I", _read(file, 4))
            if version < 2:
                raise ValueError(f"{path!r} is GGUF version {version}; llama.cpp reads 2 and later")
            n_tensors, n_kv = struct.unpack("<QQ", _read(file, 16))
            if n_kv > _MAX_KEYS:
                raise ValueError(f"implausible GGUF header: {n_kv} keys")
            values: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _string(file)
                (kind,) = struct.unpack("<I", _read(file, 4))
                if kind == _ARRAY:
                    _array(file, key, values, file_bytes)
                else:
                    values[key] = _scalar(file, kind)
            shapes = _tensor_infos(file, n_tensors) if tensors else {}
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path!r} has a broken GGUF header: {e}") from None
    return GgufHeader(path, file_bytes, n_tensors, MappingProxyType(values), MappingProxyType(shapes))
