"""A file's content digest, cheap enough for a multi-gigabyte model: what a saved KV
state names as the model (and the LoRA adapters) that computed it.

Hashing a whole model would read gigabytes; the digest is SHA-256 over the file's size
and ``_SAMPLES`` evenly spaced blocks of ``_BLOCK`` bytes, the first (the GGUF header:
architecture, names, vocabulary) and the last included, so it reads about 2 MiB
whatever the size. Two different models of one size and architecture still differ in
the tensor data the samples cover (a fine-tune changes every weight it trains); a copy
of the same file digests the same on any machine. Computed once per file (keyed by its
path, size, inode and modification time) and cached. Any thread.
"""

from __future__ import annotations

import hashlib
import os
import threading

__all__ = ["file_digest"]

_BLOCK = 64 * 1024
_SAMPLES = 32
_cache: dict[tuple[object, ...], str] = {}
_lock = threading.Lock()


def file_digest(path: str) -> str:
    """The hex digest of ``path``'s size and sampled contents (see the module).

    Raises:
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_ino, st.st_mtime_ns)
    with _lock:
        known = _cache.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256(st.st_size.to_bytes(8, "little"))
    with open(path, "rb") as file:
        last = max(st.st_size - _BLOCK, 0)
        offsets = sorted({last * i // (_SAMPLES - 1) for i in range(_SAMPLES)})
        for offset in offsets:
            file.seek(offset)
            digest.update(file.read(_BLOCK))
    hexdigest = digest.hexdigest()
    with _lock:
        _cache[key] = hexdigest
    return hexdigest
