"""The continuous-batching engine: :meth:`Engine.step` is one tick, plan → execute →
update, over one shared state.

An :class:`Engine` is a plain object owned by one thread, the ServerActor's; it never
sends itself messages (the actor schedules ticks). It composes four parts, each of one
idea, that share one :class:`EngineState` and call only downward:

- :class:`Scheduler`: admission, the queue, deadlines, KV room, and the strategy's plan
  (plain data);
- :class:`Runner`: the plan laid out, one ``llama_decode``, and KV pressure;
- :class:`OutputStage`: each decoded row recorded, sampled, streamed and stopped;
- :class:`Lifecycle`: a request entering a slot, and its one outcome delivered.
"""

from __future__ import annotations

from typing import Any

import pykka

import telemetry
from actors.backend import Backend, default_scales, faults
from actors.contract import (
    EngineError,
    EraseSlot,
    LoraAdapter,
    LoraScales,
    ReplyTo,
    RestoreSlot,
    SaveSlot,
    SlotFile,
)
from actors.engine._batch import Segment
from actors.engine._decisions import PreparedDecision
from actors.engine._drafting import DraftPlanner
from actors.engine._embed_pass import EmbedPass
from actors.engine._embedding import PreparedEmbed
from actors.engine._lifecycle import Lifecycle
from actors.engine._output_stage import OutputStage
from actors.engine._prepare import Prepared
from actors.engine._runner import Runner
from actors.engine._scheduler import Scheduler, Stall
from actors.engine._slot_files import SlotFiles
from actors.engine._slots import Request, Slot
from actors.engine._speculative import CostModel, Drafter
from actors.engine._state import EngineConfig, EngineState, TickCounts
from strategies import SlotState

__all__ = ["Engine", "EngineConfig"]


