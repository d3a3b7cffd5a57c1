"""The draft-model drafter's bookkeeping that needs no model: its count of the draft
context's KV cells, how a pass's rows are shared, and token-list helpers.

Runs in the engine's thread only (the drafter's state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DraftCells", "common_prefix", "fair_shares", "request_tail"]


class DraftCells:
    """The draft context's KV cells as llama.cpp's unified cache keeps them: a cell is
    used while some sequence holds it, and ``seq_copy`` makes two sequences hold the
    same cells (so one counts once). Each sequence lists its cells by position."""

    __slots__ = ("_next", "_refs")

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # cell -> sequences holding it
        self._next = 0

    @property
    def used(self) -> int:
        return len(self._refs)

    def grow(self, cells: list[int], n: int) -> None:
        """``n`` new cells at the end of ``cells`` (a pass wrote them)."""
        start = self._next
        self._next += n
        cells.extend(range(start, start + n))
        self._refs.update(dict.fromkeys(range(start, start + n), 1))

    def share(self, cells: list[int]) -> list[int]:
        """A second holder of ``cells`` (a copy)."""
        refs = self._refs
        for cell in cells:
            refs[cell] += 1
        return list(cells)

    def cut(self, cells: list[int], keep: int) -> None:
        """Let go of ``cells`` from ``keep`` on."""
        refs = self._refs
        for cell in cells[keep:]:
            left = refs[cell] - 1
            if left:
                refs[cell] = left
            else:
                del refs[cell]
        del cells[keep:]

    def private(self, cells: list[int]) -> int:
        """How many of ``cells`` no other sequence holds: what dropping them frees."""
        refs = self._refs
        return sum(1 for cell in cells if refs[cell] == 1)


def fair_shares(feeds: Sequence[tuple[object, list[int], int]], n_rows: int, cap: int) -> list[int]:
    """How many of its tokens each feed gets into a pass of ``n_rows`` rows: at most
    ``cap``, and the rows shared max-min fairly (the smallest needs served whole first,
    so a long prompt takes only what the others leave)."""
    takes = [0] * len(feeds)
    order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][1]))
    left = n_rows
    for rank, i in enumerate(order):
        take = min(len(feeds[i][1]), cap, left // (len(order) - rank))
        takes[i] = take
        left -= take
    return takes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def request_tail(prompt: Sequence[int], generated: Sequence[int], start: int) -> list[int]:
    """A request's tokens (its prompt, then what it generated) from ``start`` on."""
    n_prompt = len(prompt)
    if start >= n_prompt:
        return list(generated[start - n_prompt :])
    return list(prompt[start:]) + list(generated)
