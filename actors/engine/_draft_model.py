"""The draft-model drafter: a second, smaller model with the same vocabulary proposes
each slot's next tokens greedily (llama.cpp's ``draft-simple``).

Runs in the engine's thread only. The draft model has its own context, with one
sequence per slot of the engine, and its own batch. A tick's drafting is batched across
slots: one pass feeds each slot's tokens that the draft context does not hold yet (the
tokens accepted last tick, the pending one, a new prompt), then one pass per draft
token, each with one row per slot still drafting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from actors.backend._llama import LlamaBackend
from actors.engine._speculative import Draft, Drafter, DraftWant

__all__ = ["ModelDrafter"]

_NONE = Draft([])
_log = logging.getLogger("llama_cpp_actors.engine")


class _Sequence:
    """What the draft context holds for one slot: the request's first ``synced`` tokens,
    then the first ``fed`` tokens of ``draft``, the draft made when the request had
    ``at`` tokens (``stopped``: it ended at an unsure token or an end of generation)."""

    __slots__ = ("at", "draft", "fed", "owner", "seq_id", "stopped", "synced")

    def __init__(self, seq_id: int, owner: object) -> None:
        self.seq_id = seq_id
        self.owner = owner
        self.synced = 0
        self.draft: list[int] = []
        self.fed = 0
        self.at = -1
        self.stopped = False


class ModelDrafter(Drafter):
    """Greedy drafts from a draft model (see the module).

    A second call in the same tick (the request has no new token) extends the draft the
    first made: the engine asks every generating slot for one token before the plan (one
    pass; the first draft token tells whether drafts would be right, for free) and the
    planned slots for the rest after it.

    Args:
        backend: the draft model's own context, ``n_seq_max`` at least the engine's
            slots, its vocabulary checked against the target's
            (``LlamaBackend.vocabulary_differs``).
        n_ctx_slot: the positions a slot may hold; a request past them (it shifted its
            context) gets no drafts, and its sequence is dropped.
        p_min: a slot's draft stops at a token the draft model is less sure of than this
            (llama-server's ``--spec-draft-p-min``).
    """

    costly = True

    def __init__(self, backend: LlamaBackend, n_ctx_slot: int, p_min: float = 0.0) -> None:
        self.backend = backend
        self.n_ctx_slot = n_ctx_slot
        self.p_min = p_min
        self._seqs: dict[int, _Sequence] = {}
        self.n_passes = 0  # draft-model forward passes, for tests and benches
        self.n_failures = 0  # passes that failed (no room: every sequence started over)

    def propose(self, wants: Sequence[DraftWant]) -> list[Draft]:
        """Each want's draft: what the draft model says greedily, at most ``limit`` tokens."""
        backend = self.backend
        room = backend.n_batch
        n = 0
        rows: list[tuple[_Sequence, int, int]] = []  # (sequence, batch row, tokens wanted)
        seqs: list[_Sequence | None] = []
        for want in wants:
            seq = self._sync(want)
            seqs.append(seq)
            if seq is None or seq.stopped or len(seq.draft) >= want.limit:
                continue
            # What the context lacks before the next token can be read: the request's
            # new tokens, or the draft's last token.
            tokens = _tail(want, seq.synced) if not seq.draft else seq.draft[seq.fed :]
            start = seq.synced + seq.fed
            take = min(len(tokens), room)
            if take == 0:
                continue
            room -= take
            backend.tokens[n : n + take] = tokens[:take]
            backend.pos[n : n + take] = range(start, start + take)
            backend.seq_ids[n : n + take] = want.seq_id
            backend.logits[n : n + take] = 0
            if seq.draft:
                seq.fed += take
            else:
                seq.synced += take
            if take == len(tokens):
                backend.logits[n + take - 1] = 1
                rows.append((seq, n + take - 1, want.limit))
            n += take
        while n:
            if not self._decode(n):
                return [_NONE] * len(wants)
            n = 0
            going = []
            for seq, row, wanted in rows:
                token, p = backend.top_token(row)
                if p < self.p_min:
                    seq.stopped = True
                    continue
                seq.draft.append(token)
                if token in backend.eog_ids:
                    seq.stopped = True
                elif len(seq.draft) < wanted:
                    going.append((seq, wanted))
            rows = []
            for row, (seq, wanted) in enumerate(going):
                backend.tokens[row] = seq.draft[-1]
                backend.pos[row] = seq.synced + seq.fed
                backend.seq_ids[row] = seq.seq_id
                backend.logits[row] = 1
                seq.fed += 1
                rows.append((seq, row, wanted))
            n = len(rows)
        return [_NONE if s is None else Draft(s.draft[: w.limit]) for s, w in zip(seqs, wants, strict=True)]

    def _sync(self, want: DraftWant) -> _Sequence | None:
        """The slot's sequence, trimmed to what its request's tokens still agree with;
        None (and the sequence dropped) when the request cannot draft."""
        seq = self._seqs.get(want.seq_id)
        known = len(want.prompt) + len(want.generated)
        if known + 1 > self.n_ctx_slot:  # past the slot's positions: it shifted
            if seq is not None:
                self._drop(want.seq_id)
            return None
        if seq is None or seq.owner is not want.owner or seq.synced > known:
            if seq is not None:
                self.backend.seq_clear(want.seq_id)
            seq = self._seqs[want.seq_id] = _Sequence(want.seq_id, want.owner)
        if seq.at == known:  # the same tick: extend the draft
            return seq
        if seq.draft:  # an earlier tick's draft: keep the fed tokens the request went on with
            new = _tail(want, seq.synced)
            agree = 0
            for a, b in zip(seq.draft[: seq.fed], new, strict=False):
                if a != b:
                    break
                agree += 1
            if agree < seq.fed:
                self.backend.seq_trim(want.seq_id, seq.synced + agree)
            seq.synced += agree
        seq.draft, seq.fed, seq.stopped, seq.at = [], 0, False, known
        if seq.synced >= known:  # the last token was fed already: feed it again for its logits
            self.backend.seq_trim(want.seq_id, known - 1)
            seq.synced = known - 1
        return seq

    def _decode(self, n: int) -> bool:
        """Run the draft model on the first ``n`` batch rows; on any failure (no KV room:
        the draft context holds stale sequences) forget every sequence and draft nothing
        this tick."""
        self.n_passes += 1
        code = self.backend.decode(0, n)
        if code == 0:
            return True
        self.n_failures += 1
        _log.warning("draft model decode returned %d: its %d sequences start over", code, len(self._seqs))
        for seq_id in list(self._seqs):
            self._drop(seq_id)
        return False

    def _drop(self, seq_id: int) -> None:
        self.backend.seq_clear(seq_id)
        del self._seqs[seq_id]

    def close(self) -> None:
        """Free the draft model (engine thread, once)."""
        self._seqs.clear()
        self.backend.close()


def _tail(want: DraftWant, start: int) -> list[int]:
    """The request's tokens (its prompt, then what it generated) from ``start`` on."""
    n_prompt = len(want.prompt)
    if start >= n_prompt:
        return list(want.generated[start - n_prompt :])
    return list(want.prompt[start:]) + list(want.generated)
