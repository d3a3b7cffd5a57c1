"""The model's vocabulary: tokenizing, pieces, special tokens (thread-safe).

Callers' threads tokenize while the engine thread generates; every call into llama.cpp
holds the reader lock (:class:`~actors.backend._readers.Readers`), so closing the
model waits for them. Pieces are read once at load: the engine thread never calls into
the vocabulary for a generated token's text.

Reading every piece and special token costs about 0.2 s for a 49k-token vocabulary,
half of a small model's load. The tables depend only on the model file, so they are
kept per file (its path, size, inode and modification time) for the process: a
supervisor's restart, a model manager's reload, another engine of the same file read
none of it again.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llama_cpp as _lc
import numpy as np
import numpy.typing as npt

from actors.backend._protocol import FimTokens
from actors.backend._readers import Readers
from actors.contract import EngineStopped, InvalidRequest

__all__ = ["LlamaVocab", "file_identity"]

_KEPT = 8  # files whose tables are kept (an LRU); a table is a few MB at most


@dataclass(frozen=True, slots=True)
class _Tables:
    """What a vocabulary reads once per model file."""

    n_vocab: int
    eog_ids: frozenset[int]
    pieces: tuple[bytes, ...]
    specials: tuple[tuple[str, int], ...]


_tables: OrderedDict[tuple[object, ...], _Tables] = OrderedDict()
_tables_lock = threading.Lock()


def file_identity(path: str) -> tuple[object, ...] | None:
    """What names a model file's contents for the tables: None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_size, st.st_ino, st.st_mtime_ns)


def _fim_tokens(vocab: Any) -> FimTokens:
    """The model's fill-in-the-middle tokens, as llama.cpp found them at load."""

    def token(read: Any) -> int | None:
        value = int(read(vocab))
        return None if value == _lc.LLAMA_TOKEN_NULL else value

    return FimTokens(
        pre=token(_lc.llama_vocab_fim_pre),
        suf=token(_lc.llama_vocab_fim_suf),
        mid=token(_lc.llama_vocab_fim_mid),
        pad=token(_lc.llama_vocab_fim_pad),
        rep=token(_lc.llama_vocab_fim_rep),
        sep=token(_lc.llama_vocab_fim_sep),
    )


