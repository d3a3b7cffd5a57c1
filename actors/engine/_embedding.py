"""Embeddings: ``Embed`` requests, queued, and the pass of the tick that serves them.

A pass of its own, not rows beside generation: with embeddings on, llama.cpp outputs
every row of a batch (logits too), so generation's prefill rows would all compute
logits; and llama-server too runs embedding batches apart. A tick with embedding work
runs one pass before generation's batch: texts of several requests packed into one
batch of at most ``MAX_PASS_ROWS`` rows (and ``n_batch``), each text in its own
sequence (an embedding lane, :attr:`Backend.embed_seq_ids`), every row an output;
a longer text goes alone, one chunk a tick, in the same sequence (the model is causal:
each chunk attends to the cells of the ones before). While slots generate, a pass holds
the rows the strategy allows (``BatchStrategy.embed_rows``: by default what costs about
one generation pass, from the engine's measured times), so embeddings cost a running
stream at most about half its speed. The vectors are pooled
here, in numpy, from the per-token embeddings (the context's pooling is ``NONE``), so
every pooling works on one context. A packed pass frees every cell it wrote before it
returns; a long text's cells are on the engine's books (``CellLedger``) while it is fed,
so generation's admission counts them, and freed when it is done, fails or is
cancelled.

:func:`prepare_embed` runs in the caller's thread (tokenizing); the rest in the
engine's thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from actors.backend import Backend, put_rows
from actors.contract import (
    POOLINGS,
    DecodeError,
    Embed,
    Embeddings,
    EngineError,
    InvalidRequest,
    Pooling,
    PromptTooLong,
    QueueFull,
    RequestTimeout,
)
from actors.engine._cells import CellLedger
from actors.engine._delivery import settle

__all__ = ["MAX_PASS_ROWS", "EmbedJob", "Embedder", "PreparedEmbed", "prepare_embed"]

MAX_PASS_ROWS = 256
"""Rows of one embedding decode at most (and of ``n_batch``). With embeddings on every
row is an output, and llama.cpp keeps an output buffer of logits and embeddings sized
for the most rows a decode had: 256 rows of a 49,152-token vocabulary are 50 MB, where
2,048 (the default ``n_batch``) would be 400 MB."""


@dataclass(frozen=True, slots=True)
class PreparedEmbed:
    """An ``Embed`` with its texts tokenized and its pooling resolved."""

    message: Embed
    texts: tuple[tuple[int, ...], ...]
    pooling: Pooling


def prepare_embed(backend: Backend, message: Embed, limit: int) -> PreparedEmbed:
    """Tokenize the texts as prompts are tokenized, check them, resolve the pooling
    (thread-safe: any thread).

    Raises:
        InvalidRequest: a text tokenizes to nothing, or names a token outside the
            vocabulary, or there are no embedding lanes.
        PromptTooLong: a text is longer than ``limit`` tokens (a slot's context).
    """
    if not backend.embed_seq_ids:
        raise InvalidRequest(
            "this engine has no sequence to spare for embeddings: n_batch must exceed n_parallel"
        )
    texts = []
    for i, text in enumerate(message.texts):
        tokens = tuple(backend.vocab.tokenize(text)) if isinstance(text, str) else tuple(text)
        if not tokens:
            raise InvalidRequest(f"texts[{i}] tokenizes to nothing")
        if max(tokens) >= backend.vocab.n_vocab:
            bad = next(t for t in tokens if t >= backend.vocab.n_vocab)
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (n_vocab={backend.vocab.n_vocab})"
            )
        if len(tokens) > limit:
            raise PromptTooLong(
                f"input is too large to process: texts[{i}] is {len(tokens)} tokens, over a slot's "
                f"context of {limit} tokens (n_ctx_per_slot)",
                len(tokens),
                limit,
                truncatable=False,
            )
        texts.append(tokens)
    pooling: Pooling = message.pooling or _as_pooling(backend.pooling) or "mean"
    return PreparedEmbed(message, tuple(texts), pooling)


def _as_pooling(name: str | None) -> Pooling | None:
    for pooling in POOLINGS:
        if name == pooling:
            return pooling
    return None


@dataclass(slots=True, eq=False)
class EmbedJob:
    """An admitted ``Embed`` and its progress: ``next`` texts are done (engine thread only)."""

    prepared: PreparedEmbed
    future: Any
    vectors: npt.NDArray[np.float32]
    t_admitted: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    next: int = 0

    @property
    def request_id(self) -> str:
        return self.prepared.message.request_id


@dataclass(slots=True)
class _Text:
    """One text in this pass: its job, its index, its lane, its rows' sum so far."""

    job: EmbedJob
    index: int
    lane: int
    tokens: tuple[int, ...]
    first: npt.NDArray[np.float32] | None = None
    last: npt.NDArray[np.float32] | None = None
    total: npt.NDArray[np.float64] | None = None
    fed: int = 0  # tokens decoded so far (a long text's, over several ticks)


class Embedder:
    """The embedding queue of one engine and its pass (engine thread only).

    Args:
        backend: the model's context.
        max_queue: requests that may wait at most (``QueueFull`` past it).
        make_room: ``make_room(n)``: free ``n`` KV cells (dropping idle slots' caches),
            True when they are free.
        cells: the engine's ledger of KV cells, where a long text's cells are booked.
    """

    def __init__(
        self, backend: Backend, max_queue: int, make_room: Callable[[int], bool], cells: CellLedger
    ) -> None:
        self.backend = backend
        self.max_queue = max_queue
        self.make_room = make_room
        self.cells = cells
        self.queue: deque[EmbedJob] = deque()
        self.long: _Text | None = None  # a text fed one chunk a tick
        self.n_passes = 0
        self.n_texts = 0
        self.pass_rows = 0  # the rows of the last run's pass (0 when it ran none)

    @property
    def rows_max(self) -> int:
        """The most rows a pass holds."""
        return min(self.backend.n_batch, MAX_PASS_ROWS)

    def admit(self, prepared: PreparedEmbed, future: Any) -> None:
        """Queue a prepared request.

        Raises:
            InvalidRequest: its id is in use, or a token is outside the vocabulary.
            QueueFull: ``max_queue`` embedding requests wait.
        """
        message = prepared.message
        if any(job.request_id == message.request_id for job in self.queue):
            raise InvalidRequest(f"request_id {message.request_id!r} is already in use")
        n_vocab = self.backend.vocab.n_vocab
        for tokens in prepared.texts:  # prepared in another thread: checked again, cheaply
            if not tokens or max(tokens) >= n_vocab or min(tokens) < 0:
                raise InvalidRequest(
                    f"a text is empty or has a token outside the vocabulary (n_vocab={n_vocab})"
                )
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"{len(self.queue)} embedding requests wait (max_queue={self.max_queue})")
        job = EmbedJob(prepared, future, np.zeros((len(prepared.texts), self.backend.n_embd), np.float32))
        if message.deadline_s is not None:
            job.deadline = job.t_admitted + message.deadline_s
        self.queue.append(job)

    def cancel(self, request_id: str, message: object = None) -> bool:
        """Fail a queued request as cancelled; whether one had the id (and ``message``)."""
        for job in self.queue:
            if job.request_id == request_id and (message is None or job.prepared.message is message):
                self._fail(job, EngineError(f"embedding request {request_id!r} was cancelled"))
                return True
        return False

    def fail_all(self, error: EngineError) -> None:
        """Fail every queued request (the engine stops)."""
        while self.queue:
            self._fail(self.queue[0], error)

    def _fail(self, job: EmbedJob, error: EngineError) -> None:
        if self.long is not None and self.long.job is job:
            self._free_long()
        self.queue.remove(job)
        settle(job.future, error=error)

    def give_back(self) -> bool:
        """Free a long text's cells for generation, which ran out (KV pressure): the
        text starts over when the cells for all of it are free. Whether any were held."""
        text = self.long
        if text is None or text.fed == 0:
            return False
        self.backend.kv.clear(text.lane)
        self.cells.clear(text.lane)
        text.fed, text.first, text.last, text.total = 0, None, None, None
        return True

    def _free_long(self) -> None:
        assert self.long is not None
        self.backend.kv.clear(self.long.lane)
        self.cells.clear(self.long.lane)
        self.long = None

    def expire(self) -> None:
        """Fail every queued request past its ``deadline_s``."""
        now = time.monotonic()
        for job in [j for j in self.queue if j.deadline is not None and j.deadline <= now]:
            self._fail(job, RequestTimeout(f"embedding request {job.request_id!r} passed its deadline_s"))

    def run(self, rows: int | None = None) -> None:
        """One embedding pass of at most ``rows`` rows (None: :attr:`rows_max`): pack,
        decode, pool, deliver what is complete (after :meth:`expire`)."""
        limit = self.rows_max if rows is None else max(1, min(rows, self.rows_max))
        self.pass_rows = 0
        if self.long is not None:
            self._feed_long(self.long, limit)
            return
        texts = self._pack(limit)
        if not texts:
            return
        if len(texts[0].tokens) > limit:
            self.long = texts[0]
            self._feed_long(texts[0], limit)
            return
        if not self.make_room(sum(len(t.tokens) for t in texts)):
            return  # the running requests hold the cells: next tick
        self.n_passes += 1
        try:
            code = self._decode(texts)
        finally:
            for text in texts:
                self.backend.kv.clear(text.lane)
        if code != 0:
            error = DecodeError(f"llama_decode failed with code {code} in an embedding pass")
            for job in {id(t.job): t.job for t in texts}.values():
                if job in self.queue:
                    self._fail(job, error)
            return
        for text in texts:
            self._store(text)
        self.n_texts += len(texts)
        self._deliver_done()

    def _deliver_done(self) -> None:
        for job in [j for j in self.queue if j.next == len(j.prepared.texts)]:
            self.queue.remove(job)
            self._deliver(job)

    def _feed_long(self, text: _Text, limit: int) -> None:
        """Decode the next chunk (``limit`` rows at most) of a text longer than a pass;
        its cells stay (booked) until its last chunk, then it is pooled and its cells
        freed."""
        chunk = text.tokens[text.fed : text.fed + limit]
        # The cells of all that is left, not just this chunk's: a text that cannot finish
        # would hold cells generation needs.
        if not self.make_room(len(text.tokens) - text.fed):
            return  # the running requests hold the cells: next tick
        self.n_passes += 1
        self._lay_out(0, text.lane, chunk, text.fed)
        code, rows = self._decode_rows(len(chunk))
        if rows is None:
            self._fail(text.job, DecodeError(f"llama_decode failed with code {code} in an embedding pass"))
            return
        self.cells.compute(text.lane, len(chunk))
        text.fed += len(chunk)
        self._accumulate(text, rows)
        if text.fed == len(text.tokens):
            self._free_long()
            self._store(text)
            self.n_texts += 1
            self._deliver_done()

    def _pack(self, n_batch: int) -> list[_Text]:
        """The texts of this pass, first come first served: as many as ``n_batch`` rows
        and the lanes hold, or one text longer than that, alone (the first)."""
        lanes = self.backend.embed_seq_ids
        texts: list[_Text] = []
        rows = 0
        for job in self.queue:
            for index in range(job.next, len(job.prepared.texts)):
                tokens = job.prepared.texts[index]
                if texts and (rows + len(tokens) > n_batch or len(texts) == len(lanes)):
                    return texts
                texts.append(_Text(job, index, lanes[len(texts)], tokens))
                rows += len(tokens)
                if rows >= n_batch:
                    return texts
        return texts

    def _decode(self, texts: list[_Text]) -> int:
        """Decode packed texts, accumulating each one's rows; llama_decode's code."""
        row = 0
        for text in texts:
            self._lay_out(row, text.lane, text.tokens, 0)
            row += len(text.tokens)
        code, rows = self._decode_rows(row)
        if rows is None:
            return code
        row = 0
        for text in texts:
            self._accumulate(text, rows[row : row + len(text.tokens)])
            row += len(text.tokens)
        return 0

    def _decode_rows(self, n_rows: int) -> tuple[int, npt.NDArray[np.float32] | None]:
        """``decode_embeddings``, its rows counted in :attr:`pass_rows`."""
        self.pass_rows = n_rows
        return self.backend.rows.decode_embeddings(n_rows)

    def _lay_out(self, row: int, lane: int, tokens: tuple[int, ...], pos: int) -> None:
        put_rows(self.backend.rows, row, lane, tokens, pos, logits=True)

    @staticmethod
    def _accumulate(text: _Text, rows: npt.NDArray[np.float32]) -> None:
        if text.first is None:
            text.first = rows[0].copy()
        text.last = rows[-1].copy()
        total = rows.sum(axis=0, dtype=np.float64)
        text.total = total if text.total is None else text.total + total

    @staticmethod
    def _store(text: _Text) -> None:
        job = text.job
        prepared = job.prepared
        if prepared.pooling == "cls":
            assert text.first is not None
            vector = text.first.astype(np.float64)
        elif prepared.pooling == "last":
            assert text.last is not None
            vector = text.last.astype(np.float64)
        else:
            assert text.total is not None
            vector = text.total / len(text.tokens)
        if prepared.message.normalize:
            norm = float(np.linalg.norm(vector))
            if norm > 0.0:
                vector = vector / norm
        job.vectors[text.index] = vector
        job.next = max(job.next, text.index + 1)

    @staticmethod
    def _deliver(job: EmbedJob) -> None:
        prepared = job.prepared
        job.vectors.flags.writeable = False
        settle(
            job.future,
            Embeddings(
                request_id=job.request_id,
                vectors=job.vectors,
                prompt_tokens=tuple(len(t) for t in prepared.texts),
                pooling=prepared.pooling,
                normalized=prepared.message.normalize,
                duration_ms=(time.monotonic() - job.t_admitted) * 1000.0,
            ),
        )
