"""Slot files in the engine: :class:`SaveSlot`, :class:`RestoreSlot` and :class:`EraseSlot`
carried out between ticks (see :mod:`actors.contract._slot_files` for what they mean).

Runs in the engine's thread, like everything that touches the KV cache: a save or
restore reads or writes the file there, at disk speed (a few MB for a small model's
slot, 0.1 to 0.5 MB a token for a 7B model in f16), and the other slots wait for it as
they wait for any tick. Files are read with every count bounded first
(:mod:`actors.engine._kv_format`): by the slot's context for tokens and by the KV
cache's size for the state.

A restored file is checked against this engine before llama.cpp sees it: the model's
content digest, the KV cache types, each LoRA adapter of the set that computed it, every
token inside the vocabulary, the count inside a slot's context. Then
:meth:`KVMemory.load` makes the slot hold it, and its prefix is reused as any cached one.
"""

from __future__ import annotations

import time

from actors.backend import KvIdentity
from actors.contract import EngineError, EraseSlot, InvalidRequest, RestoreSlot, SaveSlot, SlotFile
from actors.engine._kv_format import KvFile, KvFileError, read_kv_file, write_kv_file
from actors.engine._prefix import CacheScope
from actors.engine._slots import Slot
from actors.engine._state import EngineState

__all__ = ["SlotFiles"]

_TYPE_NAMES = {
    0: "f32",
    1: "f16",
    30: "bf16",
    8: "q8_0",
    2: "q4_0",
    3: "q4_1",
    20: "iq4_nl",
    6: "q5_0",
    7: "q5_1",
}


def _types(kv_types: tuple[int, int]) -> str:
    k, v = (_TYPE_NAMES.get(t, f"type {t}") for t in kv_types)
    return f"K {k}, V {v}"


def _mismatch(kv: KvFile, identity: KvIdentity) -> str | None:
    """Why ``kv`` is not valid in a context of ``identity``, or None when it is."""
    if kv.model != identity.model:
        return "it was saved from another model"
    if kv.kv_types != identity.kv_types:
        return f"its KV cache is {_types(kv.kv_types)}, this context's {_types(identity.kv_types)}"
    for (adapter, _), digest in zip(kv.scope[1], kv.adapter_digests, strict=True):
        if adapter >= len(identity.adapters):
            return f"LoRA adapter {adapter} computed it, and this server loads no adapter {adapter}"
        if identity.adapters[adapter] != digest:
            return f"LoRA adapter {adapter} computed it, and this server's adapter {adapter} is another file"
    return None


