"""The draft-model drafter: a second, smaller model with the same vocabulary proposes
each slot's next tokens greedily (llama.cpp's ``draft-simple``).

Runs in the engine's thread only. The draft model has its own context, with one
sequence per slot of the engine, and its own batch. A tick's drafting is batched across
slots: one pass feeds each slot's tokens that the draft context does not hold yet (the
tokens accepted last tick, the pending one, a new prompt), then one pass per draft
token, each with one row per slot still drafting.

The draft context has as many cells as the target's, so it must hold what the target
holds no less tightly. A request that enters a slot starts from the sequence that holds
the longest prefix of its tokens (``seq_copy``: a shared cell counts once); one whose
prefix another slot is catching up with in the same pass waits a tick and copies it. A
sequence whose request left stays only as a prefix to copy and is the first evicted.
The drafter counts the cells itself (``DraftCells``): a pass that would not fit evicts
the sequences it does not use, least recently used first, and then the newest of its
own; should llama.cpp still find no room, it evicts more and tries once more before
every sequence starts over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from actors.backend import Backend, put_rows
from actors.engine._draft_cells import DraftCells, common_prefix, fair_shares, request_tail
from actors.engine._speculative import Draft, Drafter, DraftWant

__all__ = ["ModelDrafter"]

_NONE = Draft([])
_log = logging.getLogger("llama_cpp_actors.engine")
_NO_KV_SPACE = 1  # llama_decode's "no KV slot for the batch": nothing was computed
# A request waits a tick for another's catch-up only to share more than this many tokens.
_SHARE_MIN = 32


class _Sequence:
    """What the draft context holds for one slot: ``held`` (a prefix of the request's
    tokens, at positions 0 on), then the first ``fed`` tokens of ``draft``, the draft
    made when the request had ``at`` tokens (``stopped``: it ended at an unsure token or
    an end of generation). ``owner`` None: its request left, and the sequence is kept
    only as a prefix another may copy. ``t_used``: the drafter's call it last served;
    ``t_start``: the call its request adopted it (the older keeps its cells first).
    ``cells``: the cell of each position it holds (``held``, then the fed drafts)."""

    __slots__ = ("at", "cells", "draft", "fed", "held", "owner", "seq_id", "stopped", "t_start", "t_used")

    def __init__(self, seq_id: int, owner: object, held: list[int], cells: list[int]) -> None:
        self.seq_id = seq_id
        self.owner: object | None = owner
        self.held = held
        self.cells = cells
        self.draft: list[int] = []
        self.fed = 0
        self.at = -1
        self.stopped = False
        self.t_used = self.t_start = 0


_Feed = tuple[_Sequence, list[int], int]  # a sequence, the tokens it lacks, the draft tokens wanted


class ModelDrafter(Drafter):
    """Greedy drafts from a draft model (see the module).

    A second call in the same tick (the request has no new token) extends the draft the
    first made: the engine asks every generating slot for one token before the plan (one
    pass; the first draft token tells whether drafts would be right, for free) and the
    planned slots for the rest after it.

    Args:
        backend: the draft model's own context, ``n_seq_max`` at least the engine's
            slots, its vocabulary checked against the target's
            (``LlamaVocab.differs``).
        n_ctx_slot: the positions a slot may hold; a request past them (it shifted its
            context), or past the positions the draft model was trained on, gets no
            drafts, and its sequence is dropped.
        p_min: a slot's draft stops at a token the draft model is less sure of than this
            (llama-server's ``--spec-draft-p-min``).
        chunk_size: the most tokens a slot's sequence catches up with in one pass (the
            engine's prefill chunk); the pass's ``n_batch`` rows are shared fairly, so a
            long new prompt catches up over several ticks and never takes the rows of
            the other slots' few new tokens.
    """

    costly = True

    def __init__(self, backend: Backend, n_ctx_slot: int, p_min: float = 0.0, chunk_size: int = 512) -> None:
        self.backend = backend
        self.n_ctx_slot = n_ctx_slot
        # Positions past what the draft model was trained on make drafts that are noise.
        self.n_pos = min(n_ctx_slot, backend.n_ctx_train) if backend.n_ctx_train > 0 else n_ctx_slot
        if self.n_pos < n_ctx_slot:
            _log.warning(
                "the draft model was trained on %d positions, a slot holds %d: requests past %d do not draft",
                self.n_pos, n_ctx_slot, self.n_pos,
            )  # fmt: skip
        self.p_min = p_min
        self.chunk_size = chunk_size
        self._seqs: dict[int, _Sequence] = {}
        self._cells = DraftCells()
        self._calls = 0
        self.n_passes = 0  # draft-model forward passes, for tests and benches
        self.n_evicted = 0  # sequences evicted to make room for a pass
        self.n_failures = 0  # passes that failed even so (every sequence started over)

    @property
    def cells_used(self) -> int:
        """The draft context's cells in use, as the drafter counts them."""
        return self._cells.used

    def retain(self, live: Mapping[int, object]) -> None:
        """Mark the sequences whose request left their slot as prefixes only (their
        draft cells freed); ``live`` maps each busy slot to its request."""
        for seq in list(self._seqs.values()):
            if seq.owner is not None and live.get(seq.seq_id) is not seq.owner:
                seq.owner = None
                if seq.fed:
                    self._trim(seq, len(seq.held))
                seq.draft, seq.fed, seq.at, seq.stopped = [], 0, -1, False

    def propose(self, wants: Sequence[DraftWant]) -> list[Draft]:
        """Each want's draft: what the draft model says greedily, at most ``limit`` tokens."""
        self._calls += 1
        # Every sequence is settled (copied, trimmed) before the batch is written: a
        # copy must only read cells that a finished pass wrote.
        seqs = [self._sync(want) for want in wants]
        backend = self.backend
        feeds: list[_Feed] = []
        for want, seq in zip(wants, seqs, strict=True):
            wanted = min(want.limit, self._own_limit(want))
            if seq is None or seq.stopped or len(seq.draft) >= wanted:
                continue
            # What the context lacks before the next token can be read: the request's
            # new tokens, or the draft's last token.
            tokens = (
                request_tail(want.prompt, want.generated, len(seq.held))
                if not seq.draft
                else seq.draft[seq.fed :]
            )
            if not seq.draft and self._follows(seq, tokens, feeds):
                continue
            if tokens:
                feeds.append((seq, tokens, wanted))
        n = 0
        batch: list[_Sequence] = []
        rows: list[tuple[_Sequence, int, int]] = []  # (sequence, batch row, tokens wanted)
        shares = self._grant(feeds, fair_shares(feeds, backend.n_batch, self.chunk_size))
        for (seq, tokens, wanted), take in zip(feeds, shares, strict=True):
            if take == 0:
                continue
            start = len(seq.held) + seq.fed
            put_rows(backend.rows, n, seq.seq_id, tokens[:take], start, logits=False)
            if seq.draft:
                seq.fed += take
            else:
                seq.held.extend(tokens[:take])
            self._cells.grow(seq.cells, take)
            batch.append(seq)
            if take == len(tokens):
                backend.rows.logits[n + take - 1] = 1
                rows.append((seq, n + take - 1, wanted))
            n += take
        while n:
            if not self._decode(n, batch):
                return [_NONE] * len(wants)
            n = 0
            going = []
            for seq, row, wanted in rows:
                token, p = backend.sampling.top_token(row)
                if p < self.p_min:
                    seq.stopped = True
                    continue
                seq.draft.append(token)
                if token in backend.vocab.eog_ids:
                    seq.stopped = True
                elif len(seq.draft) < wanted:
                    going.append((seq, wanted))
            rows, batch = [], []
            # A draft the context has no room to feed stops where it is (shorter, not lost).
            for row, (seq, wanted) in enumerate(going[: self._room(len(going))]):
                put_rows(backend.rows, row, seq.seq_id, seq.draft[-1:], len(seq.held) + seq.fed, logits=True)
                seq.fed += 1
                self._cells.grow(seq.cells, 1)
                batch.append(seq)
                rows.append((seq, row, wanted))
            n = len(rows)
        return [self._draft(s, w) for s, w in zip(seqs, wants, strict=True)]

    def _own_limit(self, want: DraftWant) -> int:
        """The most draft tokens the draft model may make for ``want``: its last fed
        draft token stays below ``n_pos``."""
        return self.n_pos - (len(want.prompt) + len(want.generated)) + 1

    def _draft(self, seq: _Sequence | None, want: DraftWant) -> Draft:
        if seq is None:
            return _NONE
        # Its room: what a later call this tick could make of it (the engine plans no more).
        room = len(seq.draft) if seq.stopped else self._own_limit(want)
        return Draft(seq.draft[: want.limit], room=room)

    def _sync(self, want: DraftWant) -> _Sequence | None:
        """The slot's sequence, trimmed to what its request's tokens still agree with;
        None (and the sequence dropped) when the request cannot draft."""
        seq = self._seqs.get(want.seq_id)
        known = len(want.prompt) + len(want.generated)
        if known + 1 > self.n_ctx_slot or self._own_limit(want) < 1:  # shifted, or past n_pos
            if seq is not None:
                self._drop(seq)
            return None
        if seq is None or seq.owner is not want.owner or len(seq.held) > known:
            seq = self._adopt(want, seq)
        seq.t_used = self._calls
        if seq.at == known:  # the same tick: extend the draft
            return seq
        if seq.draft:  # an earlier tick's draft: keep the fed tokens the request went on with
            new = request_tail(want.prompt, want.generated, len(seq.held))
            agree = 0
            for a, b in zip(seq.draft[: seq.fed], new, strict=False):
                if a != b:
                    break
                agree += 1
            if agree < seq.fed and not self._trim(seq, len(seq.held) + agree):
                agree = 0
            seq.held.extend(new[:agree])
        seq.draft, seq.fed, seq.stopped, seq.at = [], 0, False, known
        if len(seq.held) >= known:  # the last token was fed already: feed it again for its logits
            self._trim(seq, known - 1)
        return seq

    def _adopt(self, want: DraftWant, old: _Sequence | None) -> _Sequence:
        """A sequence for a request new to its slot, holding the longest prefix of its
        tokens that any sequence holds: the slot's own (a session's next turn keeps the
        conversation so far) or another's, copied (the cells are shared, not written)."""
        tokens = list(want.prompt) + list(want.generated)
        best, n_best = old, 0 if old is None else common_prefix(old.held, tokens)
        for other in self._seqs.values():
            if other is not old:
                n = common_prefix(other.held, tokens)
                if n > n_best:
                    best, n_best = other, n
        if best is old and old is not None:
            if not self._trim(old, n_best):
                n_best = 0
            seq = _Sequence(want.seq_id, want.owner, tokens[:n_best], old.cells)
        else:
            if old is not None:
                self._clear(old)
            else:
                self.backend.kv.clear(want.seq_id)
            cells: list[int] = []
            if best is not None and n_best:
                cells = self._cells.share(best.cells[:n_best])
                self.backend.kv.copy(best.seq_id, want.seq_id, 0, n_best)
            seq = _Sequence(want.seq_id, want.owner, tokens[: len(cells)], cells)
        seq.t_start = self._calls
        self._seqs[want.seq_id] = seq
        return seq

    def _trim(self, seq: _Sequence, keep: int) -> bool:
        """Keep ``seq``'s first ``keep`` positions (its fed draft tokens go too); when
        llama.cpp refuses, the sequence is cleared and starts over (False)."""
        if self.backend.kv.trim(seq.seq_id, keep):
            del seq.held[keep:]
            seq.fed = min(seq.fed, max(0, keep - len(seq.held)))
            self._cells.cut(seq.cells, keep)
            return True
        _log.warning("the draft context refused to trim sequence %d: it starts over", seq.seq_id)
        self._clear(seq)
        return False

    def _clear(self, seq: _Sequence) -> None:
        self.backend.kv.clear(seq.seq_id)
        self._cells.cut(seq.cells, 0)
        seq.held, seq.draft, seq.fed = [], [], 0

    def _follows(self, seq: _Sequence, tokens: list[int], feeds: list[_Feed]) -> bool:
        """Whether ``seq`` should wait a tick rather than feed ``tokens``: a catch-up of
        this pass writes a longer prefix of them than ``seq`` holds (requests that start
        together, the choices of one prompt), which ``seq`` copies next tick instead of
        writing it twice. It is then held only as a prefix, so its next call adopts
        again (``_adopt``)."""
        if len(tokens) <= _SHARE_MIN:
            return False
        held = len(seq.held)
        mine = seq.held + tokens
        for other, theirs, _ in feeds:
            long = not other.draft and len(theirs) > _SHARE_MIN
            if long and common_prefix(mine, other.held + theirs) - held > _SHARE_MIN:
                seq.owner = None
                return True
        return False

    def _grant(self, feeds: list[_Feed], shares: list[int]) -> list[int]:
        """``shares`` (the pass's rows, shared fairly) cut to the free cells, beside the
        cells the draft passes after it will take (a draft token fed for each but the
        last). When they do not fit, the oldest sequences keep theirs first (as the
        engine preempts the newest request): a newer one of this pass gives its cells
        back rather than every sequence holding a part of a catch-up none can finish."""

        def drafting(i: int, take: int) -> int:  # cells its draft passes take after the catch-up
            seq, tokens, wanted = feeds[i]
            return max(0, wanted - len(seq.draft) - 1) if take == len(tokens) else 0

        need = sum(take + drafting(i, take) for i, take in enumerate(shares))
        free = self._room(need)
        if free >= need:
            return shares
        order = sorted(range(len(feeds)), key=lambda i: (feeds[i][0].t_start, i))
        granted = [0] * len(feeds)
        while order:
            i = order.pop(0)
            while free < shares[i] + drafting(i, shares[i]) and order:
                victim = feeds[order.pop()][0]  # the newest left: it gets nothing this tick
                free += self._cells.private(victim.cells)
                self._drop(victim)
                self.n_evicted += 1
            granted[i] = max(0, min(shares[i], free))
            free -= granted[i] + drafting(i, granted[i])
        return granted

    def _room(self, need: int) -> int:
        """Free cells for a pass of ``need`` tokens (at most ``need``), evicting sequences
        this call has not used if it must (see ``_evict``)."""
        free = self.backend.n_ctx - self._cells.used
        if free < need:
            used_now = {s.seq_id for s in self._seqs.values() if s.t_used == self._calls}
            self._evict(need - free, used_now)
            free = self.backend.n_ctx - self._cells.used
        return max(0, min(free, need))

    def _decode(self, n: int, batch: list[_Sequence]) -> bool:
        """Run the draft model on the first ``n`` batch rows (their cells counted, and
        made room for, already). Should llama.cpp find no room even so, evict ``n``
        cells' worth of sequences outside the pass and try once more; on any other
        failure, or a second, forget every sequence and draft nothing this tick."""
        self.n_passes += 1
        code = self.backend.rows.decode(0, n)
        if code == _NO_KV_SPACE and self._evict(n, {seq.seq_id for seq in batch}):
            self.n_passes += 1
            code = self.backend.rows.decode(0, n)
        if code == 0:
            return True
        self.n_failures += 1
        _log.warning("draft model decode returned %d: its %d sequences start over", code, len(self._seqs))
        for seq in list(self._seqs.values()):
            self._drop(seq)
        return False

    def _evict(self, need: int, keep: set[int]) -> int:
        """Drop sequences not in ``keep``, those whose request left first, then the least
        recently used, until ``need`` cells are freed; how many were dropped. Cells
        another sequence holds too free nothing."""
        freed = dropped = 0
        victims = sorted(
            (s for s in self._seqs.values() if s.seq_id not in keep),
            key=lambda s: (s.owner is not None, s.t_used),
        )
        for seq in victims:
            if freed >= need:
                break
            freed += self._cells.private(seq.cells)
            self._drop(seq)
            dropped += 1
        self.n_evicted += dropped
        return dropped

    def _drop(self, seq: _Sequence) -> None:
        self._clear(seq)
        del self._seqs[seq.seq_id]

    def close(self) -> None:
        """Free the draft model (engine thread, once)."""
        self._seqs.clear()
        self.backend.close()
