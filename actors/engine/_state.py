"""An engine's state and how it reports: the options, the slots, the wait queue, the
request table, and the helpers that send its telemetry.

Every other part of the engine is a class stacked on :class:`EngineState` (see
:mod:`actors.engine`); all of it runs in the engine's thread only.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import telemetry
from actors.backend import Backend
from actors.contract import SamplingParams
from actors.engine._batch import BatchArrays
from actors.engine._draft_model import ModelDrafter
from actors.engine._embedding import Embedder
from actors.engine._memory import KVMemory
from actors.engine._slots import Choices, Request, Slot
from actors.engine._speculative import CostModel, Drafter, NgramDrafter
from strategies import BatchStrategy, SlotState

__all__ = ["EngineConfig", "EngineState"]


class EngineConfig:
    """The scheduling options of an engine (checked by ``ServerActor``)."""

    __slots__ = (
        "batch_strategy", "cache_idle_slots", "cache_prompt", "chunk_size", "context_shift",
        "defaults", "draft_max", "draft_p_min", "max_queue", "n_ctx_per_slot", "name",
        "prefix_sharing", "ram_budget_bytes", "spec_type",
    )  # fmt: skip

    def __init__(
        self,
        *,
        chunk_size: int,
        max_queue: int,
        cache_prompt: bool,
        batch_strategy: BatchStrategy,
        defaults: SamplingParams,
        n_ctx_per_slot: int | None = None,
        context_shift: bool = True,
        ram_budget_bytes: int = 0,
        name: str | None = None,
        prefix_sharing: bool = True,
        spec_type: str | None = None,
        draft_max: int = 16,
        draft_p_min: float = 0.0,
        cache_idle_slots: bool = True,
    ) -> None:
        self.name = name
        self.cache_idle_slots = cache_idle_slots
        self.spec_type = spec_type
        self.draft_max = draft_max
        self.draft_p_min = draft_p_min
        self.prefix_sharing = prefix_sharing
        self.chunk_size = chunk_size
        self.max_queue = max_queue
        self.cache_prompt = cache_prompt
        self.batch_strategy = batch_strategy
        self.defaults = defaults
        self.n_ctx_per_slot = n_ctx_per_slot
        self.context_shift = context_shift
        self.ram_budget_bytes = ram_budget_bytes


class EngineState:
    """The state every part of the engine shares (engine thread only).

    Args:
        backend: the loaded model and context.
        config: scheduling options.
        sender: what telemetry names as the sender (the actor's ref).
        draft_backend: the draft model's context, for ``spec_type="draft"``; the
            engine owns it from here (its drafter closes it).
    """

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig,
        sender: Any,
        draft_backend: Backend | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.sender = sender
        self.slots = [Slot(seq_id) for seq_id in range(backend.n_seq_max)]
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # by Request.key: a choice i > 0 is "id#i"
        self.choices: dict[str, Choices] = {}  # requests with n > 1, by request id
        self._arrivals = 0
        self._arrays = BatchArrays(
            backend.rows.tokens, backend.rows.pos, backend.rows.seq_ids, backend.rows.logits
        )
        self._eval_s = 0.0  # time inside llama_decode this tick
        self.generation_ms = 0.0  # a generating tick's time lately, with the actor's between ticks
        self._generated_at = 0.0  # when the last tick's embedding part ended, if it generated
        self.embed_window_ms = 0.0  # embedding passes' time lately, while busy (decaying sum)
        self.other_window_ms = 0.0  # the rest of those ticks' time (decaying sum)
        self.embed_row_ms = 0.0  # an embedding pass's time per row lately (a moving average)
        self.preemptions = 0
        self.n_ticks = 0
        self._n_deadlines = 0  # live requests with a deadline: skip the scan without them
        self.draining = False
        # A request entered a slot since the last tick: idle caches may leave the KV.
        self.occupied = False
        # A sequence's positions stay below this; by default an even share of the
        # KV cells, never past what the model was trained on.
        self.n_ctx_slot = config.n_ctx_per_slot or min(
            backend.n_ctx // len(self.slots), backend.n_ctx_train or backend.n_ctx
        )
        self.memory = KVMemory(
            backend, config.cache_prompt, config.ram_budget_bytes, self._emit, config.prefix_sharing
        )
        # Speculative decoding: the drafter, the measured cost of a forward pass, and
        # draft tokens verified and accepted in all (GetStats).
        self.drafter: Drafter | None = None
        if config.spec_type == "ngram":
            self.drafter = NgramDrafter()
        elif config.spec_type == "draft":
            assert draft_backend is not None
            self.drafter = ModelDrafter(
                draft_backend, self.n_ctx_slot, config.draft_p_min, chunk_size=config.chunk_size
            )
        self.cost = CostModel()
        if self.drafter is not None:  # price draft rows by this machine's passes, not a guess
            sizes = [n for n in CostModel.CALIBRATE if n <= self.n_ctx_slot]
            self.cost.calibrate(backend.rows.time_passes(sizes, self.slots[0].seq_id))
        self.embedder = Embedder(backend, config.max_queue, self._room_for_embeddings, self.memory.cells)
        self.draft_idle = 0  # ticks since a costly drafter's drafts were last verified
        self.draft_tokens = 0
        self.draft_accepted = 0
        self._drafted_now = 0  # this tick's, for the tick signal
        self._accepted_now = 0
        self._drafts_now = 0  # drafts verified this tick (one per slot that had one)

    @property
    def has_work(self) -> bool:
        """True while a slot is busy or a request waits."""
        return (
            bool(self.waiting)
            or bool(self.embedder.queue)
            or any(slot.state is not SlotState.IDLE for slot in self.slots)
        )

    def _room_for_embeddings(self, need: int) -> bool:
        """Free ``need`` KV cells for an embedding pass, dropping idle slots' caches
        (least recently used first) if it must; whether they are free."""
        if self.memory.free_cells < need:
            purged = self.memory.purge_idle(self.slots, need)
            if purged:
                self._kv_event("purge", {"purged_slots": purged})
        return self.memory.free_cells >= need

    def _kv_use(self) -> dict[str, int]:
        """KV cells holding tokens and KV cells in all, as GetStats and the signals say."""
        return {
            "kv_cells_used": self.memory.cells.used,
            "kv_cells_total": self.backend.n_ctx,
        }

    def _kv_event(self, event: str, measurements: dict[str, Any], request: Request | None = None) -> None:
        if telemetry.kv_pressure.receivers:
            self._send(
                telemetry.kv_pressure,
                {**measurements, **self._kv_use()},
                {"event": event, "request_id": request.request_id if request else None},
            )

    def _send(self, signal: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Emit ``signal`` as this engine, its ``name`` in ``metadata["replica"]`` when it has one."""
        if self.config.name is not None:
            metadata = {**metadata, "replica": self.config.name}
        telemetry.emit(signal, self.sender, measurements, metadata)

    def _emit(self, name: str, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        signal = getattr(telemetry, name)
        if signal.receivers:
            self._send(signal, measurements, metadata)

    @staticmethod
    def _metadata(request: Request) -> dict[str, Any]:
        return {"request_id": request.request_id, "seq_id": request.seq_id, "mode": request.mode}