class SlotFiles:
    """Save, restore and erase what slots hold (engine thread).

    Args:
        state: the engine's shared state.
    """

    def __init__(self, state: EngineState) -> None:
        self.state = state

    # -- save ---------------------------------------------------------------------

    def save(self, message: SaveSlot) -> SlotFile:
        """Write the slot's (or the session's) tokens and KV to ``message.path``.

        Raises:
            InvalidRequest: no such slot, it is busy or empty, its KV was shifted, or
                the session has no KV here.
            EngineError: the file cannot be written.
        """
        t0 = time.perf_counter()
        backend = self.state.backend
        if message.slot is not None:
            slot = self._idle(message.slot, "save")
            where: int | None = slot.seq_id
            if not slot.cached:
                raise InvalidRequest(f"slot {slot.seq_id} holds no tokens: there is nothing to save")
            if slot.shifted:
                raise InvalidRequest(
                    f"slot {slot.seq_id}'s KV was context-shifted: it no longer equals a fresh "
                    "prefill of its tokens, and is not saved"
                )
            if backend.kv.pos_max(slot.seq_id) + 1 != len(slot.cached):
                raise InvalidRequest(f"slot {slot.seq_id}'s KV does not hold its tokens alone: not saved")
            tokens, scope, session = list(slot.cached), slot.scope, slot.session
            saved = backend.kv.save(slot.seq_id)
        elif message.session is not None:
            tokens, scope, session, saved, where = self._session_kv(message.cache_scope, message.session)
        else:
            raise InvalidRequest("name the slot: slot=<its index> or session=<the session that filled it>")
        identity = backend.identity()
        digests = tuple(identity.adapters[adapter] for adapter, _ in scope[1])
        kv = KvFile(identity.model, identity.kv_types, scope, digests, session, tokens, saved)
        try:
            n_bytes = write_kv_file(message.path, kv)
        except OSError as e:
            raise EngineError(f"cannot write the slot file {message.path!r}: {e.strerror or e}") from None
        return SlotFile(message.path, where, len(tokens), n_bytes, (time.perf_counter() - t0) * 1000.0)

    def _session_kv(
        self, cache_scope: str | None, session: str
    ) -> tuple[list[int], CacheScope, str | None, bytes, int | None]:
        """The KV the engine keeps for ``session``: its idle slot's, else its newest RAM
        entry's (tokens, scope, session, state, slot)."""
        memory = self.state.memory
        slots = self._of_session(cache_scope, session)
        if slots:
            slot = max(slots, key=lambda s: s.t_last_used)
            if not slot.shifted:
                return (
                    list(slot.cached),
                    slot.scope,
                    session,
                    memory.backend.kv.save(slot.seq_id),
                    slot.seq_id,
                )
        entries = memory.ram.of_session(cache_scope, session) if memory.ram is not None else []
        if entries:
            entry = entries[0]
            return list(entry.tokens), entry.scope, session, entry.state, None
        raise InvalidRequest(f"the engine holds no KV of session {session!r} (cache_scope {cache_scope!r})")

    def _of_session(self, cache_scope: str | None, session: str) -> list[Slot]:
        """The slots holding KV of ``session``; refused if one runs a request."""
        found = [
            slot
            for slot in self.state.slots
            if slot.session == session and slot.scope[0] == cache_scope and slot.cached
        ]
        for slot in found:
            if slot.request is not None:
                raise InvalidRequest(
                    f"session {session!r} runs a request in slot {slot.seq_id}: try again once it ends"
                )
        return found

    # -- restore ------------------------------------------------------------------

    def restore(self, message: RestoreSlot) -> SlotFile:
        """Load ``message.path`` into an idle slot.

        Raises:
            InvalidRequest: no such slot, it is busy (or all are), or the file is not a
                slot file this engine can use (the reason says which check failed).
        """
        t0 = time.perf_counter()
        state, backend = self.state, self.state.backend
        if message.slot is not None:
            slot = self._idle(message.slot, "restore into")
        else:
            idle = state.idle()
            if not idle:
                raise InvalidRequest("every slot is busy: restore once one is idle")
            empty = [s for s in idle if not s.cached]
            slot = empty[0] if empty else min(idle, key=lambda s: s.t_last_used)
        try:
            kv, n_bytes = read_kv_file(
                message.path, max_tokens=state.n_ctx_slot, max_state_bytes=state.config.kv_file_max_bytes
            )
        except KvFileError as e:
            raise InvalidRequest(f"cannot restore {message.path!r}: {e}") from None
        why = _mismatch(kv, backend.identity())
        n_vocab = backend.vocab.n_vocab
        if why is None and not all(0 <= t < n_vocab for t in kv.tokens):
            why = "it holds token ids outside this model's vocabulary"
        why = why or state.memory.load(slot, kv.scope, kv.tokens, kv.state, state.make_room)
        if why is not None:
            raise InvalidRequest(f"cannot restore {message.path!r} into slot {slot.seq_id}: {why}")
        slot.session = message.session if message.session is not None else kv.session
        slot.t_last_used = time.monotonic()
        return SlotFile(
            message.path, slot.seq_id, len(kv.tokens), n_bytes, (time.perf_counter() - t0) * 1000.0
        )

    # -- erase --------------------------------------------------------------------

    def erase(self, message: EraseSlot) -> int:
        """Drop what the slot (or everything the session) holds; the tokens dropped.

        Raises:
            InvalidRequest: no such slot, or it (or the session's) is busy.
        """
        memory = self.state.memory
        if message.slot is not None:
            return memory.erase(self._idle(message.slot, "erase"))
        if message.session is None:
            raise InvalidRequest("name the slot: slot=<its index> or session=<the session that filled it>")
        erased = sum(memory.erase(slot) for slot in self._of_session(message.cache_scope, message.session))
        if memory.ram is not None:
            for entry in memory.ram.of_session(message.cache_scope, message.session):
                memory.ram.discard(entry)
                erased += len(entry.tokens)
        return erased

    def _idle(self, index: int, verb: str) -> Slot:
        slots = self.state.slots
        if not 0 <= index < len(slots):
            raise InvalidRequest(f"there is no slot {index}: this engine has slots 0 to {len(slots) - 1}")
        slot = slots[index]
        if slot.request is not None:
            raise InvalidRequest(
                f"slot {index} is busy (it runs request {slot.request.request_id!r}): {verb} it once "
                "the request ends"
            )
        return slot
