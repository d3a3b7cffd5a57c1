"""The slot file format: a sequence's tokens and KV state, and what they are valid for.

Layout (little-endian)::

    magic     8 bytes   b"LCAKV\\x00\\x00\\x01"
    n_header  u32       the header's length, at most 64 KiB
    header    n_header  UTF-8 JSON: model, kv_types, cache_scope, adapters, session,
                        n_tokens, n_state_bytes, sha256
    tokens    n_tokens x i32, in position order
    state     n_state_bytes: llama.cpp's ``llama_state_seq_get_data`` of the sequence

``adapters`` lists the adapter set that computed the KV as ``[id, scale, digest]``;
``sha256`` covers the tokens and the state, so a file truncated or altered is refused
before llama.cpp reads it. A file is written beside its path and renamed into place, so
a reader never sees half of one.

Reading checks everything before it allocates: the magic and version, the header's
size and fields, every count against the caller's bounds, and the file's size against
the counts; then the digest. Errors are ``KvFileError`` with the reason. Pure file I/O,
no engine state (the engine's thread calls it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.engine._prefix import CacheScope

__all__ = ["KvFile", "KvFileError", "read_kv_file", "write_kv_file"]

_MAGIC = b"LCAKV\x00\x00\x01"
_HEAD = struct.Struct("<8sI")
_MAX_HEADER = 64 * 1024
_FORMAT = "llama-cpp-actors slot file"


class KvFileError(ValueError):
    """A slot file that cannot be read: the reason is the message."""


@dataclass(frozen=True, slots=True)
class KvFile:
    """A slot file's contents.

    Attributes:
        model: the content digest of the model that computed the KV.
        kv_types: ggml's type ids of its K and V caches.
        scope: the cache scope and adapter set that computed it.
        adapter_digests: each adapter of ``scope``'s set: its file's digest, in order.
        session: the session of the requests that filled the slot, if any.
        tokens: the tokens the KV holds, in position order.
        state: llama.cpp's state of the sequence.
    """

    model: str
    kv_types: tuple[int, int]
    scope: CacheScope
    adapter_digests: tuple[str, ...]
    session: str | None
    tokens: list[int]
    state: bytes


def _digest(tokens: bytes, state: bytes) -> str:
    digest = hashlib.sha256(tokens)
    digest.update(state)
    return digest.hexdigest()


def write_kv_file(path: str, kv: KvFile) -> int:
    """Write ``kv`` to ``path`` (replaced whole); the bytes written.

    Raises:
        OSError: the file cannot be written (nothing is left at ``path`` then).
    """
    tokens = np.asarray(kv.tokens, dtype="<i4").tobytes()
    cache_scope, adapters = kv.scope
    header = {
        "format": _FORMAT,
        "model": kv.model,
        "kv_types": list(kv.kv_types),
        "cache_scope": cache_scope,
        "adapters": [[i, s, d] for (i, s), d in zip(adapters, kv.adapter_digests, strict=True)],
        "session": kv.session,
        "n_tokens": len(kv.tokens),
        "n_state_bytes": len(kv.state),
        "sha256": _digest(tokens, kv.state),
    }
    text = json.dumps(header, ensure_ascii=False).encode()
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix=".slot-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_HEAD.pack(_MAGIC, len(text)))
            file.write(text)
            file.write(tokens)
            file.write(kv.state)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return _HEAD.size + len(text) + len(tokens) + len(kv.state)


def read_kv_file(path: str, *, max_tokens: int, max_state_bytes: int) -> tuple[KvFile, int]:
    """The slot file at ``path`` and its size in bytes, every field checked (see the module).

    Args:
        path: the file.
        max_tokens: the most tokens it may hold (a slot's context).
        max_state_bytes: the most bytes its KV state may take.

    Raises:
        KvFileError: the file is missing, unreadable, not a slot file, too large, or
            does not match its digest.
    """
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(_HEAD.size)
            if len(head) < _HEAD.size or head[:8] != _MAGIC:
                raise KvFileError("not a llama-cpp-actors slot file")
            n_header = _HEAD.unpack(head)[1]
            if n_header > _MAX_HEADER:
                raise KvFileError(f"its header claims {n_header} bytes, more than {_MAX_HEADER}")
            header = _header(file.read(n_header))
            n_tokens, n_state = _counts(header, max_tokens, max_state_bytes)
            expected = _HEAD.size + n_header + 4 * n_tokens + n_state
            if size != expected:
                raise KvFileError(
                    f"it has {size} bytes where its header makes {expected}: truncated or altered"
                )
            tokens = file.read(4 * n_tokens)
            state = file.read(n_state)
    except FileNotFoundError:
        raise KvFileError("no such file") from None
    except IsADirectoryError:
        raise KvFileError("it is a directory") from None
    except OSError as e:
        raise KvFileError(f"cannot read it: {e.strerror or e}") from None
    if _digest(tokens, state) != header["sha256"]:
        raise KvFileError("its contents do not match their digest: altered or damaged")
    return (
        KvFile(
            model=header["model"],
            kv_types=(header["kv_types"][0], header["kv_types"][1]),
            scope=(header["cache_scope"], tuple((i, s) for i, s, _ in header["adapters"])),
            adapter_digests=tuple(d for _, _, d in header["adapters"]),
            session=header["session"],
            tokens=np.frombuffer(tokens, dtype="<i4").tolist(),
            state=state,
        ),
        size,
    )


def _header(raw: bytes) -> dict[str, Any]:
    """The header's JSON, each field of the right type."""
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise KvFileError("its header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise KvFileError("its header is not a slot file's")

    def text(value: object, optional: bool = False) -> bool:
        return (optional and value is None) or isinstance(value, str)

    def count(value: object) -> bool:
        return type(value) is int and value >= 0

    types = header.get("kv_types")
    adapters = header.get("adapters")
    ok = (
        text(header.get("model"))
        and isinstance(types, list)
        and len(types) == 2
        and all(count(t) for t in types)
        and text(header.get("cache_scope"), optional=True)
        and text(header.get("session"), optional=True)
        and isinstance(adapters, list)
        and all(
            isinstance(a, list)
            and len(a) == 3
            and count(a[0])
            and isinstance(a[1], float | int)
            and not isinstance(a[1], bool)
            and text(a[2])
            for a in adapters
        )
        and count(header.get("n_tokens"))
        and count(header.get("n_state_bytes"))
        and text(header.get("sha256"))
    )
    if not ok:
        raise KvFileError("its header lacks a field or has one of the wrong type")
    return header


def _counts(header: dict[str, Any], max_tokens: int, max_state_bytes: int) -> tuple[int, int]:
    n_tokens, n_state = header["n_tokens"], header["n_state_bytes"]
    if n_tokens == 0:
        raise KvFileError("it holds no tokens")
    if n_tokens > max_tokens:
        raise KvFileError(f"it holds {n_tokens} tokens, more than a slot's context ({max_tokens})")
    if n_state > max_state_bytes:
        raise KvFileError(
            f"its KV state claims {n_state} bytes, more than this context's KV can hold ({max_state_bytes})"
        )
    return n_tokens, n_state
