"""A request's way through a slot as its caller and telemetry see it: it enters a slot
(``request_start``, a ``Progress``), and it ends, with a ``Completion``, a ``Done`` or
a ``Failed`` delivered exactly once, its telemetry first, its sampler freed and its slot
released.

Runs in the engine's thread only; stream events go through the courier, which never
blocks it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import telemetry
from actors.contract import Completion, Done, EngineError, Failed, Progress, StopReason, Token, ToolCall
from actors.engine._delivery import courier, settle
from actors.engine._slots import Choices, Request, Slot
from actors.engine._state import EngineState
from strategies import SlotState

__all__ = ["Lifecycle"]

_log = logging.getLogger("llama_cpp_actors.engine")


class Lifecycle:
    """Starting and ending requests: occupy, progress, finish, fail, cancel, deliver
    (engine thread only).

    Args:
        state: the engine's shared state.
    """

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def occupy(self, slot: Slot, request: Request, n_reuse: int) -> None:
        """``request`` enters ``slot``, which holds ``n_reuse`` of its tokens already."""
        slot.request = request
        slot.state = SlotState.PREFILLING
        slot.served_tick = self.state.n_ticks  # its wait for a batch counts from here
        self.state.occupied = True
        request.seq_id = slot.seq_id
        if not request.started:  # a request resumed after a preemption was announced already
            request.started = True
            request.prefix_cache_tokens = n_reuse
            request.t_started = time.monotonic()
            if telemetry.request_start.receivers:
                self.state.send(
                    telemetry.request_start,
                    {"prompt_tokens": len(request.prompt), "prefix_cache_tokens": n_reuse},
                    {"request_id": request.request_id, "seq_id": slot.seq_id, "mode": request.mode},
                )
        if request.progress and not request.token_ids:
            request.prefill_cached = n_reuse
            self.progress(slot)  # last: a consumer that is gone cancels the request here

    def progress(self, slot: Slot) -> bool:
        """Send the slot's prefill progress to its stream (``progress=True`` only); False
        when the consumer is gone and the request was cancelled."""
        request = slot.request
        assert request is not None
        cached = request.prefill_cached
        processed = len(slot.cached)
        elapsed_ms = (time.monotonic() - request.t_started) * 1000.0 if processed > cached else 0.0
        event = Progress(request.request_id, processed, len(request.prompt), cached, elapsed_ms)
        return self.put(request, event)

    def stop_request(self, request: Request, stop_reason: StopReason) -> None:
        if request.seq_id < 0:
            self.state.waiting.remove(request)
            completion = self._close(request, stop_reason)
            if request.started:  # preempted, waiting to resume
                self._emit_done(request, completion.stop_reason)
            self._deliver(request, completion)
        else:
            self.finish(self.state.slots[request.seq_id], stop_reason)

    def put(self, request: Request, event: object) -> bool:
        """Hand a stream event to the courier (it never blocks the engine; a full queue
        holds it); a consumer that is gone cancels the request."""
        assert request.reply_to is not None
        if not courier.send(request.reply_to, event, request.on_stall):
            _log.warning("stream consumer of %s is gone; cancelling", request.request_id)
            request.reply_to = None  # nobody to tell any more
            if request.seq_id >= 0 and self.state.slots[request.seq_id].request is request:
                self.finish(self.state.slots[request.seq_id], "cancelled")
            return False
        return True

    def finish(self, slot: Slot, stop_reason: StopReason) -> None:
        """End the slot's request normally; telemetry first, so observers see it by
        the time the caller does."""
        request = slot.release()
        assert request is not None
        # Positions rewritten by a shift, or a request that keeps nothing for reuse.
        if slot.shifted or not request.message.cache_prompt:
            self.state.memory.drop(slot)
        completion = self._close(request, stop_reason)
        self._emit_done(request, completion.stop_reason)
        self._deliver(request, completion)

    def _emit_done(self, request: Request, stop_reason: StopReason) -> None:
        if telemetry.request_done.receivers:
            metadata = self.state.metadata(request)
            metadata["stop_reason"] = stop_reason
            self.state.send(telemetry.request_done, self._measurements(request), metadata)

    def _close(self, request: Request, stop_reason: StopReason) -> Completion:
        """Forget the request, free its sampler and build its ``Completion``."""
        self._forget(request)
        tail = request.text.flush() if stop_reason != "stop" else ""  # held back, and broken bytes as U+FFFD
        reply = request.reply
        if reply is None:
            if tail:
                request.pieces.append(tail)
                request.last = Token(request.request_id, tail, request.token_ids[-1], index=request.index)
            text, reasoning, calls = "".join(request.pieces), "", tuple[ToolCall, ...]()
        else:
            first, last = reply.feed(tail), reply.finish()
            if (
                first.content
                or last.content
                or first.reasoning
                or last.reasoning
                or first.tool_calls
                or last.tool_calls
            ):
                request.last = Token(
                    request.request_id,
                    first.content + last.content,
                    request.token_ids[-1] if request.token_ids else -1,
                    index=request.index,
                    reasoning=first.reasoning + last.reasoning,
                    tool_calls=first.tool_calls + last.tool_calls,
                )
            text, reasoning, calls = "".join(reply.content), "".join(reply.reasoning), reply.tool_calls
            if request.closed_early and stop_reason == "eog":
                stop_reason = "max_tokens"  # its end was forced: what it wrote was cut short
            elif calls and stop_reason == "eog":
                stop_reason = "tool_calls"
        ttft_ms, duration_ms = self._timings(request)
        return Completion(
            request_id=request.request_id,
            text=text,
            token_ids=tuple(request.token_ids),
            stop_reason=stop_reason,
            prompt_tokens=len(request.prompt),
            generated_tokens=len(request.token_ids),
            prefix_cache_tokens=request.prefix_cache_tokens,
            ttft_ms=ttft_ms,
            duration_ms=duration_ms,
            stop_string=request.stop_string,
            logprobs=tuple(request.logprobs) if request.logprobs is not None else None,
            index=request.index,
            draft_tokens=request.draft_tokens,
            draft_accepted=request.draft_accepted,
            reasoning=reasoning,
            tool_calls=calls,
            slot=request.seq_id,
            context_shifts=request.context_shifts,
        )

    def _forget(self, request: Request) -> None:
        self.state.requests.pop(request.key, None)
        if request.deadline is not None:
            self.state.n_deadlines -= 1
            request.deadline = None
        self.state.backend.sampling.free(request.sampler)
        request.t_finished = time.monotonic()

    def _deliver(self, request: Request, completion: Completion) -> None:
        group = request.choices
        if group is not None:
            group.results[request.index] = completion
            if group.future is not None and not group.failed and all(r is not None for r in group.results):
                self._settle_group(group)
            self._settled(group)
        if request.future is not None:
            settle(request.future, completion)
        elif request.reply_to is not None:
            if request.last is not None and not self.put(request, request.last):
                return
            self.put(request, Done(request.request_id, completion, request.index))

    @staticmethod
    def _settle_group(group: Choices) -> None:
        """Give a group whose every request ended its one outcome."""
        assert group.future is not None
        if group.build is None:
            settle(group.future, tuple(group.results))
            return
        try:
            outcome = group.build(group)
        except EngineError as error:
            settle(group.future, error=error)
            return
        except Exception as e:  # a bug: the request's failure, never the tick's
            _log.exception("building the outcome of %s failed", group.leader.request_id)
            settle(group.future, error=EngineError(f"the request's outcome could not be built: {e!r}"))
            return
        settle(group.future, outcome)

    def _settled(self, group: Choices) -> None:
        """Forget a request's choices once each has its outcome."""
        if all(r.key not in self.state.requests for r in group.requests):
            self.state.choices.pop(group.leader.request_id, None)

    def fail(self, slot: Slot, error: EngineError) -> None:
        """Fail the slot's request and drop its KV (it may be half written)."""
        request = slot.release()
        assert request is not None
        self.state.memory.drop(slot)
        self._forget(request)
        self._emit_exception(request, error)
        self._deliver_error(request, error)

    def _emit_exception(self, request: Request, error: EngineError) -> None:
        if telemetry.request_exception.receivers:
            metadata = self.state.metadata(request)
            metadata["stop_reason"] = "error"
            metadata["reason"] = str(error)
            self.state.send(telemetry.request_exception, self._measurements(request), metadata)

    def _deliver_error(self, request: Request, error: EngineError) -> None:
        group = request.choices
        if group is not None and not group.failed:
            # One choice failed: the request did, so every other choice fails with it.
            group.failed = True
            if group.future is not None:
                settle(group.future, error=error)
            for other in group.requests:
                if other is not request and other.key in self.state.requests:
                    self.fail_request(other, error)
        if group is not None:
            self._settled(group)
        if request.future is not None:
            settle(request.future, error=error)
        elif request.reply_to is not None:
            self.put(request, Failed(request.request_id, error, request.index))

    def fail_request(self, request: Request, error: EngineError) -> None:
        """Fail a request wherever it is: in a slot, or waiting (queued or preempted)."""
        if request.seq_id >= 0:
            self.fail(self.state.slots[request.seq_id], error)
            return
        self.state.waiting.remove(request)
        self._forget(request)
        if request.started:
            self._emit_exception(request, error)
        self._deliver_error(request, error)

    def fail_all(self, error: EngineError) -> None:
        """Fail every running and queued request (engine stopping)."""
        for slot in self.state.slots:
            if slot.state is not SlotState.IDLE:
                self.fail(slot, error)
        while self.state.waiting:  # preempted ones had a start: they get their end
            self.fail_request(self.state.waiting[0], error)
        self.state.embedder.fail_all(error)

    @staticmethod
    def _timings(request: Request) -> tuple[float, float]:
        """``(ttft_ms, duration_ms)`` from admission; ttft is the duration when no token came."""
        duration_ms = (request.t_finished - request.t_admitted) * 1000.0
        if request.t_first_token is None or not request.token_ids:
            return duration_ms, duration_ms
        return (request.t_first_token - request.t_admitted) * 1000.0, duration_ms

    @classmethod
    def _measurements(cls, request: Request) -> dict[str, Any]:
        ttft_ms, duration_ms = cls._timings(request)
        n_prompt, n_cached, n_gen = (
            len(request.prompt),
            request.prefix_cache_tokens,
            len(request.token_ids),
        )
        first = request.t_first_token if request.token_ids else None
        prompt_s = first - request.t_started if first is not None else 0.0
        gen_s = request.t_finished - first if first is not None else 0.0
        return {
            "prompt_tokens": n_prompt,
            "generated_tokens": n_gen,
            "duration_ms": duration_ms,
            "ttft_ms": ttft_ms,
            # Prompt tokens actually evaluated per second of prefill, then tokens after
            # the first per second of decoding; 0.0 where undefined.
            "prompt_eval_rate": (n_prompt - n_cached) / prompt_s if prompt_s > 0 else 0.0,
            "generation_rate": (n_gen - 1) / gen_s if gen_s > 0 and n_gen > 1 else 0.0,
            "prefix_cache_tokens": n_cached,
            "prefix_cache_ratio": n_cached / n_prompt if n_prompt else 0.0,
            "draft_tokens": request.draft_tokens,
            "draft_accepted": request.draft_accepted,
        }
