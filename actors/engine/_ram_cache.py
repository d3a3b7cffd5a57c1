"""The RAM prompt cache: saved KV states of sequences under a byte budget, least
recently used evicted first (engine thread). Their prefixes live in the engine's
:class:`~actors.engine._prefix.PrefixIndex` beside the slots', so a prompt finds the
longest reusable prefix wherever it is (:class:`~actors.engine._memory.KVMemory`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from actors.engine._prefix import CacheScope, PrefixIndex, PrefixMatch

__all__ = ["RamCache", "RamEntry"]


@dataclass(slots=True, eq=False)
class RamEntry:
    """One saved sequence: its tokens (in position order), its KV state, and the session
    of the slot it came from."""

    scope: CacheScope
    tokens: list[int]
    state: bytes
    t_last_used: float = field(default_factory=time.monotonic)
    key: Hashable = None
    session: str | None = None


class RamCache:
    """Saved KV states under a byte budget, least recently used evicted first; their
    prefixes are in the engine's :class:`PrefixIndex` under ``("ram", n)`` keys."""

    def __init__(self, budget_bytes: int, index: PrefixIndex) -> None:
        self.budget_bytes = budget_bytes
        self.entries: dict[Hashable, RamEntry] = {}
        self.bytes_used = 0
        self._index = index
        self._serial = itertools.count()

    def _ram(self, matches: list[PrefixMatch]) -> list[tuple[RamEntry, int]]:
        return [(self.entries[m.key], m.length) for m in matches if m.key in self.entries]

    def covers(self, scope: CacheScope, tokens: Sequence[int]) -> bool:
        """An entry of ``scope`` already holds ``tokens`` (or more after them)."""
        return any(n == len(tokens) for _, n in self._ram(self._index.matches(scope, tokens)))

    def add(self, entry: RamEntry) -> list[RamEntry]:
        """Store ``entry``, dropping entries it extends; returns the evicted ones."""
        if len(entry.state) > self.budget_bytes:
            return []
        for old, n in self._ram(self._index.matches(entry.scope, entry.tokens)):
            if n == len(old.tokens):
                self._drop(old)  # the new entry holds all of it and more
        evicted = []
        while self.bytes_used + len(entry.state) > self.budget_bytes:
            victim = min(self.entries.values(), key=lambda e: e.t_last_used)
            self._drop(victim)
            evicted.append(victim)
        entry.key = ("ram", next(self._serial))
        self.entries[entry.key] = entry
        self._index.put(entry.key, entry.scope, entry.tokens)
        self.bytes_used += len(entry.state)
        return evicted

    def longest(self, matches: list[PrefixMatch]) -> tuple[RamEntry | None, int]:
        """The RAM entry among ``matches`` (the index's, longest first) and its length."""
        found = self._ram(matches)
        return found[0] if found else (None, 0)

    def of_session(self, cache_scope: str | None, session: str) -> list[RamEntry]:
        """The entries a slot of ``session`` (of ``cache_scope``) left, newest first."""
        found = [e for e in self.entries.values() if e.session == session and e.scope[0] == cache_scope]
        return sorted(found, key=lambda e: e.t_last_used, reverse=True)

    def discard(self, entry: RamEntry) -> None:
        """Drop ``entry`` (a slot file's erase)."""
        if entry.key in self.entries:
            self._drop(entry)

    def _drop(self, entry: RamEntry) -> None:
        del self.entries[entry.key]
        self._index.remove(entry.key)
        self.bytes_used -= len(entry.state)
