"""The context's two faces the engine drives: its KV sequences and its batch.

:class:`LlamaKv` edits and saves sequences in the KV cache; :class:`LlamaRows` holds
the batch's columns as numpy arrays the engine writes into (a tick allocates nothing
per token) and runs ``llama_decode`` on them. Both run in the engine thread only.
llama.cpp aborts the process on a batch over ``n_batch`` or a logits row that did not
ask for logits: the engine checks every batch before :meth:`LlamaRows.decode`.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp as _lc
import numpy as np
import numpy.typing as npt

from actors.backend._faults import faults
from actors.backend._rows import put_rows

__all__ = ["LlamaKv", "LlamaRows"]


class LlamaKv:
    """A context's KV sequences (engine thread only)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._memory = _lc.llama_get_memory(ctx)
        self.can_shift: bool = bool(_lc.llama_memory_can_shift(self._memory))
        """Whether the memory can move positions (needed for a context shift)."""

    def trim(self, seq_id: int, keep: int) -> bool:
        """Drop the KV of ``seq_id`` from position ``keep`` on; False if refused."""
        return bool(_lc.llama_memory_seq_rm(self._memory, seq_id, keep, -1))

    def remove(self, seq_id: int, p0: int, p1: int) -> bool:
        """Drop the KV of ``seq_id`` at positions ``[p0, p1)``, later ones stay where they
        are; False if refused (memory that cannot drop a middle range)."""
        return bool(_lc.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Tag ``src``'s cells at positions ``[p0, p1)`` with ``dst`` too (unified KV: no
        new cells, no compute). ``dst`` must hold no position in that range."""
        _lc.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def pos_max(self, seq_id: int) -> int:
        """The largest position ``seq_id`` holds in the KV cache, -1 when it holds none."""
        return int(_lc.llama_memory_seq_pos_max(self._memory, seq_id))

    def clear(self, seq_id: int) -> None:
        """Drop all KV of ``seq_id``."""
        _lc.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def shift(self, seq_id: int, n_keep: int, n_discard: int, n_past: int) -> None:
        """Drop positions ``[n_keep, n_keep + n_discard)`` and move the rest back to close the gap."""
        _lc.llama_memory_seq_rm(self._memory, seq_id, n_keep, n_keep + n_discard)
        _lc.llama_memory_seq_add(self._memory, seq_id, n_keep + n_discard, n_past, -n_discard)

    def save(self, seq_id: int) -> bytes:
        """A copy of ``seq_id``'s KV state in host memory."""
        size = _lc.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = _lc.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        return bytes(buf)[:n]

    def restore(self, seq_id: int, state: bytes) -> bool:
        """Load a state made by :meth:`save` into ``seq_id``; False if refused."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return bool(_lc.llama_state_seq_set_data(self._ctx, buf, len(state), seq_id))


class LlamaRows:
    """The batch: its columns (``tokens``, ``pos``, ``seq_ids``, ``logits``, one row per
    token) and the forward pass over them (engine thread only).

    Our own arrays instead of ``llama_batch_init``: one flat seq_id array (a slot's token
    belongs to exactly one sequence) behind a fixed array of pointers, so the engine
    fills the batch with numpy slices and never follows a pointer.
    """

    def __init__(self, ctx: Any, kv: LlamaKv, n_batch: int, n_vocab: int, n_embd: int) -> None:
        self._ctx = ctx
        self._kv = kv
        self.n_batch = n_batch
        self._n_vocab = n_vocab
        self._n_embd = n_embd
        self.n_decode_calls = 0
        self.tokens: npt.NDArray[np.int32] = np.zeros(n_batch, dtype=np.int32)
        self.pos: npt.NDArray[np.int32] = np.zeros(n_batch, dtype=np.int32)
        self.seq_ids: npt.NDArray[np.int32] = np.zeros(n_batch, dtype=np.int32)
        self.logits: npt.NDArray[np.int8] = np.zeros(n_batch, dtype=np.int8)
        self._n_seq_id = np.ones(n_batch, dtype=np.int32)
        int_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq_ids.ctypes.data
        self._seq_ptrs = (int_p * n_batch)(*(ctypes.cast(base + 4 * i, int_p) for i in range(n_batch)))
        self._batch = self._view(0)

    def _view(self, start: int) -> Any:
        batch: Any = _lc.llama_batch()
        int_p = ctypes.POINTER(ctypes.c_int32)
        batch.token = ctypes.cast(self.tokens.ctypes.data + 4 * start, int_p)
        batch.embd = None
        batch.pos = ctypes.cast(self.pos.ctypes.data + 4 * start, int_p)
        batch.n_seq_id = ctypes.cast(self._n_seq_id.ctypes.data + 4 * start, int_p)
        batch.seq_id = ctypes.cast(
            ctypes.addressof(self._seq_ptrs) + ctypes.sizeof(int_p) * start, ctypes.POINTER(int_p)
        )
        batch.logits = ctypes.cast(self.logits.ctypes.data + start, ctypes.POINTER(ctypes.c_int8))
        return batch

    def decode(self, start: int, end: int) -> int:
        """Run ``llama_decode`` on batch rows ``[start, end)``; returns its code.

        The caller guarantees ``0 <= start < end <= n_batch``, seq ids within
        ``[0, n_seq_max)`` and contiguous positions per sequence.
        """
        self.n_decode_calls += 1
        if faults.decode is not None:
            injected = faults.decode(self.n_decode_calls)
            if injected is not None:
                return injected
        batch = self._batch if start == 0 else self._view(start)
        batch.n_tokens = end - start
        return int(_lc.llama_decode(self._ctx, batch))

    def decode_embeddings(self, n_rows: int) -> tuple[int, npt.NDArray[np.float32] | None]:
        """``llama_decode`` of batch rows ``[0, n_rows)`` with embeddings on; its code and,
        when 0, a copy of every row's embedding, shape ``(n_rows, n_embd)``.

        Every row must ask for output (with embeddings on llama.cpp outputs them all
        anyway, and logs a warning per row that did not ask). Outputs come back in batch
        order. Embeddings are off again on return: the next generation pass computes
        logits only where asked.
        """
        _lc.llama_set_embeddings(self._ctx, True)
        try:
            code = self.decode(0, n_rows)
            if code != 0:
                return code, None
            pointer = _lc.llama_get_embeddings(self._ctx)
            if not pointer:
                return -1, None
            return code, np.ctypeslib.as_array(pointer, shape=(n_rows, self._n_embd)).copy()
        finally:
            _lc.llama_set_embeddings(self._ctx, False)

    def time_passes(self, sizes: Sequence[int], seq_id: int, repeats: int = 1) -> dict[int, float]:
        """The least time in ms of ``repeats`` forward passes of each size in ``sizes``,
        every row with logits, on ``seq_id`` at positions from 0; the sequence is
        cleared after each (engine thread, while ``seq_id`` holds nothing).

        A speculating engine prices draft rows with it before its first tick. Sizes over
        ``n_batch`` are skipped; a pass that fails ends the timing with what it has.
        """
        sizes = sorted({n for n in sizes if 1 <= n <= self.n_batch})
        if not sizes:
            return {}
        times: dict[int, float] = {}
        batch = self._batch
        for i, n in enumerate(sizes[:1] + sizes * repeats):  # the first pass warms up
            put_rows(self, 0, seq_id, np.arange(n, dtype=np.int32) % self._n_vocab, 0, logits=True)
            batch.n_tokens = n
            t0 = time.perf_counter()
            code = int(_lc.llama_decode(self._ctx, batch))
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            self._kv.clear(seq_id)
            if code != 0:
                break
            if i:
                times[n] = min(times.get(n, math.inf), elapsed_ms)
        return times

    def row_logits(self, index: int) -> npt.NDArray[np.float32]:
        """A writable numpy view of batch row ``index``'s logits in llama.cpp's buffer."""
        return np.ctypeslib.as_array(_lc.llama_get_logits_ith(self._ctx, index), shape=(self._n_vocab,))