class Engine:
    """Slots, the wait queue and the tick (engine thread only).

    Args:
        backend: the loaded model and context.
        config: scheduling options.
        sender: what telemetry names as the sender (the actor's ref).
        draft_backend: the draft model's context, for ``spec_type="draft"``; the
            engine owns it from here (its drafter closes it).
        on_stall: told, in the courier's thread, when a stream's consumer stops
            reading (the actor tells itself to cancel the request).
    """

    def __init__(
        self,
        backend: Backend,
        config: EngineConfig,
        sender: Any,
        draft_backend: Backend | None = None,
        *,
        on_stall: Stall,
    ) -> None:
        self.state = state = EngineState(backend, config, sender, draft_backend)
        self.lifecycle = Lifecycle(state)
        self.output = OutputStage(state, self.lifecycle)
        self.runner = Runner(state, self.lifecycle, self.output.commit)
        drafts = DraftPlanner(state, state.drafter) if state.drafter is not None else None
        self.scheduler = Scheduler(state, self.lifecycle, drafts, on_stall)
        self.embed_pass = EmbedPass(state)
        self.slot_files = SlotFiles(state)

    def step(self) -> None:
        """One tick, top to bottom; the README's tick diagram names these functions.

        1. ``Scheduler.expire``: requests past their ``deadline_s`` end with ``"timeout"``.
        2. ``Scheduler.dequeue``: waiting requests enter idle slots (``_start`` claims
           the longest cached prefix) while the KV cells have room; once one has, the
           idle slots' caches move to the RAM cache (``offload_idle``).
        3. ``EmbedPass.run``: with ``Embed`` requests queued, one embedding pass of
           its own; while slots are busy, of the rows the strategy's ``embed_rows``
           allows.
        4. ``Scheduler.schedule``: the drafts, the strategy's ``build_batch``, checked
           by ``check_plan``: a plan, plain data.
        5. ``Runner.execute``: ``lay_out`` writes the plan into the batch; one
           ``llama_decode`` (``_no_kv_space`` purges, splits, preempts); each range
           that decodes goes to ``OutputStage.commit``, which records the rows and
           samples each row with logits; ``_on_token`` streams the token and the
           ``Lifecycle`` finishes a request that stopped.
        6. ``_emit_tick``: the ``tick`` signal.
        """
        state, scheduler = self.state, self.scheduler
        state.n_ticks += 1
        if faults.tick is not None:
            faults.tick(state.n_ticks)
        if state.n_deadlines:
            scheduler.expire()
        scheduler.dequeue()
        if state.occupied:
            state.occupied = False
            if state.config.cache_idle_slots:
                state.memory.offload_idle(state.slots)
        busy = state.busy()  # an embedding pass changes no slot's state
        if state.embedder.queue:
            self.embed_pass.run(busy=bool(busy))
        self.embed_pass.mark_generation(bool(busy))
        if not busy:
            return
        plan = scheduler.schedule(busy)
        if plan is None:
            return
        state.now = TickCounts()
        segments = self.runner.execute(plan, busy)
        if telemetry.tick.receivers:
            self._emit_tick(segments)

    # -- what the actor calls -------------------------------------------------------

    def admit(
        self,
        prepared: Prepared,
        future: pykka.ThreadingFuture[object] | None = None,
        reply_to: ReplyTo | None = None,
    ) -> None:
        """Place a prepared request in a slot or the queue (see :meth:`Scheduler.admit`)."""
        self.scheduler.admit(prepared, future, reply_to)

    def admit_embed(self, prepared: PreparedEmbed, future: pykka.ThreadingFuture[object]) -> None:
        """Queue a prepared ``Embed`` (see :meth:`Scheduler.admit_embed`)."""
        self.scheduler.admit_embed(prepared, future)

    def admit_decision(self, prepared: PreparedDecision, future: pykka.ThreadingFuture[object]) -> None:
        """Place a prepared ``Decide``'s requests (see :meth:`Scheduler.admit_decision`)."""
        self.scheduler.admit_decision(prepared, future)

    def cancel(self, request_id: str, message: object = None) -> None:
        """Cancel a queued or running request (see :meth:`Scheduler.cancel`)."""
        self.scheduler.cancel(request_id, message)

    def fail_all(self, error: EngineError) -> None:
        """Fail every running and queued request (engine stopping)."""
        self.lifecycle.fail_all(error)

    def lora(self) -> tuple[LoraAdapter, ...]:
        """The LoRA adapters, in id order, each with the server's default scale now."""
        loaded = self.state.backend.adapters.loaded
        return tuple(
            LoraAdapter(a.path, s, a.name) for a, s in zip(loaded, self.state.lora_scales, strict=True)
        )

    def set_lora(self, scales: LoraScales) -> tuple[LoraAdapter, ...]:
        """Set the default scales: those ``scales`` names, the rest 0 (requests admitted
        from now on without their own ``lora`` take them); the new list.

        Raises:
            InvalidRequest: it names an adapter the server does not have.
        """
        self.state.lora_scales = default_scales(self.state.backend.adapters.loaded, scales)
        return self.lora()

    def save_slot(self, message: SaveSlot) -> SlotFile:
        """Write a slot's tokens and KV to a file (see :meth:`SlotFiles.save`)."""
        return self.slot_files.save(message)

    def restore_slot(self, message: RestoreSlot) -> SlotFile:
        """Load a slot file into an idle slot (see :meth:`SlotFiles.restore`)."""
        return self.slot_files.restore(message)

    def erase_slot(self, message: EraseSlot) -> int:
        """Drop what a slot (or a session) holds; the tokens dropped (see :meth:`SlotFiles.erase`)."""
        return self.slot_files.erase(message)

    @property
    def has_work(self) -> bool:
        """True while a slot is busy or a request waits."""
        return self.state.has_work

    @property
    def backend(self) -> Backend:
        return self.state.backend

    @property
    def n_ctx_slot(self) -> int:
        """A slot's context: a sequence's positions stay below it."""
        return self.state.n_ctx_slot

    @property
    def requests(self) -> dict[str, Request]:
        """The admitted requests not yet ended, by key."""
        return self.state.requests

    @property
    def slots(self) -> list[Slot]:
        return self.state.slots

    @property
    def drafter(self) -> Drafter | None:
        return self.state.drafter

    @property
    def cost(self) -> CostModel:
        """The measured cost of a forward pass, by its rows (speculation prices drafts by it)."""
        return self.state.cost

    @property
    def draining(self) -> bool:
        """True once the engine takes no new requests (a ``Drain``)."""
        return self.state.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.state.draining = value

    def _emit_tick(self, segments: list[Segment]) -> None:
        state = self.state
        n_tokens = sum(s.end - s.start for s in segments)
        n_decode = sum(1 for s in segments if s.decode)
        n_prefill = sum(s.end - s.start for s in segments if not s.decode)
        state.send(
            telemetry.tick,
            {
                "batch_size": n_tokens,
                "decode_tokens": n_decode,
                "prefill_tokens": n_prefill,
                "active_slots": sum(1 for s in state.slots if s.state is not SlotState.IDLE),
                "queue_depth": len(state.waiting),
                "eval_ms": state.now.eval_s * 1000.0,
                "drafts": state.now.drafts,
                "draft_tokens": state.now.draft_tokens,
                "draft_accepted": state.now.draft_accepted,
                **state.kv_use(),
            },
            {"slots": tuple(self._slot_sample(slot) for slot in state.slots)},
        )

    @staticmethod
    def _slot_sample(slot: Slot) -> telemetry.SlotSample:
        request = slot.request
        if request is None:
            return telemetry.SlotSample(slot.seq_id, slot.state.name.lower(), None, 0, 0, len(slot.cached))
        return telemetry.SlotSample(
            slot.seq_id,
            slot.state.name.lower(),
            request.request_id,
            len(request.prompt),
            len(request.token_ids),
            len(slot.cached),
        )

    def stats(self) -> dict[str, Any]:
        """The engine's load, as ``GetStats`` returns it (``slots``: a ``SlotSample`` each)."""
        state = self.state
        ram = state.memory.ram
        states = [slot.state for slot in state.slots]
        return {
            "active_slots": sum(1 for s in states if s is not SlotState.IDLE),
            "idle_slots": sum(1 for s in states if s is SlotState.IDLE),
            "prefilling_slots": sum(1 for s in states if s is SlotState.PREFILLING),
            "generating_slots": sum(1 for s in states if s is SlotState.GENERATING),
            "queue_depth": len(state.waiting),
            "embed_queue_depth": len(state.embedder.queue),
            "embed_passes": state.embedder.n_passes,
            "embedded_texts": state.embedder.n_texts,
            "n_parallel": len(state.slots),
            "n_batch": state.backend.n_batch,
            "n_ctx": state.backend.n_ctx,
            "n_ctx_per_slot": state.n_ctx_slot,
            **state.kv_use(),
            "ram_cache_entries": len(ram.entries) if ram else 0,
            "ram_cache_bytes": ram.bytes_used if ram else 0,
            "preemptions": state.preemptions,
            "draft_tokens": state.draft_tokens,
            "draft_accepted": state.draft_accepted,
            "draft_acceptance_rate": state.draft_accepted / state.draft_tokens if state.draft_tokens else 0.0,
            "slots": tuple(self._slot_sample(slot) for slot in state.slots),
            # What llama.cpp itself holds per slot (its highest position + 1): equal to
            # each slot's kv_tokens unless cells leaked (a draft's, say).
            "kv_positions": tuple(state.backend.kv.pos_max(slot.seq_id) + 1 for slot in state.slots),
        }
