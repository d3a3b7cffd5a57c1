"""Writing a run of batch rows: the one place that fills the batch's columns for a
sequence (the tick's prompt chunks and draft runs, the draft model's passes, embedding
passes, the timing passes). Pure numpy; runs in the engine thread, which owns the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["BatchColumns", "put_rows"]


class BatchColumns(Protocol):
    """The batch's columns as numpy arrays: a token, its position, its sequence and
    whether it asks for logits, per row."""

    tokens: npt.NDArray[np.int32]
    pos: npt.NDArray[np.int32]
    seq_ids: npt.NDArray[np.int32]
    logits: npt.NDArray[np.int8]


def put_rows(
    batch: BatchColumns,
    row: int,
    seq_id: int,
    tokens: Sequence[int] | npt.NDArray[np.int32],
    pos: int,
    logits: bool,
) -> int:
    """Write ``tokens`` of ``seq_id`` at positions from ``pos`` into ``batch``'s rows from
    ``row``, every row asking for logits or none; returns the row after them."""
    end = row + len(tokens)
    batch.tokens[row:end] = tokens
    batch.pos[row:end] = np.arange(pos, pos + len(tokens), dtype=np.int32)
    batch.seq_ids[row:end] = seq_id
    batch.logits[row:end] = 1 if logits else 0
    return end
