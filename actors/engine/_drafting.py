"""Speculative decoding's side of the plan: each generating slot's draft before the
strategy plans, the strategy's ``plan_drafts`` within what the batch and the free KV
cells leave, and a costly drafter's drafts grown to what the plan verifies.

A slot verifies a draft of at least ``draft_min`` tokens or none (llama-server's
``--spec-draft-n-min``): a plan's shorter count for it, whether the strategy chose it
or the drafter had no more (a draft model's draft stopped at an unsure token), becomes
0, and the draft is checked for free next tick as one passed over.

Runs in the engine's thread only; the drafts are verified by the output stage.
"""

from __future__ import annotations

import dataclasses

from actors.contract import StrategyError
from actors.engine._batch import check_plan
from actors.engine._slots import Slot
from actors.engine._speculative import Drafter, DraftWant
from actors.engine._state import EngineState
from strategies import BatchPlan, BatchStrategy, SlotState, SlotView

__all__ = ["PROBE_EVERY", "DraftPlanner"]

PROBE_EVERY = 8
"""A costly drafter idle (its drafts left unverified) drafts only one tick in this many."""


class DraftPlanner:
    """Drafts for the plan (engine thread only).

    Args:
        state: the engine's shared state.
        drafter: the engine's drafter.
    """

    def __init__(self, state: EngineState, drafter: Drafter) -> None:
        self.state = state
        self.drafter = drafter
        self.draft_idle = 0  # ticks since a costly drafter's drafts were last verified

    def propose(self, busy: dict[int, Slot]) -> None:
        """Ask the drafter for each generating slot's draft (``Slot.draft``). A costly
        drafter (a draft model) is asked for one token here, and for the rest of what
        the plan verifies after it (``_extend_drafts``); ``Slot.draft_room`` says how
        many it could make.

        A draft never reaches the context's end (a shift or a "length" end inside a
        verified run would meet draft cells not yet dropped) nor past ``max_tokens``:
        a run of ``k`` drafts emits up to ``k + 1`` tokens.
        """
        drafter = self.drafter
        costly = drafter.costly
        # A costly drafter whose drafts the plans left unverified drafts only every
        # PROBE_EVERY ticks (its first tokens are checked for free, as shadows), so a
        # busy engine does not pay a draft pass a tick for nothing.
        probe = not costly or self.draft_idle == 0 or self.state.n_ticks % PROBE_EVERY == 0
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
            room = self.state.n_ctx_slot - len(slot.cached) - 3
            left = request.message.max_tokens - len(request.token_ids) - 1
            limit = min(self.state.config.draft_max, room, left)
            if limit >= max(self.state.config.draft_min, 1) and probe:
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

    def _at_least_min(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` without the drafts shorter than ``draft_min`` (none verified instead)."""
        n_min = self.state.config.draft_min
        if not any(0 < entry.draft_tokens < n_min for entry in plan.slots):
            return plan
        return BatchPlan(
            tuple(
                dataclasses.replace(e, draft_tokens=0) if 0 < e.draft_tokens < n_min else e
                for e in plan.slots
            )
        )

    def with_drafts(
        self, strategy: BatchStrategy, views: dict[int, SlotView], plan: BatchPlan, busy: dict[int, Slot]
    ) -> BatchPlan:
        """The strategy's ``plan_drafts`` within what the batch and the free KV cells
        leave (a draft never pushes out a cache, let alone a request)."""
        base = check_plan(plan, views, self.state.backend.n_batch, self.state.config.chunk_size)
        budget = min(self.state.backend.n_batch, self.state.memory.free_cells) - base.num_tokens
        if budget <= 0:
            result = base
        else:
            result = strategy.plan_drafts(list(views.values()), base, budget, self.state.cost.cost())
            if not isinstance(result, BatchPlan):
                raise StrategyError(f"plan_drafts must return a BatchPlan, got {type(result).__name__}")
            if result.num_draft_tokens - base.num_draft_tokens > budget:
                raise StrategyError(
                    f"plan_drafts added {result.num_draft_tokens - base.num_draft_tokens} draft tokens, "
                    f"over its budget of {budget}"
                )
        result = self._at_least_min(result)
        if self.drafter.costly:
            result = self._at_least_min(self._extend_drafts(result, busy))
        planned = {entry.seq_id: entry.draft_tokens for entry in result.slots}
        for seq_id, slot in busy.items():  # a draft the plan passed over: checked next tick
            request = slot.request
            if slot.draft and not planned.get(seq_id) and request is not None:
                slot.shadow = (slot.draft[0], len(request.token_ids), slot.draft_kind)
        return result
