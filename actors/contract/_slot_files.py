"""Slot files: what a slot holds (its tokens and their KV cache) written to a file and
read back into a slot, so a long prefix survives a restart or moves to another slot:
llama-server's ``--slot-save-path`` and ``POST /slots/{id}?action=save|restore|erase``.

:class:`SaveSlot` writes a file and answers a :class:`SlotFile`; :class:`RestoreSlot`
reads one into an idle slot, whose KV the next request sharing its prefix reuses, and
answers a :class:`SlotFile`; :class:`EraseSlot` drops what a slot holds and answers how
many tokens it held. Each names a slot by its index (llama-server's ``id_slot``) or by
the ``session`` (and ``cache_scope``) of the requests that filled it.

A file holds the tokens beside their KV (the engine must know what it reuses), the cache
scope and LoRA adapter set that computed it, and what the KV is valid for: the model's
contents and the KV cache's types. A file from another model, KV layout or adapter is
refused, and so is one that is truncated or altered (its digest). Restoring into, saving
or erasing a busy slot is refused: the engine never waits for a slot to finish.

Checked in the caller's thread; the engine reads and writes the file in its own thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from actors.contract._checks import MAX_ID_LENGTH, _require, _show, checked_text, is_int

__all__ = ["MAX_SLOT_PATH", "EraseSlot", "RestoreSlot", "SaveSlot", "SlotFile"]

MAX_SLOT_PATH = 4096
"""The longest path a slot file may have, in characters (Linux's PATH_MAX)."""
_MAX_SLOT = 1 << 16


def _checked_path(value: object) -> str:
    _require(
        isinstance(value, str | os.PathLike),
        f"a slot file's path must be a str or a path, got {type(value).__name__}",
    )
    assert isinstance(value, str | os.PathLike)
    path = os.fspath(value)
    _require(isinstance(path, str), f"a slot file's path must be text, got {_show(path)}")
    path = checked_text("a slot file's path", path, MAX_SLOT_PATH)
    _require(path != "", "a slot file's path must be non-empty")
    _require("\x00" not in path, "a slot file's path may not contain NUL")
    return path


def _check_target(message: SaveSlot | RestoreSlot | EraseSlot, *, either: bool) -> None:
    """``slot`` an index, ``session`` and ``cache_scope`` ids; one of slot or session
    (``either``: or neither)."""
    cache_scope = getattr(message, "cache_scope", None)
    if message.slot is not None:
        _require(
            is_int(message.slot) and 0 <= message.slot < _MAX_SLOT,
            f"slot must be a slot's index (an int >= 0), got {_show(message.slot)}",
        )
    for name in ("session", "cache_scope"):
        value = getattr(message, name, None)
        if value is not None:
            object.__setattr__(message, name, checked_text(name, value, MAX_ID_LENGTH))
    _require(
        message.slot is None or message.session is None,
        "name the slot by slot or by session, not both",
    )
    _require(
        either or message.slot is not None or message.session is not None,
        "name the slot: slot=<its index> or session=<the session that filled it>",
    )
    _require(
        cache_scope is None or message.session is not None,
        "cache_scope goes with session: it names whose session it is",
    )


@dataclass(frozen=True, slots=True)
class SaveSlot:
    """Write what a slot holds, its tokens and their KV, to the file ``path`` (made or
    replaced whole); the ask answers a :class:`SlotFile`.

    Attributes:
        path: the file to write.
        slot: the slot's index (``0 <= slot < n_parallel``); it must be idle.
        session: instead of ``slot``: the KV the engine keeps for this session (of
            ``cache_scope``): the idle slot its last request ran in, else the newest
            RAM prompt cache entry it left.
        cache_scope: the session's cache scope (the requests' ``cache_scope``).
    """

    path: str
    slot: int | None = None
    session: str | None = None
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _checked_path(self.path))
        _check_target(self, either=False)


@dataclass(frozen=True, slots=True)
class RestoreSlot:
    """Read the file ``path`` (a :class:`SaveSlot`'s) into an idle slot; the ask answers
    a :class:`SlotFile`. What the slot held is saved to the RAM prompt cache first, as
    when a request takes it. The restored KV keeps the cache scope and adapter set it was
    computed with: the next request of that scope sharing its prefix reuses it.

    Attributes:
        path: the file to read.
        slot: the slot's index; None: an idle slot the engine picks (an empty one,
            else the least recently used).
        session: the session the restored KV belongs to from now on (that session's next
            request takes this slot); None: the session it was saved from, if any.
    """

    path: str
    slot: int | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _checked_path(self.path))
        _check_target(self, either=True)


@dataclass(frozen=True, slots=True)
class EraseSlot:
    """Drop what a slot holds (its tokens and their KV; not saved to the RAM prompt
    cache); the ask answers how many tokens it held.

    Attributes:
        slot: the slot's index; it must be idle.
        session: instead of ``slot``: everything the engine keeps for this session (of
            ``cache_scope``): its idle slots and its RAM prompt cache entries.
        cache_scope: the session's cache scope.
    """

    slot: int | None = None
    session: str | None = None
    cache_scope: str | None = None

    def __post_init__(self) -> None:
        _check_target(self, either=False)


@dataclass(frozen=True, slots=True)
class SlotFile:
    """A slot file written or read.

    Attributes:
        path: the file.
        slot: the slot it was saved from or restored into; None when saved from the
            RAM prompt cache (a session's KV no slot held any more).
        n_tokens: the tokens it holds (llama-server's ``n_saved`` / ``n_restored``).
        n_bytes: the file's size (``n_written`` / ``n_read``).
        ms: how long the save or restore took (``save_ms`` / ``restore_ms``).
    """

    path: str
    slot: int | None
    n_tokens: int
    n_bytes: int
    ms: float
