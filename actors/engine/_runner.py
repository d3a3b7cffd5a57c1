"""The runner: a checked plan laid out in the batch, one ``llama_decode``, and what to do
when the KV cells run out (drop idle caches, split the batch, preempt the newest
request, fail only what cannot fit alone). Each range of rows that decodes goes to the
output stage at once, before another decode overwrites its logits.

Runs in the engine's thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actors.contract import DecodeError, EngineError
from actors.engine._batch import Segment, lay_out
from actors.engine._lifecycle import Lifecycle
from actors.engine._slots import Slot
from actors.engine._state import EngineState
from strategies import BatchPlan, SlotState

__all__ = ["Runner"]

_log = logging.getLogger("llama_cpp_actors.engine")

_DECODE_OK = 0
_DECODE_NO_KV_SPACE = 1

Commit = Callable[[list[Segment], int], None]
"""What receives decoded rows: the segments, and the batch row their range starts at."""


def _contiguous_runs(segments: list[Segment]) -> list[list[Segment]]:
    runs = [[segments[0]]]
    for segment in segments[1:]:
        if segment.start == runs[-1][-1].end:
            runs[-1].append(segment)
        else:
            runs.append([segment])
    return runs


class Runner:
    """Lay out and decode a plan under KV pressure (engine thread only).

    Args:
        state: the engine's shared state.
        lifecycle: fails the requests a decode cannot serve.
        commit: the output stage, handed each range of rows that decoded.
    """

    def __init__(self, state: EngineState, lifecycle: Lifecycle, commit: Commit) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.commit = commit

    def execute(self, plan: BatchPlan, busy: dict[int, Slot]) -> list[Segment]:
        """Write ``plan`` into the batch and decode it with its slots' LoRA adapter set
        (one set: ``Scheduler.schedule`` planned only its slots); the segments it laid out."""
        segments = lay_out(plan, busy, self.state.arrays)
        request = segments[0].slot.request if segments else None
        if request is not None:
            try:
                self.state.use_adapters(request.adapters)
            except EngineError as e:
                _log.error("%s; failing the batch's requests", e)
                for segment in segments:
                    self.lifecycle.fail(segment.slot, e)
                return []
        self._forward(segments, purge_allowed=True)
        return segments

    def _forward(self, segments: list[Segment], *, purge_allowed: bool) -> None:
        """Decode the rows of ``segments``, then hand them to the output stage.

        On "no KV space" drop idle slots' cached KV once, then split the batch in
        halves; a single slot that still cannot fit fails alone. Any other error
        fails every active request.
        """
        state = self.state
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
        code = state.backend.rows.decode(start, end)
        elapsed = time.perf_counter() - t0
        state.now.eval_s += elapsed
        if code == _DECODE_OK:
            if state.drafter is not None and all(segment.decode for segment in live):
                # Decode rows only: a prompt chunk's tokens cost a fraction of a decode
                # row's, and would tilt the line to make draft tokens look cheap.
                state.cost.observe(end - start, elapsed * 1000.0)
            self.commit(live, start)
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
            for slot in state.slots:
                if slot.state is not SlotState.IDLE:
                    self.lifecycle.fail(slot, error)

    def _no_kv_space(self, live: list[Segment], start: int, end: int, purge_allowed: bool) -> None:
        """``llama_decode`` found no KV cells: purge idle caches, halve, preempt, then fail."""
        state = self.state
        # An embedding's long text gives its cells back first (it starts over later).
        if purge_allowed and (state.embedder.give_back() | bool(state.purge_idle())):
            self._forward(live, purge_allowed=False)
            return
        if len(live) > 1:
            state.kv_event("split", {"batch_tokens": end - start})
            mid = len(live) // 2
            self._forward(live[:mid], purge_allowed=False)
            self._forward(live[mid:], purge_allowed=False)
        elif end - start > 1:
            # One slot's prefill chunk: halve it, positions stay contiguous.
            state.kv_event("split", {"batch_tokens": end - start})
            only, mid_row = live[0], start + (end - start) // 2
            self._forward([Segment(only.slot, start, mid_row, -1, False)], purge_allowed=False)
            self._forward([Segment(only.slot, mid_row, end, only.logits_row, False)], purge_allowed=False)
        else:
            stuck = live[0].slot
            others = [s for s in state.slots if s.request is not None and s is not stuck]
            if not others:
                error = DecodeError("context_full: the request cannot fit the KV cache even alone")
                self.lifecycle.fail(stuck, error)
                return
            # vLLM's answer: free the most recently admitted request and recompute it later;
            # one whose cells are all shared would free none.
            cells = state.memory.cells
            freeing = [s for s in (stuck, *others) if cells.private(s.seq_id) > 0] or [stuck, *others]
            victim = max(freeing, key=lambda s: s.request.arrival if s.request else -1)
            self._preempt(victim)
            if victim is not stuck:
                self._forward(live, purge_allowed=False)

    def _preempt(self, slot: Slot) -> None:
        state = self.state
        request = slot.release()
        assert request is not None
        # Its KV goes to the RAM cache (when on) before the cells are freed: when it
        # resumes, its context is restored from there instead of evaluated again.
        state.memory.forget(slot)
        request.context = request.prompt + request.token_ids
        request.seq_id = -1
        request.preemptions += 1
        state.preemptions += 1
        state.waiting.appendleft(request)
        state.kv_event("preempt", {"preempted_tokens": len(request.context)}, request)
