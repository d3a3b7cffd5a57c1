"""Which llama.cpp KV cells each sequence holds, when sequences share cells.

llama.cpp's unified KV cache is ``n_ctx`` cells shared by all sequences: a cell has one
position and a set of sequence ids, and is free when the set is empty. A slot's sequence
holds positions ``0..len-1``. ``llama_memory_seq_cp`` gives a sequence another's cells for
a prefix without computing them, so ``sum(len(slot.cached))`` would count a shared cell
once per holder; this ledger mirrors the cells instead.

Cells live in *runs*, one made each time a sequence computes positions (a sequence that
appends a token per tick grows its last run). A run keeps, per cell, how many sequences
hold it (``refs``) and the XOR of their ids (``xor``: the holder's id once one is left).
A sequence is a list of pieces, slices of runs in position order. ``used`` and each
sequence's private count are updated by every operation, so a query costs O(1) or
O(pieces of one sequence), never O(all cells); a run no piece refers to is dropped.

=========  =====================================================================
compute    ``llama_decode`` of new positions at the end; a restore from the RAM
           cache or a state load is a compute too (it writes fresh cells)
copy       ``llama_memory_seq_cp(mem, src, dst, len(dst), end)``
adopt      ``seq_rm(dst, 0, end)``, ``seq_cp(src, dst, 0, end)``: ``dst`` swaps its first
           ``end`` cells for ``src``'s (same tokens, e.g. a RAM restore of a shared prefix)
trim       ``llama_memory_seq_rm(mem, seq, keep, -1)``
clear      ``llama_memory_seq_rm(mem, seq, -1, -1)``
shift      ``seq_rm(seq, keep, keep + discard)``, ``seq_add(seq, keep + discard, -1,
           -discard)``: seq_add moves a cell for every holder, so moved cells must be private
=========  =====================================================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["CellLedger"]

_Cells = npt.NDArray[np.int32]


@dataclass(slots=True, eq=False)
class _Run:
    """Cells computed together: ``size`` of them exist, the arrays beyond are room to grow."""

    refs: _Cells = field(default_factory=lambda: np.zeros(0, np.int32))
    xor: _Cells = field(default_factory=lambda: np.zeros(0, np.int32))
    size: int = 0
    holders: Counter[int] = field(default_factory=Counter)  # seq -> its pieces in this run

    def grow(self, seq: int, n: int) -> None:
        """Add ``n`` cells held by ``seq`` alone."""
        if self.size + n > len(self.refs):
            room = max(self.size + n, 2 * len(self.refs), 16)
            refs, xor = np.zeros(room, np.int32), np.zeros(room, np.int32)
            refs[: self.size], xor[: self.size] = self.refs[: self.size], self.xor[: self.size]
            self.refs, self.xor = refs, xor
        self.refs[self.size : self.size + n] = 1
        self.xor[self.size : self.size + n] = seq
        self.size += n


@dataclass(slots=True, eq=False)
class _Piece:
    """Cells ``start..stop-1`` of ``run``, held by one sequence at consecutive positions."""

    run: _Run
    start: int
    stop: int


@dataclass(slots=True, eq=False)
class _Seq:
    pieces: list[_Piece] = field(default_factory=list)
    length: int = 0
    private: int = 0  # cells no other sequence holds


_NOTHING = _Seq()  # what a sequence never seen (or cleared) holds; never mutated


def _cut(pieces: list[_Piece], start: int, end: int) -> list[_Piece]:
    """New pieces covering positions ``start..end-1`` of a layout."""
    out, pos = [], 0
    for p in pieces:
        lo, hi = max(start, pos), min(end, pos + p.stop - p.start)
        if lo < hi:
            out.append(_Piece(p.run, p.start + lo - pos, p.start + hi - pos))
        pos += p.stop - p.start
    return out


class CellLedger:
    """The KV cells held by each sequence, shared cells counted once.

    Runs on the engine thread, like the llama.cpp context it mirrors; not thread-safe.
    Sequence ids are llama.cpp's (non-negative); a sequence never seen holds nothing.
    """

    def __init__(self) -> None:
        self._seqs: dict[int, _Seq] = {}
        self._runs: set[_Run] = set()
        self._used = 0

    @property
    def used(self) -> int:
        """Distinct cells held by any sequence."""
        return self._used

    def length(self, seq: int) -> int:
        """How many positions ``seq`` holds (``0..length-1``)."""
        return self._seqs.get(seq, _NOTHING).length

    def private(self, seq: int) -> int:
        """Cells only ``seq`` holds: what ``clear(seq)`` would free."""
        return self._seqs.get(seq, _NOTHING).private

    def shared(self, seq: int, start: int = 0, end: int | None = None) -> bool:
        """Whether a cell of ``seq`` at positions ``start..end-1`` is held by another sequence too."""
        n = self.length(seq)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions {start}..{end} are outside sequence {seq}'s 0..{n}")
        if start == 0 and end == n:
            return self.private(seq) < n
        return any(
            bool((p.run.refs[p.start : p.stop] > 1).any()) for p in _cut(self._seqs[seq].pieces, start, end)
        )

    def sharers(self, seq: int) -> set[int]:
        """The other sequences holding at least one of ``seq``'s cells."""
        found: set[int] = set()
        for p in self._seqs.get(seq, _NOTHING).pieces:
            for other in p.run.holders.keys() - found - {seq}:
                # Holding cells of the same run is not enough: the slices must overlap.
                if any(
                    q.run is p.run and q.start < p.stop and p.start < q.stop for q in self._seqs[other].pieces
                ):
                    found.add(other)
        return found

    def compute(self, seq: int, n: int) -> None:
        """``seq`` computed (or restored) ``n`` new positions at its end: fresh cells."""
        if seq < 0 or n < 0:
            raise ValueError(f"compute({seq}, {n}): a sequence id and a count are non-negative")
        if n == 0:
            return
        s = self._seqs.setdefault(seq, _Seq())
        # The new cells are held by seq alone whoever holds the run's earlier ones, so
        # the last run can grow whenever seq's last piece ends where the run does.
        if not s.pieces or s.pieces[-1].stop != s.pieces[-1].run.size:
            self._link(seq, _Piece(_Run(), 0, 0))
        last = s.pieces[-1]
        last.run.grow(seq, n)
        last.stop += n
        s.length += n
        s.private += n
        self._used += n

    def copy(self, src: int, dst: int, end: int) -> None:
        """``dst`` takes ``src``'s cells for positions ``length(dst)..end-1`` (no new cells).

        Raises:
            ValueError: ``src == dst``, or ``end`` is before ``dst``'s end or past ``src``'s.
        """
        start, n = self.length(dst), self.length(src)
        if src == dst or dst < 0 or not start <= end <= n:
            raise ValueError(f"copy({src}, {dst}, {end}): dst holds {start} positions, src {n}")
        if end == start:
            return
        d = self._seqs.setdefault(dst, _Seq())
        for p in _cut(self._seqs[src].pieces, start, end):
            refs, xor = p.run.refs[p.start : p.stop], p.run.xor[p.start : p.stop]
            self._add_private(xor[refs == 1], -1)  # their one holder is no longer alone
            refs += 1
            xor ^= dst
            last = d.pieces[-1] if d.pieces else None
            if last is not None and last.run is p.run and last.stop == p.start:
                last.stop = p.stop
            else:
                self._link(dst, p)
        d.length = end

    def adopt(self, src: int, dst: int, end: int) -> None:
        """``dst`` swaps its cells for positions ``0..end-1`` for ``src``'s (its own are freed
        unless another sequence holds them); positions from ``end`` on stay as they are.

        Raises:
            ValueError: ``src == dst``, or ``end`` is past either sequence's end.
        """
        if src == dst or dst < 0 or not 0 <= end <= min(self.length(src), self.length(dst)):
            held = f"dst holds {self.length(dst)} positions, src {self.length(src)}"
            raise ValueError(f"adopt({src}, {dst}, {end}): {held}")
        if end == 0:
            return
        d = self._seqs[dst]
        for p in _cut(d.pieces, 0, end):
            self._release(dst, p.run, p.start, p.stop)
        taken = _cut(self._seqs[src].pieces, 0, end)
        for p in taken:
            refs, xor = p.run.refs[p.start : p.stop], p.run.xor[p.start : p.stop]
            self._add_private(xor[refs == 1], -1)  # their one holder is no longer alone
            refs += 1
            xor ^= dst
        old, d.pieces = d.pieces, []
        for p in taken + _cut(old, end, d.length):
            self._link(dst, p)
        for p in old:
            self._unlink(dst, p.run)

    def trim(self, seq: int, keep: int) -> None:
        """``seq`` drops its positions from ``keep`` on (none if it holds ``keep`` or fewer)."""
        if keep < 0:
            raise ValueError(f"trim({seq}, {keep}): keep is non-negative")
        self._drop(seq, keep, max(keep, self.length(seq)))

    def clear(self, seq: int) -> None:
        """``seq`` drops every position; the cells only it held are freed."""
        self._drop(seq, 0, self.length(seq))

    def shift(self, seq: int, keep: int, discard: int) -> None:
        """Context shift: ``seq`` drops positions ``keep..keep+discard-1``, later ones move down.

        Raises:
            ValueError: the range is not within ``seq``, or a cell that would move is shared
                (``llama_memory_seq_add`` would move it for its other holders too).
        """
        n = self.length(seq)
        if keep < 0 or discard < 0 or keep + discard > n:
            raise ValueError(f"shift({seq}, {keep}, {discard}): sequence {seq} holds {n} positions")
        if self.shared(seq, keep + discard, n):
            raise ValueError(f"shift({seq}, {keep}, {discard}): cells it would move are shared")
        self._drop(seq, keep, keep + discard)

    def check(self) -> None:
        """Recompute every count from the pieces and assert the kept ones match (tests, debug)."""
        refs = {run: np.zeros(run.size, np.int32) for run in self._runs}
        xor = {run: np.zeros(run.size, np.int32) for run in self._runs}
        where = {run: np.full(run.size, -1) for run in self._runs}  # each cell's position
        holders: dict[_Run, Counter[int]] = {run: Counter() for run in self._runs}
        for seq, s in self._seqs.items():
            assert s.pieces and s.length == sum(p.stop - p.start for p in s.pieces), seq
            pos = 0
            for p in s.pieces:
                assert p.run in self._runs and 0 <= p.start < p.stop <= p.run.size, (seq, p)
                cells, positions = slice(p.start, p.stop), np.arange(pos, pos + p.stop - p.start)
                seen = where[p.run][cells]
                assert ((seen == -1) | (seen == positions)).all(), f"seq {seq}: a cell at two positions"
                where[p.run][cells] = positions
                refs[p.run][cells] += 1
                xor[p.run][cells] ^= seq
                holders[p.run][seq] += 1
                pos += p.stop - p.start
        for run in self._runs:
            assert run.holders and run.holders == holders[run], "a run no piece refers to"
            assert (run.refs[: run.size] == refs[run]).all() and (run.xor[: run.size] == xor[run]).all()
            assert not run.refs[run.size :].any() and not run.xor[run.size :].any()
        assert self._used == sum(int(np.count_nonzero(r)) for r in refs.values()), self._used
        for seq, s in self._seqs.items():
            alone = sum(int(np.count_nonzero(refs[p.run][p.start : p.stop] == 1)) for p in s.pieces)
            assert s.private == alone, (seq, s.private, alone)

    def _drop(self, seq: int, start: int, stop: int) -> None:
        """``seq`` stops holding positions ``start..stop-1``; later positions move down."""
        s = self._seqs.get(seq)
        if s is None or start == stop:
            return
        for p in _cut(s.pieces, start, stop):
            self._release(seq, p.run, p.start, p.stop)
        old, s.pieces = s.pieces, []
        for p in _cut(old, 0, start) + _cut(old, stop, s.length):
            self._link(seq, p)
        for p in old:
            self._unlink(seq, p.run)
        s.length -= stop - start
        if not s.length:
            del self._seqs[seq]

    def _release(self, seq: int, run: _Run, start: int, stop: int) -> None:
        """``seq`` stops holding cells ``start..stop-1`` of ``run`` (its pieces are the caller's)."""
        refs, xor = run.refs[start:stop], run.xor[start:stop]
        refs -= 1
        xor ^= seq
        freed = int(np.count_nonzero(refs == 0))
        self._used -= freed
        self._seqs[seq].private -= freed
        self._add_private(xor[refs == 1], 1)  # their one remaining holder is now alone
        if stop == run.size:  # free cells at the run's end can be grown into again
            live = np.flatnonzero(refs)
            run.size = start + int(live[-1]) + 1 if len(live) else start

    def _add_private(self, holders: _Cells, sign: int) -> None:
        ids, counts = np.unique(holders, return_counts=True)
        for seq, count in zip(ids.tolist(), counts.tolist(), strict=True):
            self._seqs[seq].private += sign * count

    def _link(self, seq: int, piece: _Piece) -> None:
        self._seqs[seq].pieces.append(piece)
        piece.run.holders[seq] += 1
        self._runs.add(piece.run)

    def _unlink(self, seq: int, run: _Run) -> None:
        run.holders[seq] -= 1
        if not run.holders[seq]:
            del run.holders[seq]
            if not run.holders:
                self._runs.discard(run)
