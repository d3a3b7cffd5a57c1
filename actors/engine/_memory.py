"""The KV cache as a resource: which slot a prompt takes, and the RAM prompt cache.

Runs in the engine thread. A slot's KV is worth keeping after its request ends (the
next turn of a conversation starts with it); when a slot is about to be overwritten,
its KV can be saved to host memory under a byte budget and restored into any slot
when a later prompt of the same cache scope starts with it. KV is never reused across
cache scopes, in slots or in RAM: a KV blob is another caller's data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.backend._llama import LlamaBackend
from actors.engine._slots import Request, Slot, choose_slot, common_prefix_len

__all__ = ["KVMemory", "RamCache", "RamEntry"]

# Shorter sequences are cheaper to recompute than to save and restore.
MIN_SAVED_TOKENS = 32


@dataclass(slots=True, eq=False)
class RamEntry:
    """One saved sequence: its tokens (in position order) and its KV state."""

    scope: str | None
    tokens: list[int]
    state: bytes
    t_last_used: float = field(default_factory=time.monotonic)


class RamCache:
    """Saved KV states under a byte budget, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: list[RamEntry] = []
        self.bytes_used = 0

    def covers(self, scope: str | None, tokens: Sequence[int]) -> bool:
        """An entry of ``scope`` already holds ``tokens`` (or more after them)."""
        return any(
            e.scope == scope
            and len(e.tokens) >= len(tokens)
            and common_prefix_len(e.tokens, tokens) == len(tokens)
            for e in self.entries
        )

    def add(self, entry: RamEntry) -> list[RamEntry]:
        """Store ``entry``, dropping entries it extends; returns the evicted ones."""
        if len(entry.state) > self.budget_bytes:
            return []
        for old in [e for e in self.entries if e.scope == entry.scope]:
            if common_prefix_len(old.tokens, entry.tokens) == len(old.tokens):
                self._drop(old)  # the new entry holds all of it and more
        evicted = []
        while self.bytes_used + len(entry.state) > self.budget_bytes:
            victim = min(self.entries, key=lambda e: e.t_last_used)
            self._drop(victim)
            evicted.append(victim)
        self.entries.append(entry)
        self.bytes_used += len(entry.state)
        return evicted

    def best(self, scope: str | None, prompt: Sequence[int]) -> tuple[RamEntry | None, int]:
        """The entry of ``scope`` sharing the longest prefix with ``prompt``."""
        best, best_len = None, 0
        for entry in self.entries:
            if entry.scope == scope:
                n = common_prefix_len(entry.tokens, prompt)
                if n > best_len:
                    best, best_len = entry, n
        return best, best_len

    def _drop(self, entry: RamEntry) -> None:
        self.entries.remove(entry)
        self.bytes_used -= len(entry.state)


Emit = Callable[[str, dict[str, Any], dict[str, Any]], None]


class KVMemory:
    """Slot choice with prefix reuse, RAM save/restore, and purging idle caches.

    Args:
        backend: the model's context (its memory API).
        cache_prompt: reuse cached prefixes at all.
        ram_budget_bytes: the RAM prompt cache's budget; 0 turns it off.
        emit: ``emit(signal_name, measurements, metadata)`` for ``ram_cache`` events.
    """

    def __init__(self, backend: LlamaBackend, cache_prompt: bool, ram_budget_bytes: int, emit: Emit) -> None:
        self.backend = backend
        self.cache_prompt = cache_prompt
        self.ram = RamCache(ram_budget_bytes) if cache_prompt and ram_budget_bytes > 0 else None
        self._emit = emit

    def claim(
        self, request: Request, idle: list[Slot], make_room: Callable[[], bool] | None = None
    ) -> tuple[Slot, int]:
        """Pick a slot for ``request`` and load the longest reusable prefix into it.

        ``make_room()`` frees KV cells (the idle caches) when a RAM entry does not fit
        and says whether it freed any: admission counts idle caches as free, but llama.cpp
        only restores a sequence into cells that are empty now.

        Returns the slot and how many of ``request.context``'s tokens it already holds.
        """
        prompt = request.context
        slot, n_reuse = choose_slot(idle, prompt, self.cache_prompt, request.scope, request.session)
        if self.ram is not None:
            entry, n_ram = self.ram.best(request.scope, prompt)
            n_ram = min(n_ram, len(prompt) - 1)
            if entry is not None and n_ram > n_reuse and n_ram >= MIN_SAVED_TOKENS:
                self.save(slot)
                self.backend.seq_clear(slot.seq_id)
                slot.cached = []  # true from here: make_room() must not save it again
                restored = self.backend.seq_restore(slot.seq_id, entry.state)
                if not restored and make_room is not None and make_room():
                    restored = self.backend.seq_restore(slot.seq_id, entry.state)
                if restored:
                    slot.cached = list(entry.tokens)
                    entry.t_last_used = time.monotonic()
                    n_reuse = n_ram
                    self._ram_event("restore", entry)
                else:
                    self.backend.seq_clear(slot.seq_id)  # whatever a failed load left
                    n_reuse = 0
        if n_reuse < len(slot.cached):
            self.save(slot)
            if n_reuse == 0 or not self.backend.seq_trim(slot.seq_id, n_reuse):
                self.backend.seq_clear(slot.seq_id)
                n_reuse = 0
            del slot.cached[n_reuse:]
        slot.scope, slot.session, slot.shifted = request.scope, request.session, False
        return slot, n_reuse

    def save(self, slot: Slot) -> None:
        """Save an idle slot's KV to RAM before it is overwritten, when worth it."""
        if (
            self.ram is None
            or slot.shifted
            or len(slot.cached) < MIN_SAVED_TOKENS
            or self.ram.covers(slot.scope, slot.cached)
        ):
            return
        entry = RamEntry(slot.scope, list(slot.cached), self.backend.seq_save(slot.seq_id))
        for evicted in self.ram.add(entry):
            self._ram_event("evict", evicted)
        if entry in self.ram.entries:
            self._ram_event("save", entry)

    def forget(self, slot: Slot) -> None:
        """Drop a slot's KV, saving it first if it is worth keeping."""
        self.save(slot)
        self.drop(slot)

    def drop(self, slot: Slot) -> None:
        """Drop a slot's KV without saving it (half written, or shifted)."""
        self.backend.seq_clear(slot.seq_id)
        slot.cached.clear()

    def purge_idle(self, slots: Sequence[Slot]) -> int:
        """Free every idle slot's cached KV (KV pressure); returns how many were purged."""
        purged = 0
        for slot in slots:
            if slot.request is None and slot.cached:
                self.forget(slot)
                purged += 1
        return purged

    def _ram_event(self, event: str, entry: RamEntry) -> None:
        assert self.ram is not None
        self._emit(
            "ram_cache",
            {
                "tokens": len(entry.tokens),
                "bytes": len(entry.state),
                "entries": len(self.ram.entries),
                "bytes_used": self.ram.bytes_used,
            },
            {"event": event, "scope": entry.scope},
        )
