"""The state the engine's parts share: the options, the slots, the wait queue, the
request table, the caches, and the helpers that send its telemetry.

:class:`EngineState` is the one object the scheduler, the runner, the output stage and
the lifecycle all read and write (see :mod:`actors.engine`); none of them holds state of
its own that another needs. It runs in the engine's thread only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import telemetry
from actors.backend import Backend, resolve_lora
from actors.contract import SamplingParams
from actors.engine._batch import BatchArrays
from actors.engine._draft_model import ModelDrafter
from actors.engine._embedding import Embedder
from actors.engine._memory import KVMemory
from actors.engine._slots import Choices, Request, Slot
from actors.engine._speculative import CostModel, Drafter, NgramDrafter
from strategies import AdapterSet, BatchStrategy, SlotState

__all__ = ["EngineConfig", "EngineState", "TickCounts"]


class EngineConfig:
    """The scheduling options of an engine (checked by ``ServerActor``)."""

    __slots__ = (
        "batch_strategy", "cache_idle_slots", "cache_prompt", "chunk_size", "context_shift",
        "defaults", "draft_max", "draft_min", "draft_p_min", "kv_file_max_bytes", "max_queue",
        "n_ctx_per_slot", "name", "prefix_sharing", "ram_budget_bytes", "spec_type",
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
        draft_min: int = 0,
        draft_p_min: float = 0.0,
        cache_idle_slots: bool = True,
        kv_file_max_bytes: int = 1 << 31,
    ) -> None:
        self.name = name
        # The largest KV state a slot file may hold: a hostile file is never read whole.
        self.kv_file_max_bytes = kv_file_max_bytes
        self.cache_idle_slots = cache_idle_slots
        self.spec_type = spec_type
        self.draft_max = draft_max
        self.draft_min = draft_min
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


@dataclass(slots=True)
class TickCounts:
    """What one tick's forward pass did, for its ``tick`` signal (reset each tick)."""

    eval_s: float = 0.0  # time inside llama_decode
    drafts: int = 0  # drafts verified (one per slot that had one)
    draft_tokens: int = 0
    draft_accepted: int = 0


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
        self.arrivals = 0
        self.arrays = BatchArrays(
            backend.rows.tokens, backend.rows.pos, backend.rows.seq_ids, backend.rows.logits
        )
        self.now = TickCounts()
        self.preemptions = 0
        self.n_ticks = 0
        self.n_deadlines = 0  # live requests with a deadline: skip the scan without them
        self.draining = False
        # A request entered a slot since the last tick: idle caches may leave the KV.
        self.occupied = False
        # A sequence's positions stay below this; by default an even share of the
        # KV cells, never past what the model was trained on.
        self.n_ctx_slot = config.n_ctx_per_slot or min(
            backend.n_ctx // len(self.slots), backend.n_ctx_train or backend.n_ctx
        )
        self.memory = KVMemory(
            backend, config.cache_prompt, config.ram_budget_bytes, self.emit, config.prefix_sharing
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
        self.embedder = Embedder(backend, config.max_queue, self.make_room, self.memory.cells)
        self.draft_tokens = 0
        self.draft_accepted = 0
        # LoRA: the scales a request without its own ``lora`` runs with (SetLora changes
        # them), and how many ticks in a row the set in use has been served.
        self.lora_scales: tuple[float, ...] = tuple(a.scale for a in backend.adapters.loaded)
        self.adapter_streak = 0
        self.adapters_served: AdapterSet | None = None

    @property
    def has_work(self) -> bool:
        """True while a slot is busy or a request waits."""
        return (
            bool(self.waiting)
            or bool(self.embedder.queue)
            or any(slot.state is not SlotState.IDLE for slot in self.slots)
        )

    def default_adapters(self) -> AdapterSet:
        """The adapter set of a request without its own ``lora``: the server's scales now."""
        return resolve_lora(None, self.backend.adapters.loaded, self.lora_scales)

    def use_adapters(self, adapters: AdapterSet) -> None:
        """Apply ``adapters`` to the next decodes; count the ticks a set is served in a row."""
        if adapters == self.adapters_served:
            self.adapter_streak += 1
        else:
            self.adapters_served, self.adapter_streak = adapters, 1
        self.backend.adapters.use(adapters)

    def busy(self) -> dict[int, Slot]:
        """The slots that hold a request, by sequence id."""
        return {slot.seq_id: slot for slot in self.slots if slot.state is not SlotState.IDLE}

    def idle(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.state is SlotState.IDLE]

    # -- KV room --------------------------------------------------------------------

    def kv_room_for(self, request: Request) -> bool:
        """Admit only what the KV cells can hold beside the running requests' next tokens.

        Without this a preempted request would take its slot back at once, find no
        room for its prefill and push another request out: thrashing. Idle caches do
        not count: they are dropped on demand.
        """
        busy = [slot for slot in self.slots if slot.request is not None]
        if not busy:
            return True
        memory = self.memory
        held = memory.cells.used - memory.idle_cells(self.slots)  # a shared cell counts once
        # A prefilling slot will soon hold its whole context; the new request shares
        # what busy slots hold of its prompt.
        coming = sum(max(0, len(slot.request.context) - len(slot.cached)) for slot in busy if slot.request)
        need = len(request.context) - memory.reusable(request, self.slots)
        return held + coming + len(busy) + need <= self.backend.n_ctx

    def purge_idle(self, need: int | None = None, last: frozenset[int] = frozenset()) -> int:
        """Free idle caches (saved to RAM when on), least recently used first and ``last``'s
        last, until ``need`` cells are free (all when None); how many were purged."""
        purged = self.memory.purge_idle(self.slots, need, last)
        if purged:
            self.kv_event("purge", {"purged_slots": purged})
        return purged

    def make_room(self, need: int, last: frozenset[int] = frozenset()) -> bool:
        """``purge_idle`` until ``need`` cells are free (a RAM restore or an embedding
        pass needs that many empty; the embedder's callback); whether they are."""
        if self.memory.free_cells < need:
            self.purge_idle(need, last)
        return self.memory.free_cells >= need

    # -- telemetry ------------------------------------------------------------------

    def kv_use(self) -> dict[str, int]:
        """KV cells holding tokens and KV cells in all, as GetStats and the signals say."""
        return {"kv_cells_used": self.memory.cells.used, "kv_cells_total": self.backend.n_ctx}

    def kv_event(self, event: str, measurements: dict[str, Any], request: Request | None = None) -> None:
        """A ``kv_pressure`` signal (when anyone listens)."""
        if telemetry.kv_pressure.receivers:
            self.send(
                telemetry.kv_pressure,
                {**measurements, **self.kv_use()},
                {"event": event, "request_id": request.request_id if request else None},
            )

    def send(self, signal: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        """Emit ``signal`` as this engine, its ``name`` in ``metadata["replica"]`` when it has one."""
        if self.config.name is not None:
            metadata = {**metadata, "replica": self.config.name}
        telemetry.emit(signal, self.sender, measurements, metadata)

    def emit(self, name: str, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        """The signal called ``name``, when anyone listens (the caches' callback)."""
        signal = getattr(telemetry, name)
        if signal.receivers:
            self.send(signal, measurements, metadata)

    @staticmethod
    def metadata(request: Request) -> dict[str, Any]:
        return {"request_id": request.request_id, "seq_id": request.seq_id, "mode": request.mode}