class LlamaVocab:
    """A loaded model's vocabulary (any thread; see the module's docstring).

    Args:
        vocab: llama.cpp's ``llama_vocab`` pointer (owned by the model).
        readers: the lock that closing the model waits on.
        is_open: whether the model is still loaded.
        identity: the model file's :func:`file_identity`, under which its tables are
            kept; None reads them and keeps nothing.
    """

    def __init__(
        self, vocab: Any, readers: Readers, is_open: Any, identity: tuple[object, ...] | None = None
    ) -> None:
        self.handle = vocab  # the llama_vocab pointer, for what is built on it (grammars)
        self.readers = readers  # closing the model waits for those inside
        self._is_open = is_open
        self.n_vocab: int = _lc.llama_vocab_n_tokens(vocab)
        self.bos: int = _lc.llama_vocab_bos(vocab)
        self.eos: int = _lc.llama_vocab_eos(vocab)
        self.add_bos: bool = bool(_lc.llama_vocab_get_add_bos(vocab)) and self.bos != -1
        self.fim = _fim_tokens(vocab)
        tables = self._tables(identity)
        self.eog_ids: frozenset[int] = tables.eog_ids
        self.eog_array: npt.NDArray[np.intp] = np.fromiter(sorted(self.eog_ids), dtype=np.intp)
        # Every piece up front: the engine thread then never calls into the vocabulary,
        # nor waits for a caller's thread that tokenizes a long prompt.
        self._pieces: list[bytes] = list(tables.pieces)
        self.specials: dict[str, int] = dict(tables.specials)

    def _tables(self, identity: tuple[object, ...] | None) -> _Tables:
        """The file's tables, read now unless this process read them already."""
        if identity is not None:
            with _tables_lock:
                kept = _tables.get(identity)
                if kept is not None and kept.n_vocab == self.n_vocab:
                    _tables.move_to_end(identity)
                    return kept
        eog = frozenset(t for t in range(self.n_vocab) if _lc.llama_vocab_is_eog(self.handle, t))
        buf = ctypes.create_string_buffer(256)
        pieces = tuple(self._load_piece(t, buf) for t in range(self.n_vocab))
        tables = _Tables(self.n_vocab, eog, pieces, tuple(self._special_texts().items()))
        if identity is not None:
            with _tables_lock:
                _tables[identity] = tables
                while len(_tables) > _KEPT:
                    _tables.popitem(last=False)
        return tables

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenize as ``llama_cpp.Llama.create_completion`` does (thread-safe).

        ``add_special``: a BOS token when the model's metadata asks for one;
        ``parse_special``: special tokens such as ``<|im_start|>`` written in the text
        become their ids.

        Raises:
            InvalidRequest: ``text`` is not a str of valid Unicode (a lone surrogate).
            EngineStopped: the model was unloaded.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"can only tokenize a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"text is not valid Unicode: a lone surrogate at index {e.start}") from None
        capacity = len(data) + 8
        with self.readers.reading():
            self._check_open()
            while True:
                buf = (_lc.llama_token * capacity)()
                n = _lc.llama_tokenize(
                    self.handle, data, len(data), buf, capacity, False, bool(parse_special)
                )
                if n >= 0:
                    break
                capacity = -n
        tokens = list(buf[:n])
        return [self.bos, *tokens] if add_special and self.add_bos else tokens

    def detokenize(self, tokens: list[int]) -> str:
        """Text of ``tokens``, special tokens rendered (thread-safe); bad bytes become U+FFFD."""
        bad = [
            t
            for t in tokens
            if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.n_vocab)
        ]
        if bad:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary (n_vocab={self.n_vocab})")
        ids = (_lc.llama_token * max(len(tokens), 1))(*tokens)
        capacity = 8 * len(tokens) + 16
        with self.readers.reading():
            self._check_open()
            while True:
                buf = ctypes.create_string_buffer(capacity)
                n = _lc.llama_detokenize(self.handle, ids, len(tokens), buf, capacity, False, True)
                if n >= 0:
                    break
                capacity = -n
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_single_token(self, piece: str) -> bool:
        """Whether ``piece`` (a grammar's ``<piece>``) is exactly one token (thread-safe)."""
        return len(self.tokenize(piece, add_special=False, parse_special=True)) == 1

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated text (special tokens render empty)."""
        return self._pieces[token]

    def special_piece(self, token: int) -> bytes:
        """The bytes of one token with special tokens spelled out (``[TOOL_CALLS]``): for
        the markers a reply parser reads (engine thread)."""
        buf = ctypes.create_string_buffer(256)
        n = _lc.llama_token_to_piece(self.handle, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)]

    def special_token(self, text: str) -> int | None:
        """The special token spelled ``text``, if the vocabulary has one (any thread)."""
        return self.specials.get(text)

    def text(self, token: int) -> str:
        """A token's text as the vocabulary stores it ("" for -1, no token)."""
        return "" if token == -1 else _lc.llama_vocab_get_text(self.handle, token).decode("utf-8", "replace")

    def differs(self, other: LlamaVocab) -> str | None:
        """Why ``other``'s tokens do not mean these (a draft model must share the
        vocabulary), or None when every token's text and the special tokens agree."""
        if other.n_vocab != self.n_vocab:
            return f"{other.n_vocab} tokens against {self.n_vocab}"
        if other.add_bos != self.add_bos or (self.add_bos and other.bos != self.bos):
            return "a different beginning-of-sequence token"
        if other.eog_ids != self.eog_ids:
            return "different end-of-generation tokens"
        differ = next((t for t in range(self.n_vocab) if other._pieces[t] != self._pieces[t]), None)
        if differ is not None:
            return f"token {differ} is {other._pieces[differ]!r} against {self._pieces[differ]!r}"
        return None

    def _check_open(self) -> None:
        if not self._is_open():
            raise EngineStopped("the model was unloaded (its engine stopped)")

    def _special_texts(self) -> dict[str, int]:
        """The text of every token that tokenizing with ``parse_special`` matches, to its id."""
        special = (
            _lc.LLAMA_TOKEN_ATTR_CONTROL | _lc.LLAMA_TOKEN_ATTR_USER_DEFINED | _lc.LLAMA_TOKEN_ATTR_UNKNOWN
        )
        texts: dict[str, int] = {}
        for token in range(self.n_vocab):
            if _lc.llama_vocab_get_attr(self.handle, token) & special:
                text = _lc.llama_vocab_get_text(self.handle, token).decode("utf-8", "replace")
                if text:
                    texts.setdefault(text, token)
        return texts

    def _load_piece(self, token: int, buf: ctypes.Array[ctypes.c_char]) -> bytes:
        """One piece, read into ``buf`` (one buffer for every piece of a load)."""
        n = _lc.llama_token_to_piece(self.handle, token, buf, len(buf), 0, False)
        if n < 0:  # a piece longer than the buffer: -n is the size it needs
            buf = ctypes.create_string_buffer(-n)
            n = _lc.llama_token_to_piece(self.handle, token, buf, len(buf), 0, False)
        return buf.raw[: max(n, 0)]
