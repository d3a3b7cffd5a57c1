"""A tick's embedding pass: all the queued ``Embed`` work it can take when no slot is
busy, else the rows the strategy's ``embed_rows`` allows, priced by what the passes
and generation have cost lately.

Runs in the engine's thread only.
"""

from __future__ import annotations

import logging
import time

from actors.contract import StrategyError
from actors.engine._state import EngineState
from strategies import EmbedBudget

__all__ = ["EmbedPass"]

_log = logging.getLogger("llama_cpp_actors.engine")

_DECAY = 0.9  # the embedding and generation time sums lose a tenth a tick


def _average(average: float, value: float) -> float:
    """A moving average of measured times (0: none yet)."""
    return value if average == 0.0 else 0.7 * average + 0.3 * value


class EmbedPass:
    """Runs the embedder once a tick and keeps its time against generation's
    (engine thread only).

    While slots are busy, the pass keeps what embedding took against the rest of the
    ticks' time (generation's, and the actor's between ticks), in sums that decay by a
    tenth a tick: the strategy's ``embed_rows`` decides from them.

    Args:
        state: the engine's shared state.
    """

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.generation_ms = 0.0  # a generating tick's time lately, with the actor's between ticks
        self.generated_at = 0.0  # when the last tick's embedding part ended, if it generated
        self.embed_window_ms = 0.0  # embedding passes' time lately, while busy (decaying sum)
        self.other_window_ms = 0.0  # the rest of those ticks' time (decaying sum)
        self.embed_row_ms = 0.0  # an embedding pass's time per row lately (a moving average)

    def run(self, *, busy: bool) -> None:
        """This tick's pass: all it can take when no slot is ``busy``, else the rows
        ``_rows`` allows."""
        embedder = self.state.embedder
        started = time.perf_counter()
        embedder.expire()  # on every tick, a pass or not
        if not embedder.queue:
            return
        if not busy:
            self.embed_window_ms = self.other_window_ms = 0.0
        elif self.generated_at:  # the last tick generated: its time since, and between ticks
            ms = (started - self.generated_at) * 1000.0
            self.generation_ms = _average(self.generation_ms, ms)
            self.embed_window_ms *= _DECAY
            self.other_window_ms = self.other_window_ms * _DECAY + ms
        rows = self._rows() if busy else None
        if rows == 0:
            return
        # Embeddings run with the server's default adapters (no set of their own).
        self.state.backend.adapters.use(self.state.default_adapters())
        embedder.run(rows)
        ms = (time.perf_counter() - started) * 1000.0
        if embedder.pass_rows:
            self.embed_row_ms = _average(self.embed_row_ms, ms / embedder.pass_rows)
            if busy:
                self.embed_window_ms += ms

    def mark_generation(self, busy: bool) -> None:
        """The tick's generation starts now (when ``busy``): the next pass's share counts
        from here."""
        self.generated_at = time.perf_counter() if busy else 0.0

    def _rows(self) -> int:
        """The rows of this tick's pass while slots are busy: the strategy's
        ``embed_rows``, checked (0: none this tick, or the strategy failed, and the
        embedding requests with it)."""
        embedder = self.state.embedder
        strategy = self.state.config.batch_strategy
        try:
            most = embedder.rows_max
            budget = EmbedBudget(
                most, self.generation_ms, self.embed_row_ms, self.embed_window_ms, self.other_window_ms
            )
            rows = strategy.embed_rows(budget)
            if type(rows) is not int or not 0 <= rows <= most:
                raise StrategyError(f"embed_rows must return an int in [0, {most}], got {rows!r}")
            return rows
        except BaseException as e:  # sys.exit() in a strategy must not stop every actor
            error = e if isinstance(e, StrategyError) else StrategyError(f"{strategy!r} raised {e!r}")
            _log.error("batch strategy failed; failing the embedding requests: %s", error)
            embedder.fail_all(error)
            return 0
