"""The GGUF header reader behind estimate_memory: real headers read, hostile ones refused at once."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from actors import default_model_path
from actors.backend._gguf import read_gguf_header

pytestmark = pytest.mark.timeout(30)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _header(*pairs: bytes, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(pairs)) + b"".join(pairs)


@pytest.mark.model
def test_the_default_models_header() -> None:
    header = read_gguf_header(default_model_path())
    assert header.architecture == "llama"
    assert header.arch_int("block_count", 0) == 30
    assert header.arch_int("attention.head_count_kv", 0) == 3
    assert header.values["tokenizer.ggml.tokens#len"] == 49152
    assert header.file_bytes == Path(default_model_path()).stat().st_size


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GGUX" + bytes(20), "not a GGUF file"),
        (_header(version=1), "version 1"),
        (b"GGUF" + struct.pack("<I", 3), "ends early"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40), "keys"),
        (_header(struct.pack("<Q", 1 << 40)), "string length"),
        (_header(_string("k") + struct.pack("<IIQ", 9, 8, 10**15)), "array 'k'"),
        (_header(_string("k") + struct.pack("<IIQ", 9, 0, 10**15)), "array 'k'"),
        (_header(_string("k") + struct.pack("<IIQ", 9, 9, 1)), "array item type"),
        (_header(_string("k") + struct.pack("<I", 99)), "value type"),
        (_header(struct.pack("<Q", 2) + b"\xff\xfe"), "broken GGUF header"),
    ],
    ids=["magic", "version", "truncated", "many-keys", "long-string", "string-array", "u8-array",
         "nested", "unknown-type", "bad-utf8"],
)  # fmt: skip
def test_a_hostile_header_is_refused_at_once(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        read_gguf_header(path)
    assert time.monotonic() - started < 1.0


def test_the_estimate_refuses_a_header_that_makes_no_model(tmp_path: Path) -> None:
    from actors import ModelLoadError, estimate_memory

    def scalar(key: str, kind: int, fmt: str, value: object) -> bytes:
        return _string(key) + struct.pack("<I", kind) + struct.pack(fmt, value)

    arch = _string("general.architecture") + struct.pack("<I", 8) + _string("llama")
    for layers in (-1000, 0):
        path = tmp_path / f"odd{layers}.gguf"
        path.write_bytes(
            _header(
                arch,
                scalar("llama.block_count", 5, "<i", layers),
                scalar("llama.embedding_length", 4, "<I", 64),
            )
        )
        with pytest.raises(ModelLoadError, match="implausible sizes"):
            estimate_memory(path, n_ctx=512, n_parallel=1)
