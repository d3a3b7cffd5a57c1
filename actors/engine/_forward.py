"""The forward pass and KV pressure: one ``llama_decode`` over the batch, and what to
do when the KV cells run out (drop idle caches, split the batch, preempt the newest
request, fail only what cannot fit alone).

Runs in the engine's thread only.
"""

from __future__ import annotations

import logging
import time

import telemetry
from actors.contract import DecodeError, EngineError
from actors.engine._batch import Segment
from actors.engine._sampling import Sampling
from actors.engine._slots import Request, Slot, running_choices
from strategies import SlotState

__all__ = ["ForwardPass"]

_log = logging.getLogger("llama_cpp_actors.engine")

_DECODE_OK = 0
_DECODE_NO_KV_SPACE = 1


def _contiguous_runs(segments: list[Segment]) -> list[list[Segment]]:
    runs = [[segments[0]]]
    for segment in segments[1:]:
        if segment.start == runs[-1][-1].end:
            runs[-1].append(segment)
        else:
            runs.append([segment])
    return runs


class ForwardPass(Sampling):
    """Decode, commit and sample a laid-out batch under KV pressure (engine thread only)."""

    def _forward(self, segments: list[Segment], *, purge_allowed: bool) -> None:
        """Decode the rows of ``segments``, then commit and sample them.

        On "no KV space" drop idle slots' cached KV once, then split the batch in
        halves; a single slot that still cannot fit fails alone. Any other error
        fails every active request.
        """
        # A slot failed by an earlier half has no request any more; skip its rows
        # and keep every decode call on a contiguous range of rows.
        live = [s for s in segments if s.slot.request is not None]
        if not live:
            return
        runs = _contiguous_runs(live)
        if len(runs) > 1:
            for run in runs:
                self._forward(run, purge_allowed=purge_allowed)
            return
        start, end = live[0].start, live[-1].end
        t0 = time.perf_counter()
        code = self.backend.rows.decode(start, end)
        elapsed = time.perf_counter() - t0
        self._eval_s += elapsed
        if code == _DECODE_OK:
            if self.drafter is not None and all(segment.decode for segment in live):
                # Decode rows only: a prompt chunk's tokens cost a fraction of a decode
                # row's, and would tilt the line to make draft tokens look cheap.
                self.cost.observe(end - start, elapsed * 1000.0)
            self._commit(live, start)
        elif code == _DECODE_NO_KV_SPACE:
            if any(segment.drafts for segment in live):
                # Drafts are optional: the batch without them first, before any cache
                # or request is given up for room.
                for segment in live:
                    if segment.drafts:
                        segment.end, segment.drafts = segment.start + 1, 0
                self._forward(live, purge_allowed=purge_allowed)
                return
            self._no_kv_space(live, start, end, purge_allowed)
        else:
            error = DecodeError(f"llama_decode failed with code {code}")
            _log.error("%s; failing every active request", error)
            for slot in self.slots:
                if slot.state is not SlotState.IDLE:
                    self._fail(slot, error)

    def _commit(self, segments: list[Segment], start: int) -> None:
        """Record every decoded row in its slot (a prefill chunk sends its ``Progress`` to a
        stream that asked), then sample the rows that asked for logits.

        All rows are recorded first: sampling may end other requests (a choice that
        fails fails its siblings), and the KV a decoded row wrote must be on the books
        before a slot is dropped. A row whose request ended meanwhile is not sampled.
        """
        tokens = self.backend.rows.tokens
        owners: list[Request | None] = []
        for segment in segments:
            slot = segment.slot
            owners.append(slot.request)
            if segment.decode:
                self.memory.computed(slot, [slot.pending])
            else:
                self.memory.computed(slot, tokens[segment.start : segment.end].tolist())
                request = slot.request
                # A Progress for streams that asked; a consumer found gone leaves nothing to sample.
                if request is not None and request.progress and not request.token_ids:
                    self._progress(slot)
        for segment, request in zip(segments, owners, strict=True):
            slot = segment.slot
            if segment.logits_row < 0 or request is None or slot.request is not request:
                continue
            if segment.drafts:
                self._verify(slot, request, segment, start)
                continue
            first = request.t_first_token is None
            self._sample_alone(slot, segment.logits_row - start)
            if first and request.choices is not None and request.index == 0:
                self._fork(slot, request, segment.logits_row - start)

    def _verify(self, slot: Slot, request: Request, segment: Segment, start: int) -> None:
        """Sample the pending token's row, then each draft row while the drafts agree.

        Row ``i``'s token is what the model makes of the pending token and the first
        ``i`` drafts. Sampling it with the request's own sampler, and keeping draft
        ``i + 1`` only when that token equals it, is the speculative-sampling rule for
        a deterministic draft: greedy output is unchanged, and sampled output keeps its
        distribution (with a seed, its very draws: one per token, as without drafts).
        Each token goes through ``_on_token`` (stop strings, ``max_tokens``, EOG), an
        accepted draft's cell goes on the books, and the cells of the rejected drafts
        are dropped before anything else runs.
        """
        drafts, kind = slot.draft[: segment.drafts], slot.draft_kind
        row = segment.logits_row - start
        accepted = 0
        # Counted before a token can end the request: its Completion is built then. A
        # draft is accepted when its row's logits are used for the next token.
        request.draft_tokens += len(drafts)
        try:
            for i in range(len(drafts) + 1):
                token = self._sample_alone(slot, row + i)
                if slot.request is not request or token is None:
                    break  # it ended (its cells are dropped or kept; the drafts go below)
                if i == len(drafts) or token != drafts[i]:
                    break  # the token stays pending: the next tick decodes it
                accepted += 1
                request.draft_accepted += 1
                self.memory.computed(slot, [token])
        finally:
            # Draft cells past what the slot holds: never on the books, dropped now.
            self.backend.kv.trim(slot.seq_id, len(slot.cached))
            self.draft_tokens += len(drafts)
            self.draft_accepted += accepted
            self._drafted_now += len(drafts)
            self._drafts_now += 1
            self._accepted_now += accepted
            if request.acceptance is not None:
                request.acceptance.of(kind).verified(len(drafts), accepted)

    def _sample_alone(self, slot: Slot, row: int) -> int | None:
        """Sample ``row`` for the slot; a sampler that breaks fails its request alone.
        The token sampled, or None when none was."""
        try:
            return self._sample(slot, row)
        except Exception as e:
            _log.exception("sampling failed for %s", slot.request and slot.request.request_id)
            if slot.request is not None:
                self._fail(slot, EngineError(f"sampling failed: {e!r}"))
            return None

    def _occupy(self, slot: Slot, request: Request, n_reuse: int) -> None:
        """``request`` enters ``slot``, which holds ``n_reuse`` of its tokens already."""
        slot.request = request
        slot.state = SlotState.PREFILLING
        self.occupied = True
        request.seq_id = slot.seq_id
        if not request.started:  # a request resumed after a preemption was announced already
            request.started = True
            request.prefix_cache_tokens = n_reuse
            request.t_started = time.monotonic()
            if telemetry.request_start.receivers:
                self._send(
                    telemetry.request_start,
                    {"prompt_tokens": len(request.prompt), "prefix_cache_tokens": n_reuse},
                    {"request_id": request.request_id, "seq_id": slot.seq_id, "mode": request.mode},
                )
        if request.progress and not request.token_ids:
            request.prefill_cached = n_reuse
            self._progress(slot)  # last: a consumer that is gone cancels the request here

    def _fork(self, leader: Slot, request: Request, row: int) -> None:
        """The leader of ``n`` choices sampled its first token: every other choice that a
        slot and the KV cells can take now copies the leader's prompt cells and samples
        the same logits row with its own sampler, so all n start in this tick. The rest
        start later from the queue, copying the prompt from the leader's slot (the leader
        may have ended with its first token: its slot still holds the prompt)."""
        if request.choices is None or leader.cached[: len(request.prompt)] != request.prompt:
            return  # it failed, and its KV went with it
        # Idle slots that waiting requests with no choice running take first (``_next``'s turns).
        group, priority = request.choices, request.message.priority
        reserved = sum(
            1
            for r in self.waiting
            if r.choices is not group
            and r.message.priority <= priority
            and running_choices(r, self.requests) == 0
        )
        for choice in group.requests[1:]:
            if choice.started or choice.key not in self.requests:
                continue
            idle = [s for s in self.slots if s.state is SlotState.IDLE and s is not leader]
            if len(idle) <= reserved or not self._kv_room_for(choice):
                return
            slot = self.memory.fork(leader, choice, idle)
            self.waiting.remove(choice)
            self._occupy(slot, choice, len(choice.prompt))
            self._sample_alone(slot, row)

    def _kv_room_for(self, request: Request) -> bool:
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

    def _no_kv_space(self, live: list[Segment], start: int, end: int, purge_allowed: bool) -> None:
        """``llama_decode`` found no KV cells: purge idle caches, halve, preempt, then fail."""
        # An embedding's long text gives its cells back first (it starts over later).
        if purge_allowed and (self.embedder.give_back() | bool(self._purge_idle())):
            self._forward(live, purge_allowed=False)
            return
        if len(live) > 1:
            self._kv_event("split", {"batch_tokens": end - start})
            mid = len(live) // 2
            self._forward(live[:mid], purge_allowed=False)
            self._forward(live[mid:], purge_allowed=False)
        elif end - start > 1:
            # One slot's prefill chunk: halve it, positions stay contiguous.
            self._kv_event("split", {"batch_tokens": end - start})
            only, mid_row = live[0], start + (end - start) // 2
            self._forward([Segment(only.slot, start, mid_row, -1, False)], purge_allowed=False)
            self._forward([Segment(only.slot, mid_row, end, only.logits_row, False)], purge_allowed=False)
        else:
            stuck = live[0].slot
            others = [s for s in self.slots if s.request is not None and s is not stuck]
            if not others:
                self._fail(stuck, DecodeError("context_full: the request cannot fit the KV cache even alone"))
                return
            # vLLM's answer: free the most recently admitted request and recompute it later;
            # one whose cells are all shared would free none.
            cells = self.memory.cells
            freeing = [s for s in (stuck, *others) if cells.private(s.seq_id) > 0] or [stuck, *others]
            victim = max(freeing, key=lambda s: s.request.arrival if s.request else -1)
            self._preempt(victim)
            if victim is not stuck:
                self._forward(live, purge_allowed=False)

    def _purge_idle(self, need: int | None = None, last: frozenset[int] = frozenset()) -> int:
        """Free idle caches (saved to RAM when on), least recently used first and ``last``'s
        last, until ``need`` cells are free (all when None); how many were purged."""
        purged = self.memory.purge_idle(self.slots, need, last)
        if purged:
            self._kv_event("purge", {"purged_slots": purged})
        return purged

    def _make_room(self, need: int, last: frozenset[int]) -> bool:
        """``_purge_idle`` until ``need`` cells are free (a RAM restore needs that many
        empty); whether they are."""
        self._purge_idle(need, last)
        return self.memory.free_cells >= need

    def _preempt(self, slot: Slot) -> None:
        request = slot.release()
        assert request is not None
        # Its KV goes to the RAM cache (when on) before the cells are freed: when it
        # resumes, its context is restored from there instead of evaluated again.
        self.memory.forget(slot)
        request.context = request.prompt + request.token_ids
        request.seq_id = -1
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        self._kv_event("preempt", {"preempted_tokens": len(request.context)}, request)
