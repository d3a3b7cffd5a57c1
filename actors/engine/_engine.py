"""The continuous-batching engine: admission, the tick, finishing requests.

An :class:`Engine` is a plain object owned by one thread, the ServerActor's; it never
sends itself messages (the actor schedules ticks). One tick, :meth:`Engine.step`, runs
the phases of LlamaCppEx's server: dequeue waiting requests into free slots, let the
strategy plan the batch, check and lay out the plan, one forward pass, sample, finish,
emit ``tick``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import deque
from typing import Any

import pykka

import telemetry
from actors.backend._faults import faults
from actors.backend._llama import DeadEnd, LlamaBackend, _Chain
from actors.contract._errors import (
    DecodeError,
    EngineError,
    EngineStopped,
    InvalidRequest,
    QueueFull,
    StrategyError,
)
from actors.contract._messages import STREAMING, ReplyTo, RequestMessage, SamplingParams, _CancelExact
from actors.contract._results import Completion, Done, Failed, StopReason, Token, TokenLogprob, TopLogprob
from actors.engine._batch import BatchArrays, Segment, check_plan, lay_out
from actors.engine._delivery import courier, settle
from actors.engine._memory import KVMemory
from actors.engine._output import TextStream
from actors.engine._prepare import MAX_GRAMMAR_MS_PER_TOKEN, Prepared, fit_prompt
from actors.engine._slots import Request, Slot
from strategies import BatchPlan, BatchStrategy, SlotState

__all__ = ["Engine", "EngineConfig"]

_log = logging.getLogger("llama_cpp_actors.engine")

# A grammar over MAX_GRAMMAR_MS_PER_TOKEN for this many tokens in a row fails its request.
_GRAMMAR_STRIKES = 3
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


class EngineConfig:
    """The scheduling options of an engine (checked by ``ServerActor``)."""

    __slots__ = (
        "batch_strategy", "cache_prompt", "chunk_size", "context_shift", "defaults", "max_queue",
        "n_ctx_per_slot", "name", "ram_budget_bytes",
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
    ) -> None:
        self.name = name
        self.chunk_size = chunk_size
        self.max_queue = max_queue
        self.cache_prompt = cache_prompt
        self.batch_strategy = batch_strategy
        self.defaults = defaults
        self.n_ctx_per_slot = n_ctx_per_slot
        self.context_shift = context_shift
        self.ram_budget_bytes = ram_budget_bytes


class Engine:
    """Slots, the wait queue and the tick (engine thread only).

    Args:
        backend: the loaded model and context.
        config: scheduling options.
        sender: what telemetry names as the sender (the actor's ref).
    """

    def __init__(self, backend: LlamaBackend, config: EngineConfig, sender: Any) -> None:
        self.backend = backend
        self.config = config
        self.sender = sender
        self.slots = [Slot(seq_id) for seq_id in range(backend.n_seq_max)]
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._arrays = BatchArrays(backend.tokens, backend.pos, backend.seq_ids, backend.logits)
        self._eval_s = 0.0  # time inside llama_decode this tick
        self.preemptions = 0
        self.n_ticks = 0
        self._n_deadlines = 0  # live requests with a deadline: skip the scan without them
        self.draining = False
        # A sequence's positions stay below this; by default an even share of the
        # KV cells, never past what the model was trained on.
        self.n_ctx_slot = config.n_ctx_per_slot or min(
            backend.n_ctx // len(self.slots), backend.n_ctx_train or backend.n_ctx
        )
        self.memory = KVMemory(backend, config.cache_prompt, config.ram_budget_bytes, self._emit)

    # -- admission -----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """True while a slot is busy or a request waits."""
        return bool(self.waiting) or any(slot.state is not SlotState.IDLE for slot in self.slots)

    def admit(
        self,
        prepared: Prepared,
        future: pykka.ThreadingFuture[object] | None = None,
        reply_to: ReplyTo | None = None,
    ) -> None:
        """Check a prepared request against the model and place it in a slot or the queue.

        The expensive part (tokenizing, the chat template, the grammar) was done by
        :func:`actors.engine._prepare.prepare`, normally in the caller's thread; this checks
        its result and the engine's limits, in time independent of the prompt's text.

        Raises:
            InvalidRequest: it can never run here (nothing is queued).
            QueueFull: every slot is busy and ``max_queue`` requests wait.
            EngineStopped: the engine is draining.
        """
        backend = self.backend
        message = prepared.message
        if self.draining:
            raise EngineStopped("the engine is draining: it takes no new requests")
        if message.request_id in self.requests:
            raise InvalidRequest(f"request_id {message.request_id!r} is already in use")
        if isinstance(message, STREAMING) != (reply_to is not None):
            raise InvalidRequest("internal: reply path does not match the message")
        prompt = list(prepared.prompt)
        if not prompt:
            raise InvalidRequest("prompt tokenizes to nothing")
        if max(prompt) >= backend.n_vocab or min(prompt) < 0:
            bad = next(t for t in prompt if not 0 <= t < backend.n_vocab)
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (n_vocab={backend.n_vocab})")
        prompt = fit_prompt(prompt, message, self.n_ctx_slot)
        bias = dict(message.logit_bias) if message.logit_bias else None
        if bias and max(bias) >= backend.n_vocab:
            raise InvalidRequest(f"logit_bias names token {max(bias)}, outside the vocabulary")
        free = [slot for slot in self.slots if slot.state is SlotState.IDLE]
        if not free and len(self.waiting) >= self.config.max_queue:
            raise QueueFull(f"all {len(self.slots)} slots busy and {len(self.waiting)} requests waiting")
        params = self.config.defaults.merged(message)
        if prepared.grammar is not None:
            params = dataclasses.replace(params, grammar=prepared.grammar)
        sampler = backend.make_sampler(params, bias, prompt)
        self._arrivals += 1
        request = Request(message, prompt, params, self._arrivals, sampler, future, reply_to)
        request.text = TextStream(message.stop or (), message.min_tokens)
        if message.logprobs is not None:
            request.logprobs = []
        if reply_to is not None:
            request.on_stall = functools.partial(self._stalled, message)
        self.requests[request.request_id] = request
        if message.deadline_s is not None:
            request.deadline = request.t_admitted + message.deadline_s
            self._n_deadlines += 1
        if free and not self.waiting:
            self._start(request, free)
        else:
            self._enqueue(request)

    def _stalled(self, message: RequestMessage) -> None:
        """A stream's consumer stopped reading: cancel it (the courier's thread)."""
        _log.warning("the consumer of stream %s stopped reading; cancelling it", message.request_id)
        with contextlib.suppress(pykka.ActorDeadError):
            self.sender.tell(_CancelExact(message.request_id, message))

    def _enqueue(self, request: Request) -> None:
        """Lower ``priority`` first, first come first served within a priority."""
        key = request.message.priority
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].message.priority > key:
            index -= 1
        self.waiting.insert(index, request)

    def _start(self, request: Request, idle: list[Slot]) -> None:
        """Give ``request`` an idle slot, reusing the longest cached prefix."""
        slot, n_reuse = self.memory.claim(request, idle, self._purge_idle)
        slot.request = request
        slot.state = SlotState.PREFILLING
        request.seq_id = slot.seq_id
        if request.started:  # resumed after a preemption: already announced
            return
        request.started = True
        request.prefix_cache_tokens = n_reuse
        request.t_started = time.monotonic()
        if telemetry.request_start.receivers:
            self._send(
                telemetry.request_start,
                {"prompt_tokens": len(request.prompt), "prefix_cache_tokens": n_reuse},
                {"request_id": request.request_id, "seq_id": slot.seq_id, "mode": request.mode},
            )

    def cancel(self, request_id: str, message: object = None) -> None:
        """Cancel a queued or running request; an unknown id is ignored, and so is a
        request not admitted from ``message`` when one is given."""
        request = self.requests.get(request_id)
        if request is None or (message is not None and request.message is not message):
            return
        self._stop_request(request, "cancelled")

    # -- the tick ------------------------------------------------------------------

    def step(self) -> None:
        """One tick: dequeue, plan, one forward pass, sample and finish."""
        self.n_ticks += 1
        if faults.tick is not None:
            faults.tick(self.n_ticks)
        if self._n_deadlines:
            self._expire()
        self._dequeue()
        busy = {slot.seq_id: slot for slot in self.slots if slot.state is not SlotState.IDLE}
        if not busy:
            return
        plan = self._plan(busy)
        if plan is None:
            return
        segments = lay_out(plan, busy, self._arrays)
        n_tokens = segments[-1].end if segments else 0
        self._eval_s = 0.0
        self._forward(segments, purge_allowed=True)
        eval_ms = self._eval_s * 1000.0
        if telemetry.tick.receivers:
            n_decode = sum(1 for s in segments if s.decode)
            self._send(
                telemetry.tick,
                {
                    "batch_size": n_tokens,
                    "decode_tokens": n_decode,
                    "prefill_tokens": n_tokens - n_decode,
                    "active_slots": sum(1 for s in self.slots if s.state is not SlotState.IDLE),
                    "queue_depth": len(self.waiting),
                    "eval_ms": eval_ms,
                    **self._kv_use(),
                },
                {"slots": tuple(self._slot_sample(slot) for slot in self.slots)},
            )

    def _expire(self) -> None:
        """End every request past its ``deadline_s``, queued or running: ``"timeout"``."""
        now = time.monotonic()
        for request in [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]:
            self._stop_request(request, "timeout")

    def _stop_request(self, request: Request, stop_reason: StopReason) -> None:
        if request.seq_id < 0:
            self.waiting.remove(request)
            completion = self._close(request, stop_reason)
            if request.started:  # preempted, waiting to resume
                self._emit_done(request, stop_reason)
            self._deliver(request, completion)
        else:
            self._finish(self.slots[request.seq_id], stop_reason)

    def _dequeue(self) -> None:
        while self.waiting:
            idle = [slot for slot in self.slots if slot.state is SlotState.IDLE]
            if not idle or not self._kv_room_for(self.waiting[0]):
                return
            self._start(self.waiting.popleft(), idle)

    def _kv_room_for(self, request: Request) -> bool:
        """Admit only what the KV cells can hold beside the running requests' next tokens.

        Without this a preempted request would take its slot back at once, find no
        room for its prefill and push another request out: thrashing. Idle caches do
        not count: they are dropped on demand.
        """
        busy = [slot for slot in self.slots if slot.request is not None]
        if not busy:
            return True
        # A prefilling slot will soon hold its whole context.
        used = sum(max(len(slot.cached), len(slot.request.context)) for slot in busy if slot.request)
        return used + len(busy) + len(request.context) <= self.backend.n_ctx

    def _plan(self, busy: dict[int, Slot]) -> BatchPlan | None:
        views = {seq_id: slot.view() for seq_id, slot in busy.items()}
        try:
            plan = self.config.batch_strategy.build_batch(
                list(views.values()),
                self.backend.n_batch,
                self.config.chunk_size,
                queue_depth=len(self.waiting),
            )
            return check_plan(plan, views, self.backend.n_batch, self.config.chunk_size)
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
        code = self.backend.decode(start, end)
        self._eval_s += time.perf_counter() - t0
        if code == _DECODE_OK:
            self._commit(live, start)
        elif code == _DECODE_NO_KV_SPACE:
            self._no_kv_space(live, start, end, purge_allowed)
        else:
            error = DecodeError(f"llama_decode failed with code {code}")
            _log.error("%s; failing every active request", error)
            for slot in self.slots:
                if slot.state is not SlotState.IDLE:
                    self._fail(slot, error)

    def _purge_idle(self) -> bool:
        """Free the KV of every idle slot (saved to RAM when on); True if any was freed."""
        purged = self.memory.purge_idle(self.slots)
        if purged:
            self._kv_event("purge", {"purged_slots": purged})
        return purged > 0

    def _no_kv_space(self, live: list[Segment], start: int, end: int, purge_allowed: bool) -> None:
        """``llama_decode`` found no KV cells: purge idle caches, halve, preempt, then fail."""
        if purge_allowed and self._purge_idle():
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
            # vLLM's answer: free the most recently admitted request and recompute it later.
            victim = max([stuck, *others], key=lambda s: s.request.arrival if s.request else -1)
            self._preempt(victim)
            if victim is not stuck:
                self._forward(live, purge_allowed=False)

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

    def _kv_use(self) -> dict[str, int]:
        """KV cells holding tokens and KV cells in all, as GetStats and the signals say."""
        return {
            "kv_cells_used": sum(len(slot.cached) for slot in self.slots),
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

    def _commit(self, segments: list[Segment], start: int) -> None:
        """Record decoded rows in their slots, then sample the rows that asked for logits."""
        tokens = self.backend.tokens
        for segment in segments:
            slot = segment.slot
            if segment.decode:
                slot.cached.append(slot.pending)
            else:
                slot.cached.extend(tokens[segment.start : segment.end].tolist())
            if segment.logits_row >= 0:
                try:
                    self._sample(slot, segment.logits_row - start)
                except Exception as e:  # one request's sampler broke: fail it alone
                    _log.exception("sampling failed for %s", slot.request and slot.request.request_id)
                    if slot.request is not None:
                        self._fail(slot, EngineError(f"sampling failed: {e!r}"))

    def _sample(self, slot: Slot, index: int) -> None:
        request = slot.request
        assert request is not None
        message = request.message
        log_softmax = None
        if request.logprobs is not None:  # from the raw logits, before any ban or bias
            log_softmax, top = self.backend.logprobs(index, message.logprobs or 0)
        ban_eog = message.ignore_eos or len(request.token_ids) < message.min_tokens
        try:
            token = self.backend.sample(request.sampler, index, ban_eog=ban_eog)
        except DeadEnd as dead_end:
            if dead_end.eog_allowed:  # only the end is allowed: min_tokens/ignore_eos yield
                self._finish(slot, "eog")
            else:
                self._fail(
                    slot,
                    InvalidRequest(
                        "no token is allowed here: the grammar and logit_bias leave nothing to sample"
                    ),
                )
            return
        if self._too_costly(request):
            self._fail(
                slot,
                InvalidRequest(
                    f"the grammar costs over {MAX_GRAMMAR_MS_PER_TOKEN:.0f} ms per token, which would "
                    "slow every other request; simplify it"
                ),
            )
            return
        logprob = None
        if log_softmax is not None and token not in self.backend.eog_ids:
            piece = self.backend.piece
            logprob = TokenLogprob(
                token,
                piece(token).decode("utf-8", "replace"),
                float(log_softmax[token]),
                tuple(TopLogprob(t, piece(t).decode("utf-8", "replace"), lp) for t, lp in top),
            )
        self._on_token(slot, token, logprob)

    @staticmethod
    def _too_costly(request: Request) -> bool:
        """The request's grammar took over the limit for several tokens in a row."""
        sampler = request.sampler
        if not isinstance(sampler, _Chain) or not sampler.has_grammar:
            return False
        if sampler.grammar_ms <= MAX_GRAMMAR_MS_PER_TOKEN:
            request.grammar_strikes = 0
            return False
        request.grammar_strikes += 1
        return request.grammar_strikes >= _GRAMMAR_STRIKES

    def _on_token(self, slot: Slot, token: int, logprob: TokenLogprob | None) -> None:
        request = slot.request
        assert request is not None
        now = time.monotonic()
        if request.t_first_token is None:
            request.t_first_token = now
        slot.state = SlotState.GENERATING
        if token in self.backend.eog_ids:
            self._finish(slot, "eog")
            return
        request.token_ids.append(token)
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        text, stop = request.text.push(self.backend.piece(token))
        request.pieces.append(text)
        event = Token(request.request_id, text, token, logprob)
        if request.reply_to is not None and not self._put(request, event):
            return
        if stop is not None:
            request.stop_string = stop
            self._finish(slot, "stop")
        elif len(request.token_ids) >= request.message.max_tokens:
            self._finish(slot, "max_tokens")
        elif len(slot.cached) + 1 >= self.n_ctx_slot and not self._shift(slot):
            self._finish(slot, "length")
        else:
            slot.pending = token

    def _shift(self, slot: Slot) -> bool:
        """Make room for the next token: keep ``n_keep``, drop half the rest (llama.cpp's rule)."""
        if not (self.config.context_shift and self.backend.can_shift):
            return False
        request = slot.request
        assert request is not None
        n_past = len(slot.cached)
        n_keep = min(request.message.n_keep, n_past - 2)
        n_discard = (n_past - n_keep) // 2
        self.backend.seq_shift(slot.seq_id, n_keep, n_discard, n_past)
        del slot.cached[n_keep : n_keep + n_discard]
        slot.shifted = True
        self._kv_event("context_shift", {"discarded_tokens": n_discard}, request)
        return True

    # -- finishing -----------------------------------------------------------------

    def _put(self, request: Request, event: object) -> bool:
        """Hand a stream event to the courier (it never blocks the engine; a full queue
        holds it); a consumer that is gone cancels the request."""
        assert request.reply_to is not None
        if not courier.send(request.reply_to, event, request.on_stall):
            _log.warning("stream consumer of %s is gone; cancelling", request.request_id)
            request.reply_to = None  # nobody to tell any more
            if request.seq_id >= 0 and self.slots[request.seq_id].request is request:
                self._finish(self.slots[request.seq_id], "cancelled")
            return False
        return True

    def _finish(self, slot: Slot, stop_reason: StopReason) -> None:
        """End the slot's request normally; telemetry first, so observers see it by
        the time the caller does."""
        request = slot.release()
        assert request is not None
        if slot.shifted:  # its positions were rewritten: no later prompt may reuse it
            self.memory.drop(slot)
        completion = self._close(request, stop_reason)
        self._emit_done(request, stop_reason)
        self._deliver(request, completion)

    def _emit_done(self, request: Request, stop_reason: StopReason) -> None:
        if telemetry.request_done.receivers:
            metadata = self._metadata(request)
            metadata["stop_reason"] = stop_reason
            self._send(telemetry.request_done, self._measurements(request), metadata)

    def _close(self, request: Request, stop_reason: StopReason) -> Completion:
        """Forget the request, free its sampler and build its ``Completion``."""
        self._forget(request)
        if stop_reason != "stop":  # held-back text, and broken bytes as U+FFFD
            tail = request.text.flush()
            if tail:
                request.pieces.append(tail)
        ttft_ms, duration_ms = self._timings(request)
        return Completion(
            request_id=request.request_id,
            text="".join(request.pieces),
            token_ids=tuple(request.token_ids),
            stop_reason=stop_reason,
            prompt_tokens=len(request.prompt),
            generated_tokens=len(request.token_ids),
            prefix_cache_tokens=request.prefix_cache_tokens,
            ttft_ms=ttft_ms,
            duration_ms=duration_ms,
            stop_string=request.stop_string,
            logprobs=tuple(request.logprobs) if request.logprobs is not None else None,
        )

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if request.deadline is not None:
            self._n_deadlines -= 1
            request.deadline = None
        self.backend.free_sampler(request.sampler)
        request.t_finished = time.monotonic()

    def _deliver(self, request: Request, completion: Completion) -> None:
        if request.future is not None:
            settle(request.future, completion)
        elif request.reply_to is not None:
            flushed = len(request.pieces) > len(request.token_ids)
            if flushed and not self._put(
                request, Token(request.request_id, request.pieces[-1], request.token_ids[-1])
            ):
                return
            self._put(request, Done(request.request_id, completion))

    def _fail(self, slot: Slot, error: EngineError) -> None:
        """Fail the slot's request and drop its KV (it may be half written)."""
        request = slot.release()
        assert request is not None
        self.memory.drop(slot)
        self._forget(request)
        self._emit_exception(request, error)
        self._deliver_error(request, error)

    def _emit_exception(self, request: Request, error: EngineError) -> None:
        if telemetry.request_exception.receivers:
            metadata = self._metadata(request)
            metadata["stop_reason"] = "error"
            metadata["reason"] = str(error)
            self._send(telemetry.request_exception, self._measurements(request), metadata)

    def _deliver_error(self, request: Request, error: EngineError) -> None:
        if request.future is not None:
            settle(request.future, error=error)
        elif request.reply_to is not None:
            self._put(request, Failed(request.request_id, error))

    def fail_all(self, error: EngineError) -> None:
        """Fail every running and queued request (engine stopping)."""
        for slot in self.slots:
            if slot.state is not SlotState.IDLE:
                self._fail(slot, error)
        while self.waiting:
            request = self.waiting.popleft()
            self._forget(request)
            if request.started:  # preempted: it had a start, it gets its end
                self._emit_exception(request, error)
            self._deliver_error(request, error)

    # -- telemetry and introspection ---------------------------------------------

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

    @staticmethod
    def _metadata(request: Request) -> dict[str, Any]:
        return {"request_id": request.request_id, "seq_id": request.seq_id, "mode": request.mode}

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
        }

    def stats(self) -> dict[str, int]:
        """The engine's load, as ``GetStats`` returns it."""
        ram = self.memory.ram
        states = [slot.state for slot in self.slots]
        return {
            "active_slots": sum(1 for s in states if s is not SlotState.IDLE),
            "idle_slots": sum(1 for s in states if s is SlotState.IDLE),
            "prefilling_slots": sum(1 for s in states if s is SlotState.PREFILLING),
            "generating_slots": sum(1 for s in states if s is SlotState.GENERATING),
            "queue_depth": len(self.waiting),
            "n_parallel": len(self.slots),
            "n_batch": self.backend.n_batch,
            "n_ctx": self.backend.n_ctx,
            "n_ctx_per_slot": self.n_ctx_slot,
            **self._kv_use(),
            "ram_cache_entries": len(ram.entries) if ram else 0,
            "ram_cache_bytes": ram.bytes_used if ram else 0,
            "preemptions": self.preemptions,
        }
