"""The continuous-batching engine: :meth:`Engine.step` is one tick, top to bottom.

An :class:`Engine` is a plain object owned by one thread, the ServerActor's; it never
sends itself messages (the actor schedules ticks). One tick runs the phases of
LlamaCppEx's server: expire deadlines, dequeue waiting requests into free slots, let
the strategy plan the batch, check and lay out the plan, one forward pass that samples
and finishes, emit ``tick``. Each phase lives in the module of its idea (see
:mod:`actors.engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import telemetry
from actors.backend import faults
from actors.contract import StrategyError
from actors.engine._admission import Admission
from actors.engine._batch import Segment, check_plan, lay_out
from actors.engine._slots import Slot
from actors.engine._speculative import DraftWant
from actors.engine._state import EngineConfig
from strategies import BatchPlan, BatchStrategy, EmbedBudget, SlotState, SlotView

__all__ = ["Engine", "EngineConfig"]

# A costly drafter idle (its drafts left unverified) drafts only one tick in this many.
PROBE_EVERY = 8

_log = logging.getLogger("llama_cpp_actors.engine")


class Engine(Admission):
    """Slots, the wait queue and the tick (engine thread only).

    The parts stack, each calling only those below it: :class:`Admission`, then
    :class:`ForwardPass` (decode and KV pressure), :class:`Sampling`,
    :class:`Finishing`, on :class:`EngineState`.

    Args:
        backend: the loaded model and context.
        config: scheduling options.
        sender: what telemetry names as the sender (the actor's ref).
    """

    def step(self) -> None:
        """One tick, top to bottom; the README's tick diagram names these functions.

        1. ``_expire``: requests past their ``deadline_s`` end with ``"timeout"``.
        2. ``_dequeue``: waiting requests enter idle slots (``_start`` claims the
           longest cached prefix) while the KV cells have room; once one has, the
           idle slots' caches move to the RAM cache (``offload_idle``).
        3. ``_plan``: the strategy's ``build_batch``, checked by ``check_plan``.
        4. ``lay_out``: the plan written into the batch's arrays.
        5. ``_forward``: one ``llama_decode`` (``_no_kv_space`` purges, splits,
           preempts), then ``_commit`` records the rows and ``_sample``s each row
           with logits; ``_on_token`` streams the token and ``_finish``es a request
           that stopped.
        6. ``_emit_tick``: the ``tick`` signal.

        Before 3, a tick with ``Embed`` requests queued runs one embedding pass of its
        own (``Embedder.run``, :mod:`actors.engine._embedding`); while slots are busy,
        of the rows the strategy's ``embed_rows`` allows (``_embed_rows``).
        """
        self.n_ticks += 1
        if faults.tick is not None:
            faults.tick(self.n_ticks)
        if self._n_deadlines:
            self._expire()
        self._dequeue()
        if self.occupied:
            self.occupied = False
            if self.config.cache_idle_slots:
                self.memory.offload_idle(self.slots)
        if self.embedder.queue:
            self._embed(busy=any(slot.state is not SlotState.IDLE for slot in self.slots))
        busy = {slot.seq_id: slot for slot in self.slots if slot.state is not SlotState.IDLE}
        self._generated_at = time.perf_counter() if busy else 0.0  # the next pass's share counts from here
        if not busy:
            return
        if self.drafter is not None:
            self._propose(busy)
        plan = self._plan(busy)
        if plan is None:
            return
        segments = lay_out(plan, busy, self._arrays)
        self._eval_s = 0.0
        self._drafted_now = self._accepted_now = self._drafts_now = 0
        self._forward(segments, purge_allowed=True)
        if telemetry.tick.receivers:
            self._emit_tick(segments)

    def _embed(self, *, busy: bool) -> None:
        """This tick's embedding pass: all it can take when no slot is busy, else the
        rows ``_embed_rows`` allows. While slots are busy, the engine keeps what the
        passes took against the rest of the ticks' time (generation's, and the actor's
        between ticks), in sums that decay by a tenth a tick."""
        started = time.perf_counter()
        self.embedder.expire()  # on every tick, a pass or not
        if not self.embedder.queue:
            return
        if not busy:
            self.embed_window_ms = self.other_window_ms = 0.0
        elif self._generated_at:  # the last tick generated: its time since, and between ticks
            ms = (started - self._generated_at) * 1000.0
            self.generation_ms = _average(self.generation_ms, ms)
            self.embed_window_ms *= _DECAY
            self.other_window_ms = self.other_window_ms * _DECAY + ms
        rows = self._embed_rows() if busy else None
        if rows == 0:
            return
        self.embedder.run(rows)
        ms = (time.perf_counter() - started) * 1000.0
        if self.embedder.pass_rows:
            self.embed_row_ms = _average(self.embed_row_ms, ms / self.embedder.pass_rows)
            if busy:
                self.embed_window_ms += ms

    def _embed_rows(self) -> int:
        """The rows of this tick's embedding pass while slots are busy: the strategy's
        ``embed_rows``, checked (0: none this tick, or the strategy failed, and the
        embedding requests with it)."""
        embedder = self.embedder
        strategy = self.config.batch_strategy
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

    def _propose(self, busy: dict[int, Slot]) -> None:
        """Ask the drafter for each generating slot's draft (``Slot.draft``). A costly
        drafter (a draft model) is asked for one token here, and for the rest of what
        the plan verifies after it (``_extend_drafts``); ``Slot.draft_room`` says how
        many it could make.

        A draft never reaches the context's end (a shift or a "length" end inside a
        verified run would meet draft cells not yet dropped) nor past ``max_tokens``:
        a run of ``k`` drafts emits up to ``k + 1`` tokens.
        """
        assert self.drafter is not None
        costly = self.drafter.costly
        # A costly drafter whose drafts the plans left unverified drafts only every
        # PROBE_EVERY ticks (its first tokens are checked for free, as shadows), so a
        # busy engine does not pay a draft pass a tick for nothing.
        probe = not costly or self.draft_idle == 0 or self.n_ticks % PROBE_EVERY == 0
        # What the drafter holds for requests that left (ended, failed, preempted) may go.
        self.drafter.retain({seq_id: slot.request for seq_id, slot in busy.items()})
        wants, slots = [], []
        for slot in busy.values():
            slot.draft, slot.draft_room, slot.want = [], 0, None
            request = slot.request
            if slot.state is not SlotState.GENERATING or request is None or request.acceptance is None:
                continue
            if slot.shadow is not None:
                # Last tick's unverified draft: its first token against the one that came.
                token, at, kind = slot.shadow
                if len(request.token_ids) == at + 1:
                    request.acceptance.of(kind).verified(1, int(request.token_ids[-1] == token))
                slot.shadow = None
            room = self.n_ctx_slot - len(slot.cached) - 3
            left = request.message.max_tokens - len(request.token_ids) - 1
            limit = min(self.config.draft_max, room, left)
            if limit > 0 and probe:
                want = DraftWant(slot.seq_id, request, request.prompt, request.token_ids, limit)
                wants.append(dataclasses.replace(want, limit=1) if costly else want)
                slots.append(slot)
                slot.want = want
        if wants:
            for slot, draft in zip(slots, self.drafter.propose(wants), strict=True):
                slot.draft, slot.draft_kind = draft.tokens, draft.kind
                if costly and draft.tokens and slot.want is not None:
                    # A draft that cannot grow (its first token an end of generation,
                    # say): the plan must not count on tokens it will never get.
                    room = slot.want.limit
                    slot.draft_room = room if draft.room is None else min(room, draft.room)

    def _extend_drafts(self, plan: BatchPlan, busy: dict[int, Slot]) -> BatchPlan:
        """A costly drafter's drafts made as long as ``plan`` verifies; the plan cut to
        the tokens it made (a draft stops early at an unsure token or an end of
        generation)."""
        assert self.drafter is not None
        wants, slots = [], []
        for entry in plan.slots:
            slot = busy[entry.seq_id]
            want = slot.want
            k = entry.draft_tokens
            if want is not None and entry.decode and type(k) is int and k > len(slot.draft):
                # check_plan refuses an entry over the slot's room after this; the draft
                # model must never be run for more than that room first.
                wants.append(dataclasses.replace(want, limit=min(k, want.limit)))
                slots.append(slot)
        self.draft_idle = 0 if plan.num_draft_tokens else self.draft_idle + 1
        if not wants:
            return plan
        for slot, draft in zip(slots, self.drafter.propose(wants), strict=True):
            slot.draft = draft.tokens
        return BatchPlan(
            tuple(
                dataclasses.replace(e, draft_tokens=len(busy[e.seq_id].draft))
                if e.draft_tokens > len(busy[e.seq_id].draft)
                else e
                for e in plan.slots
            )
        )

    def _plan(self, busy: dict[int, Slot]) -> BatchPlan | None:
        views = {seq_id: slot.view() for seq_id, slot in busy.items()}
        n_batch = self.backend.n_batch
        strategy = self.config.batch_strategy
        try:
            plan = strategy.build_batch(
                list(views.values()), n_batch, self.config.chunk_size, queue_depth=len(self.waiting)
            )
            if (
                self.drafter is not None
                and isinstance(plan, BatchPlan)
                and any(view.draft_tokens for view in views.values())
            ):
                plan = self._with_drafts(strategy, views, plan, busy)
            return check_plan(plan, views, n_batch, self.config.chunk_size)
        except BaseException as e:  # sys.exit() in a strategy must not stop every actor
            error = (
                e
                if isinstance(e, StrategyError)
                else StrategyError(f"{self.config.batch_strategy!r} raised {e!r}")
            )
            _log.error("batch strategy failed; failing %d active requests: %s", len(busy), error)
            for slot in busy.values():
                self._fail(slot, error)
            return None

    def _with_drafts(
        self, strategy: BatchStrategy, views: dict[int, SlotView], plan: BatchPlan, busy: dict[int, Slot]
    ) -> BatchPlan:
        """The strategy's ``plan_drafts`` within what the batch and the free KV cells
        leave (a draft never pushes out a cache, let alone a request)."""
        base = check_plan(plan, views, self.backend.n_batch, self.config.chunk_size)
        budget = min(self.backend.n_batch, self.memory.free_cells) - base.num_tokens
        if budget <= 0:
            result = base
        else:
            result = strategy.plan_drafts(list(views.values()), base, budget, self.cost.cost())
            if not isinstance(result, BatchPlan):
                raise StrategyError(f"plan_drafts must return a BatchPlan, got {type(result).__name__}")
            if result.num_draft_tokens - base.num_draft_tokens > budget:
                raise StrategyError(
                    f"plan_drafts added {result.num_draft_tokens - base.num_draft_tokens} draft tokens, "
                    f"over its budget of {budget}"
                )
        if self.drafter is not None and self.drafter.costly:
            result = self._extend_drafts(result, busy)
        planned = {entry.seq_id: entry.draft_tokens for entry in result.slots}
        for seq_id, slot in busy.items():  # a draft the plan passed over: checked next tick
            request = slot.request
            if slot.draft and not planned.get(seq_id) and request is not None:
                slot.shadow = (slot.draft[0], len(request.token_ids), slot.draft_kind)
        return result

    def _emit_tick(self, segments: list[Segment]) -> None:
        n_tokens = sum(s.end - s.start for s in segments)
        n_decode = sum(1 for s in segments if s.decode)
        n_prefill = sum(s.end - s.start for s in segments if not s.decode)
        self._send(
            telemetry.tick,
            {
                "batch_size": n_tokens,
                "decode_tokens": n_decode,
                "prefill_tokens": n_prefill,
                "active_slots": sum(1 for s in self.slots if s.state is not SlotState.IDLE),
                "queue_depth": len(self.waiting),
                "eval_ms": self._eval_s * 1000.0,
                "drafts": self._drafts_now,
                "draft_tokens": self._drafted_now,
                "draft_accepted": self._accepted_now,
                **self._kv_use(),
            },
            {"slots": tuple(self._slot_sample(slot) for slot in self.slots)},
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
        ram = self.memory.ram
        states = [slot.state for slot in self.slots]
        return {
            "active_slots": sum(1 for s in states if s is not SlotState.IDLE),
            "idle_slots": sum(1 for s in states if s is SlotState.IDLE),
            "prefilling_slots": sum(1 for s in states if s is SlotState.PREFILLING),
            "generating_slots": sum(1 for s in states if s is SlotState.GENERATING),
            "queue_depth": len(self.waiting),
            "embed_queue_depth": len(self.embedder.queue),
            "embed_passes": self.embedder.n_passes,
            "embedded_texts": self.embedder.n_texts,
            "n_parallel": len(self.slots),
            "n_batch": self.backend.n_batch,
            "n_ctx": self.backend.n_ctx,
            "n_ctx_per_slot": self.n_ctx_slot,
            **self._kv_use(),
            "ram_cache_entries": len(ram.entries) if ram else 0,
            "ram_cache_bytes": ram.bytes_used if ram else 0,
            "preemptions": self.preemptions,
            "draft_tokens": self.draft_tokens,
            "draft_accepted": self.draft_accepted,
            "draft_acceptance_rate": self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "slots": tuple(self._slot_sample(slot) for slot in self.slots),
            # What llama.cpp itself holds per slot (its highest position + 1): equal to
            # each slot's kv_tokens unless cells leaked (a draft's, say).
            "kv_positions": tuple(self.backend.kv.pos_max(slot.seq_id) + 1 for slot in self.slots),
        }


_DECAY = 0.9  # the embedding and generation time sums lose a tenth a tick


def _average(average: float, value: float) -> float:
    """A moving average of measured times (0: none yet)."""
    return value if average == 0.0 else 0.7 * average + 0.3 * value
