"""The KV cache as a resource: which slot a prompt takes, whose cells it shares, and the
RAM prompt cache.

Runs in the engine thread. One :class:`~actors.engine._prefix.PrefixIndex` holds every
reusable prefix: each slot's (idle, prefilling or generating: what it has computed so
far) and each RAM entry's. A new prompt takes the longest one of its cache scope: its
own slot's cells as they are, another slot's by ``llama_memory_seq_cp`` (unified KV: a
metadata copy, no compute, no new cells), a RAM entry's by restoring it. A
:class:`~actors.engine._cells.CellLedger` mirrors which cells each sequence holds, so
a cell shared by several slots is counted once and freeing one sharer frees only
what no other holds. A context shift moves cells for every holder, so a slot makes
its shared cells its own first (save, clear, restore).

KV is never reused across cache scopes, in slots or in RAM: a KV blob is another
caller's data; nor is a request's with ``cache_prompt=False``, which reuses nothing.

Every change to a slot's ``cached`` goes through this class, which keeps the slot,
the llama.cpp sequence, the ledger and the index in step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from actors.backend import Backend
from actors.engine._cells import CellLedger
from actors.engine._prefix import CacheScope, PrefixIndex, PrefixMatch
from actors.engine._ram_cache import RamCache, RamEntry
from actors.engine._slots import Request, Slot
from strategies import SlotState

__all__ = ["KVMemory"]

# Shorter sequences are cheaper to recompute than to save and restore.
MIN_SAVED_TOKENS = 32
# Without sharing, a slot's own prefix is worth taking it when it covers this share of the prompt.
_MIN_SHARE = 0.10
# A request waits for a slot prefilling its prefix when that spares computing this many
# tokens again. On a CPU a batch costs about its token count, so computing them twice in
# parallel is never faster than waiting; under this, the tick or two of waiting costs more.
MIN_WAIT_TOKENS = 64


Emit = Callable[[str, dict[str, Any], dict[str, Any]], None]
# make_room(need, last): free idle caches, last's last, until ``need`` cells are free; whether they are.
MakeRoom = Callable[[int, frozenset[int]], bool]


class KVMemory:
    """Slot choice, prefix sharing, RAM save/restore, and the cells each slot holds.

    Args:
        backend: the model's context (its memory API).
        cache_prompt: reuse cached prefixes at all.
        ram_budget_bytes: the RAM prompt cache's budget; 0 turns it off.
        emit: ``emit(signal_name, measurements, metadata)`` for ``ram_cache`` events.
        share: take a prefix from another slot's cells (``seq_cp``); off, a slot reuses
            only its own cells and the RAM cache (the engine before prefix sharing).
    """

    def __init__(
        self, backend: Backend, cache_prompt: bool, ram_budget_bytes: int, emit: Emit, share: bool = True
    ) -> None:
        self.backend = backend
        self.cache_prompt = cache_prompt
        self.share = share
        self.index = PrefixIndex()
        # The prompts slots are prefilling now (what they will hold), for worth_waiting.
        self.plans = PrefixIndex()
        self.cells = CellLedger()
        self.ram = RamCache(ram_budget_bytes, self.index) if cache_prompt and ram_budget_bytes > 0 else None
        self._emit = emit

    # -- the one place a slot's cached tokens change ------------------------------

    def computed(self, slot: Slot, tokens: list[int]) -> None:
        """``llama_decode`` wrote ``tokens`` at the end of the slot's sequence."""
        slot.cached.extend(tokens)
        self.cells.compute(slot.seq_id, len(tokens))
        if slot.seq_id in self.index and not slot.shifted:
            self.index.extend(slot.seq_id, tokens)

    def _trim(self, slot: Slot, keep: int) -> int:
        """Keep the first ``keep`` tokens (the rest saved to RAM when worth it); how many it kept."""
        if keep >= len(slot.cached):
            return len(slot.cached)
        self.save(slot)
        if keep == 0 or not self.backend.kv.trim(slot.seq_id, keep):
            self.drop(slot)
            return 0
        self.cells.trim(slot.seq_id, keep)
        if slot.seq_id in self.index:
            self.index.truncate(slot.seq_id, keep)
        del slot.cached[keep:]
        return keep

    def drop(self, slot: Slot) -> None:
        """Drop a slot's KV without saving it (half written, shifted or private)."""
        self.backend.kv.clear(slot.seq_id)
        self.cells.clear(slot.seq_id)
        self.index.remove(slot.seq_id)
        slot.cached.clear()

    def load(
        self, slot: Slot, scope: CacheScope, tokens: list[int], state: bytes, make_room: MakeRoom
    ) -> str | None:
        """Make ``slot`` hold a saved sequence (a slot file's): its KV ``state``, which
        holds ``tokens``, computed in ``scope``. What the slot held goes to RAM first,
        as when a request takes it.

        Returns None once loaded, else why not (the slot is then left empty): the KV
        has no room for it, llama.cpp refused the state, or the state does not hold
        as many positions as ``tokens``.
        """
        self.forget(slot)
        self.plans.remove(slot.seq_id)
        seq, need = slot.seq_id, len(tokens)
        if self.free_cells < need and not make_room(need, frozenset()):
            return f"the KV cache has no room for its {need} tokens now ({self.free_cells} cells free)"
        if not self.backend.kv.restore(seq, state):
            self.backend.kv.clear(seq)  # whatever a failed load left
            return "llama.cpp refused its KV state (another model or KV layout)"
        if self.backend.kv.pos_max(seq) + 1 != need:
            self.backend.kv.clear(seq)
            return f"its KV state does not hold its {need} tokens"
        slot.cached = list(tokens)
        slot.scope, slot.shifted = scope, False
        self.cells.compute(seq, need)
        if self.cache_prompt:
            self.index.put(seq, scope, slot.cached)
        return None

    def erase(self, slot: Slot) -> int:
        """Drop what ``slot`` holds without saving it (a slot file's erase); how many
        tokens it held."""
        held = len(slot.cached)
        self.drop(slot)
        self.plans.remove(slot.seq_id)
        slot.scope, slot.session, slot.shifted = (None, ()), None, False
        return held

    def shift(self, slot: Slot, n_keep: int, n_discard: int) -> bool:
        """Context shift: drop ``[n_keep, n_keep + n_discard)``, move the rest back.

        Cells past the dropped ones that other slots share are made the slot's own first
        (``seq_add`` would move them for every holder); False, with nothing changed, when
        the KV has no room for that copy.
        """
        seq, n_past = slot.seq_id, len(slot.cached)
        if self.cells.shared(seq, n_keep + n_discard, n_past) and not self._own(slot):
            return False
        self.backend.kv.shift(seq, n_keep, n_discard, n_past)
        self.cells.shift(seq, n_keep, n_discard)
        del slot.cached[n_keep : n_keep + n_discard]
        if seq in self.index:  # later positions no longer match a fresh prefill
            self.index.truncate(seq, n_keep)
        slot.shifted = True
        return True

    def _own(self, slot: Slot) -> bool:
        """Give the slot private copies of all its cells (save, clear, restore)."""
        seq, n = slot.seq_id, len(slot.cached)
        if self.backend.n_ctx - (self.cells.used - self.cells.private(seq)) < n:
            return False
        state = self.backend.kv.save(seq)
        self.backend.kv.clear(seq)
        self.cells.clear(seq)
        if self.backend.kv.restore(seq, state):
            self.cells.compute(seq, n)
            return True
        self.backend.kv.clear(seq)  # whatever a failed load left
        self.index.remove(seq)
        slot.cached.clear()
        return False

    # -- choosing a slot and what it reuses ----------------------------------------

    def claim(
        self, request: Request, idle: list[Slot], make_room: MakeRoom | None = None
    ) -> tuple[Slot, int]:
        """Pick a slot for ``request`` and give it the longest reusable prefix there is.

        ``make_room(need, last)`` frees idle caches (those of the ``last`` sequences last)
        until ``need`` cells are free, when a RAM entry does not fit: admission counts
        idle caches as free, but llama.cpp restores a sequence only into cells that are
        empty now. When there is no room, a donor's prefix is copied instead.

        Returns the slot and how many of ``request.context``'s tokens it already holds.
        """
        prompt, scope = request.context, request.scope
        reuse = self.cache_prompt and request.message.cache_prompt
        found = self.index.matches(scope, prompt) if reuse else []
        slot = self._target(idle, found, request, reuse)
        # At most len(prompt) - 1: the last prompt token is decoded for its logits.
        cap = len(prompt) - 1
        lengths = {m.key: min(m.length, cap) for m in found}
        own = lengths.get(slot.seq_id, 0)
        donor = next((m.key for m in found if isinstance(m.key, int) and m.key != slot.seq_id), None)
        n_donor = lengths[donor] if donor is not None and self.share else 0
        # The longest RAM entry is in ``found`` too: no second lookup.
        entry, n_ram = self.ram.longest(found) if self.ram is not None else (None, 0)
        n_ram = min(n_ram, cap)
        restored = 0
        if entry is not None and n_ram > max(own, n_donor) and n_ram >= MIN_SAVED_TOKENS:
            spare = frozenset((donor,) if donor is not None and n_donor >= MIN_SAVED_TOKENS else ())
            restored = own = self._restore(slot, entry, n_ram, make_room, spare)
            if donor is not None:  # making room may have purged it
                n_donor = min(n_donor, self.cells.length(donor))
        if restored:
            if donor is not None and MIN_SAVED_TOKENS <= n_donor <= restored:
                # A RAM entry is a private copy of all it holds; the prefix a donor holds
                # is the same tokens, so the slot takes the donor's cells for it instead.
                self._adopt(donor, slot, n_donor)
            n_reuse = restored
        elif donor is not None and n_donor > own:
            own = self._trim(slot, own)
            self.backend.kv.copy(donor, slot.seq_id, own, n_donor)
            self.cells.copy(donor, slot.seq_id, n_donor)
            slot.cached[own:] = prompt[own:n_donor]
            n_reuse = n_donor
        else:
            n_reuse = self._trim(slot, own)
        slot.scope, slot.session, slot.shifted = scope, request.session, False
        if reuse:
            self.index.put(slot.seq_id, scope, slot.cached)
            self.plans.put(slot.seq_id, scope, prompt)
        else:
            self.index.remove(slot.seq_id)
            self.plans.remove(slot.seq_id)
        return slot, n_reuse

    def fork(self, source: Slot, request: Request, idle: list[Slot]) -> Slot:
        """An idle slot for ``request`` holding all of its prompt, copied from ``source``
        (which holds it: choice 0 of ``n``). The slot's own cache is dropped (saved first)."""
        prompt = request.context
        slot = self._target(idle, [], request, reuse=False)
        self._trim(slot, 0)
        self.backend.kv.copy(source.seq_id, slot.seq_id, 0, len(prompt))
        self.cells.copy(source.seq_id, slot.seq_id, len(prompt))
        slot.cached[:] = prompt
        slot.scope, slot.session, slot.shifted = request.scope, request.session, False
        if self.cache_prompt and request.message.cache_prompt:
            self.index.put(slot.seq_id, request.scope, slot.cached)
        self.plans.remove(slot.seq_id)
        return slot

    def _target(self, idle: list[Slot], found: list[PrefixMatch], request: Request, reuse: bool) -> Slot:
        """The idle slot the request takes.

        The slot of its ``(scope, session)``; else the idle slot whose whole cache the
        prompt starts with (a conversation's next turn), longest first; without sharing,
        the idle slot sharing the longest prefix (over 10% of the prompt); else an empty
        slot; else the least recently used. With sharing, a slot whose cache goes on
        past the prompt is left as it is: its prefix is copied instead.
        """
        if reuse:
            by_seq = {slot.seq_id: slot for slot in idle if slot.scope == request.scope and slot.cached}
            if request.session is not None:
                for slot in by_seq.values():
                    if slot.session == request.session:
                        return slot
            for m in found:
                mine = by_seq.get(m.key) if isinstance(m.key, int) else None
                if mine is None:
                    continue
                whole = m.length == len(mine.cached)
                if whole if self.share else m.length > _MIN_SHARE * len(request.context):
                    return mine
        empty = [slot for slot in idle if not slot.cached]
        if empty:
            return empty[0]
        slot = min(idle, key=lambda s: s.t_last_used)
        self.save(slot)
        return slot

    def _restore(
        self, slot: Slot, entry: RamEntry, n: int, make_room: MakeRoom | None, spare: frozenset[int]
    ) -> int:
        """Load ``entry`` into ``slot`` and keep its first ``n`` tokens; how many it kept:
        0 (the slot left empty) when the cells for the whole entry are not free. Making
        room purges the ``spare`` caches (the donor's) only if the others are not enough."""
        self.save(slot)
        self.drop(slot)  # true from here, and empty: make_room() never purges it
        need = len(entry.tokens)
        if self.free_cells < need and (make_room is None or not make_room(need, spare)):
            return 0
        slot.scope = entry.scope  # what it holds from here on, before anything saves it
        if not self.backend.kv.restore(slot.seq_id, entry.state):
            self.backend.kv.clear(slot.seq_id)  # whatever a failed load left
            return 0
        slot.cached = list(entry.tokens)
        self.cells.compute(slot.seq_id, len(entry.tokens))
        self.index.put(slot.seq_id, entry.scope, slot.cached)
        entry.t_last_used = time.monotonic()
        self._ram_event("restore", entry)
        return self._trim(slot, n)

    def _adopt(self, donor: int, slot: Slot, n: int) -> None:
        """The slot's first ``n`` cells become the donor's (it holds the same tokens there)."""
        if self.backend.kv.remove(slot.seq_id, 0, n):
            self.backend.kv.copy(donor, slot.seq_id, 0, n)
            self.cells.adopt(donor, slot.seq_id, n)

    @property
    def free_cells(self) -> int:
        """KV cells no sequence holds."""
        return self.backend.n_ctx - self.cells.used

    def worth_waiting(self, request: Request, slots: Sequence[Slot]) -> bool:
        """Whether ``request`` should wait for a slot that is prefilling its prefix now.

        True when that slot will hold at least ``MIN_WAIT_TOKENS`` more of the prompt
        than any cache holds now: copying them once computed costs nothing.
        """
        if not (self.plans and self.share and self.cache_prompt and request.message.cache_prompt):
            return False
        prompt, cap = request.context, len(request.context) - 1
        while True:
            plan = self.plans.best(request.scope, prompt)
            if plan is None:
                return False
            assert isinstance(plan.key, int)  # plans are keyed by seq_id only
            donor = slots[plan.key]
            if donor.state is SlotState.PREFILLING and donor.seq_id in self.index:
                break
            self.plans.remove(plan.key)  # its prefill is over: a cache now, or gone
        held = self.index.best(request.scope, prompt)
        return min(plan.length, cap) - max(held.length if held else 0, 0) >= MIN_WAIT_TOKENS

    def reusable(self, request: Request, slots: Sequence[Slot]) -> int:
        """How many of ``request``'s tokens busy ``slots`` hold already (shared, not new cells)."""
        if not (self.share and self.cache_prompt and request.message.cache_prompt):
            return 0
        busy = {slot.seq_id for slot in slots if slot.request is not None}
        found = self.index.matches(request.scope, request.context)
        return next((min(m.length, len(request.context) - 1) for m in found if m.key in busy), 0)

    def idle_cells(self, slots: Sequence[Slot]) -> int:
        """Cells that dropping every idle slot's cache would free."""
        return sum(self.cells.private(slot.seq_id) for slot in slots if slot.request is None)

    # -- saving to RAM and dropping ------------------------------------------------

    def save(self, slot: Slot) -> None:
        """Save a slot's KV to RAM before it is overwritten, when worth it."""
        if (
            self.ram is None
            or slot.shifted
            or slot.seq_id not in self.index  # a private request's
            or len(slot.cached) < MIN_SAVED_TOKENS
            or self.ram.covers(slot.scope, slot.cached)
        ):
            return
        entry = RamEntry(
            slot.scope, list(slot.cached), self.backend.kv.save(slot.seq_id), session=slot.session
        )
        for evicted in self.ram.add(entry):
            self._ram_event("evict", evicted)
        if entry.key in self.ram.entries:
            self._ram_event("save", entry)

    def forget(self, slot: Slot) -> None:
        """Drop a slot's KV, saving it first if it is worth keeping."""
        self.save(slot)
        self.drop(slot)

    def offload_idle(self, slots: Sequence[Slot]) -> None:
        """Move idle slots' caches out of the context and into the RAM cache (llama-server's
        ``--cache-idle-slots``). Nothing without a RAM cache.

        Every ``llama_decode`` attends over the KV cells up to the highest one in use,
        whoever holds them: an idle slot's cache costs every running request time at
        every tick (seen: 32 slots' worth made a tick 15% longer than 8 slots' worth).
        Only the cells a slot holds alone are freed; a prefix it shares with a running
        request stays where it is, a donor for the next one.
        """
        if self.ram is None:
            return
        for slot in slots:
            if slot.request is None and slot.cached and self.cells.private(slot.seq_id):
                self.forget(slot)

    def purge_idle(self, slots: Sequence[Slot], need: int | None = None, last: Collection[int] = ()) -> int:
        """Free idle slots' cached KV (KV pressure), least recently used first and the
        ``last`` sequences' last, until ``need`` cells are free (all of them when None);
        returns how many were purged."""
        idle = [slot for slot in slots if slot.request is None and slot.cached]
        purged = 0
        for slot in sorted(idle, key=lambda s: (s.seq_id in last, s.t_last_used)):
            if need is not None and self.free_cells >= need:
                break
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
            # The caller's cache_scope; the adapter set is the rest of the key.
            {"event": event, "scope": entry.scope[0]},
        )
