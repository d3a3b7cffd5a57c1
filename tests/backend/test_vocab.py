"""The vocabulary's tables (pieces, end tokens, special texts) are read once per model
file and process: a second engine of the same file shares them, and another file (a
copy: another inode and time) reads its own, equal to the first's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pykka
import pytest

from actors import GetStats, ServerActor, generate
from actors.backend._llama import _vocab

pytestmark = pytest.mark.timeout(120)


def _vocab_of(model_path: str) -> tuple[object, _vocab.LlamaVocab]:
    ref = ServerActor.start(model_path=model_path, n_parallel=1, n_ctx=256)
    ref.ask(GetStats())
    return ref, ref.backend.vocab  # type: ignore[attr-defined]


def test_a_files_tables_are_read_once_and_a_copy_reads_its_own(model_path: str, tmp_path: Path) -> None:
    try:
        _, first = _vocab_of(model_path)
        _, second = _vocab_of(model_path)
        assert _vocab.file_identity(model_path) in _vocab._tables
        long = next(t for t, p in enumerate(first._pieces) if len(p) > 3)
        assert second._pieces[long] is first._pieces[long]  # shared, not read again
        assert second.specials == first.specials and second.eog_ids == first.eog_ids
        copy = tmp_path / "copy.gguf"
        shutil.copy(model_path, copy)
        ref, third = _vocab_of(str(copy))
        assert third._pieces[long] is not first._pieces[long]  # its own read...
        assert third._pieces == first._pieces and third.specials == first.specials  # ...the same
        assert third.differs(first) is None
        assert generate(ref, "Hello", max_tokens=2, timeout=60).generated_tokens >= 1
    finally:
        pykka.ActorRegistry.stop_all()
