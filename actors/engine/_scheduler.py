"""The scheduler: admission, the wait queue by priority, deadlines, KV room, and the
strategy's plan.

A prepared request is placed in an idle slot (reusing the longest cached prefix) or in
the wait queue; waiting requests enter slots as slots and KV cells free up; each tick
the strategy plans the batch over the busy slots' views, and the plan is checked
before anything reaches llama.cpp. The scheduler returns plain data (a
``BatchPlan``); the runner executes it.

Runs in the engine's thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import pykka

from actors.chat import ReplySpec
from actors.contract import (
    STREAMING,
    EngineStopped,
    InvalidRequest,
    QueueFull,
    ReplyTo,
    RequestMessage,
    SamplingParams,
    StrategyError,
)
from actors.engine._batch import check_plan
from actors.engine._decisions import PreparedDecision, decision_of, flat_reads
from actors.engine._drafting import DraftPlanner
from actors.engine._embedding import PreparedEmbed
from actors.engine._lifecycle import Lifecycle
from actors.engine._output import TextStream
from actors.engine._prepare import Prepared
from actors.engine._slots import Choices, Request, Slot, running_choices
from actors.engine._speculative import Acceptances
from actors.engine._state import EngineState
from strategies import BatchPlan, BatchStrategy

__all__ = ["Scheduler", "Stall"]

_log = logging.getLogger("llama_cpp_actors.engine")

_SEEDS = 2**32 - 1  # seeds are 0 .. 2**32 - 2 (2**32 - 1 asks llama.cpp for a random one)

Stall = Callable[[RequestMessage], None]
"""Told that a stream's consumer stopped reading; runs in the courier's thread, so it
may not touch the engine (the actor tells itself to cancel the request)."""


class Scheduler:
    """Admit, queue, start, cancel, expire, and plan the batch (engine thread only).

    Args:
        state: the engine's shared state.
        lifecycle: starts and ends requests.
        drafts: the drafts' side of the plan, when the engine speculates.
        on_stall: told when a stream's consumer stops reading.
    """

    def __init__(
        self, state: EngineState, lifecycle: Lifecycle, drafts: DraftPlanner | None, on_stall: Stall
    ) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.drafts = drafts
        self.on_stall = on_stall

    def admit(
        self,
        prepared: Prepared,
        future: pykka.ThreadingFuture[object] | None = None,
        reply_to: ReplyTo | None = None,
    ) -> None:
        """Check a prepared request against the model and place it in a slot or the queue.

        Everything about the request itself (tokens, length, grammar, ``logit_bias``)
        was checked by :func:`actors.engine._prepare.prepare`, normally in the caller's
        thread; this checks only the engine's state (ids in use, draining, the queue),
        in time independent of the prompt's text.

        Raises:
            InvalidRequest: it can never run here (nothing is queued).
            QueueFull: every slot is busy and ``max_queue`` requests wait.
            EngineStopped: the engine is draining.
        """
        message = prepared.message
        if isinstance(message, STREAMING) != (reply_to is not None):
            raise InvalidRequest("internal: reply path does not match the message")
        self._admissible(message.request_id, message.n, prepared.limit)
        state = self.state
        params = state.config.defaults.merged(message)
        if prepared.grammar is not None:
            params = dataclasses.replace(params, grammar=prepared.grammar)
        state.arrivals += 1
        requests = [self._request(prepared, params, i, future, reply_to) for i in range(message.n)]
        if message.n > 1:
            self._group(requests, Choices(requests, future, [None] * message.n))
        self._place(requests)

    def admit_decision(self, prepared: PreparedDecision, future: pykka.ThreadingFuture[object]) -> None:
        """Place a prepared ``Decide``'s requests (its leader, then one per question) in
        slots or the queue, as one group whose outcome is the ``Decision``.

        Raises:
            InvalidRequest, QueueFull, EngineStopped: as :meth:`admit`.
        """
        parts = ([prepared.leader] if prepared.leader is not None else []) + list(prepared.questions)
        reads = ([()] if prepared.leader is not None else []) + [flat_reads(r) for r in prepared.reads]
        self._admissible(prepared.message.request_id, len(parts), prepared.limit)
        self.state.arrivals += 1
        requests = []
        for index, (part, labels) in enumerate(zip(parts, reads, strict=True)):
            request = self._request(part, self.state.config.defaults.merged(part.message), index, None, None)
            request.reads = labels
            requests.append(request)
        build = functools.partial(decision_of, prepared)
        self._group(requests, Choices(requests, future, [None] * len(requests), build=build))
        self._place(requests)

    def _admissible(self, request_id: str, n: int, limit: int) -> None:
        """Refuse what the engine's state rules out for ``n`` requests under one id."""
        state = self.state
        if state.draining:
            raise EngineStopped("the engine is draining: it takes no new requests")
        keys = [request_id, *(f"{request_id}#{i}" for i in range(1, n))]
        if request_id in state.choices or any(key in state.requests for key in keys):
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if limit != state.n_ctx_slot:
            raise InvalidRequest("internal: the request was prepared for another context")
        free = state.idle()
        max_queue = state.config.max_queue
        if len(state.waiting) + max(0, n - len(free)) > max_queue or (
            not free and len(state.waiting) >= max_queue
        ):
            raise QueueFull(f"all {len(state.slots)} slots busy and {len(state.waiting)} requests waiting")

    def _group(self, requests: list[Request], group: Choices) -> None:
        """The requests answer as one: one future (the group's), one outcome."""
        self.state.choices[group.leader.request_id] = group
        for request in requests:
            request.choices, request.future = group, None

    def _place(self, requests: list[Request]) -> None:
        """The first request enters an idle slot or the queue; the rest queue behind it
        (they copy its prompt once it is computed)."""
        state, leader = self.state, requests[0]
        free = state.idle()
        if free and not state.waiting and not state.memory.worth_waiting(leader, state.slots):
            self._start(leader, free)
        else:
            self._enqueue(leader)
        for request in requests[1:]:
            self._enqueue(request)

    def admit_embed(self, prepared: PreparedEmbed, future: pykka.ThreadingFuture[object]) -> None:
        """Queue a prepared ``Embed`` for the next embedding pass; ``future`` gets its
        ``Embeddings`` or its error.

        Raises:
            InvalidRequest: its id is in use, or a token is outside the vocabulary.
            QueueFull: ``max_queue`` embedding requests wait.
            EngineStopped: the engine is draining.
        """
        if self.state.draining:
            raise EngineStopped("the engine is draining: it takes no new requests")
        request_id = prepared.message.request_id
        if request_id in self.state.requests or request_id in self.state.choices:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        self.state.embedder.admit(prepared, future)

    def _request(
        self,
        prepared: Prepared,
        params: SamplingParams,
        index: int,
        future: pykka.ThreadingFuture[object] | None,
        reply_to: ReplyTo | None,
    ) -> Request:
        """Choice ``index`` of an admitted request: its own sampler (seed + index), in the table."""
        message, prompt = prepared.message, list(prepared.prompt)
        bias = dict(message.logit_bias) if message.logit_bias else None
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % _SEEDS)
        sampler = self.state.backend.sampling.make(params, bias, prompt, prepared.triggers)
        arrival = self.state.arrivals
        request = Request(message, prompt, params, arrival, sampler, future, reply_to, index=index)
        request.adapters = self.state.default_adapters() if prepared.adapters is None else prepared.adapters
        request.text = TextStream(message.stop or (), message.min_tokens)
        if prepared.reply is not None:
            request.reply = prepared.reply.parser()
            request.shown = self._shown(prepared.reply)
            request.budget, request.budget_tokens = prepared.budget, prepared.budget_tokens
            request.call_after_thinking = prepared.call_after_thinking
        if message.logprobs is not None:
            request.logprobs = []
        if self.state.drafter is not None and message.speculate:
            request.acceptance = Acceptances()
        if reply_to is not None:
            request.on_stall = functools.partial(self._stalled, message)
            request.progress = getattr(message, "progress", False) and index == 0
        self.state.requests[request.key] = request
        if message.deadline_s is not None:
            request.deadline = request.t_admitted + message.deadline_s
            self.state.n_deadlines += 1
        return request

    def _shown(self, reply: ReplySpec) -> frozenset[int]:
        """The special tokens that spell one of the reply's markers: their text is shown
        to the parser (a special token's text is otherwise empty)."""
        tokens = (self.state.backend.vocab.special_token(word) for word in reply.markers)
        return frozenset(t for t in tokens if t is not None)

    def _stalled(self, message: RequestMessage) -> None:
        """A stream's consumer stopped reading: the engine's ``on_stall`` cancels it (the
        courier's thread, which may not touch the engine)."""
        _log.warning("the consumer of stream %s stopped reading; cancelling it", message.request_id)
        self.on_stall(message)

    def _enqueue(self, request: Request) -> None:
        """Lower ``priority`` first, first come first served within a priority."""
        key = request.message.priority
        index = len(self.state.waiting)
        while index > 0 and self.state.waiting[index - 1].message.priority > key:
            index -= 1
        self.state.waiting.insert(index, request)

    def _start(self, request: Request, idle: list[Slot]) -> None:
        """Give ``request`` an idle slot, reusing the longest cached prefix."""
        slot, n_reuse = self.state.memory.claim(request, idle, self.state.make_room)
        self.lifecycle.occupy(slot, request, n_reuse)

    def cancel(self, request_id: str, message: object = None) -> None:
        """Cancel a queued or running request; an unknown id is ignored, and so is a
        request not admitted from ``message`` when one is given."""
        if self.state.embedder.queue and self.state.embedder.cancel(request_id, message):
            return
        group = self.state.choices.get(request_id)
        requests = group.requests if group is not None else [self.state.requests.get(request_id)]
        for request in requests:
            if request is None or (message is not None and request.message is not message):
                return
            if request.key in self.state.requests:
                self.lifecycle.stop_request(request, "cancelled")

    def expire(self) -> None:
        """End every request past its ``deadline_s``, queued or running: ``"timeout"``."""
        now = time.monotonic()
        due = [r for r in self.state.requests.values() if r.deadline is not None and r.deadline <= now]
        for request in due:
            self.lifecycle.stop_request(request, "timeout")

    def dequeue(self) -> None:
        """Waiting requests enter idle slots while the KV cells have room (see ``_next``)."""
        while self.state.waiting:
            idle = self.state.idle()
            if not idle:
                return
            request = self._next(idle)
            if request is None or not self.state.kv_room_for(request):
                return
            self.state.waiting.remove(request)
            self._start(request, idle)

    def _next(self, idle: list[Slot]) -> Request | None:
        """The waiting request to start: of the top priority, the first of those whose
        request has the fewest choices in the slots (so the choices of an ``n`` > 1
        request take turns with other requests, instead of holding every slot until they
        are all done), except that one of a session an idle slot served goes first
        (LlamaCppEx's ``dequeue_session_matches``), and one whose prefix a slot is
        prefilling now waits for it (``worth_waiting``)."""
        sessions = {(slot.scope, slot.session) for slot in idle if slot.session is not None}
        priority = self.state.waiting[0].message.priority
        chosen, fewest = None, 0
        for request in self.state.waiting:
            if request.message.priority != priority:
                break
            if self._follows(request) or self.state.memory.worth_waiting(request, self.state.slots):
                continue
            if request.session is not None and (request.scope, request.session) in sessions:
                return request
            running = running_choices(request, self.state.requests)
            if chosen is None or running < fewest:
                chosen, fewest = request, running
                if fewest == 0 and not sessions:
                    break
        return chosen

    def _one_set(self, strategy: BatchStrategy, busy: dict[int, Slot]) -> dict[int, Slot]:
        """The busy slots of the one adapter set the strategy chose for this tick.

        Raises:
            StrategyError: it chose a set no busy slot runs.
        """
        state = self.state
        views = [slot.view(state.n_ticks) for slot in busy.values()]
        chosen = strategy.choose_adapters(views, current=state.adapters_served, streak=state.adapter_streak)
        mine = {view.seq_id: busy[view.seq_id] for view in views if view.adapters == chosen}
        if not mine:
            raise StrategyError(f"choose_adapters chose {chosen!r}, an adapter set no busy slot runs")
        return mine

    def _follows(self, request: Request) -> bool:
        """A choice i > 0 waits while its leader has not sampled (then ``_fork`` copies it)."""
        group = request.choices
        if group is None or request.index == 0:
            return False
        leader = group.leader
        return leader.t_first_token is None and leader.key in self.state.requests

    def schedule(self, busy: dict[int, Slot]) -> BatchPlan | None:
        """This tick's plan over the ``busy`` slots: the LoRA adapter set it serves (the
        strategy's ``choose_adapters``, when the slots run more than one), their drafts,
        the strategy's ``build_batch`` (and ``plan_drafts``) over that set's slots,
        checked by ``check_plan``; None when the strategy failed (and every busy slot's
        request with it)."""
        state = self.state
        n_batch, chunk_size = state.backend.n_batch, state.config.chunk_size
        strategy = state.config.batch_strategy
        try:
            if len({slot.request.adapters for slot in busy.values() if slot.request is not None}) > 1:
                busy = self._one_set(strategy, busy)
            if self.drafts is not None:
                self.drafts.propose(busy)
            views = {seq_id: slot.view(state.n_ticks) for seq_id, slot in busy.items()}
            depth = len(state.waiting)
            plan = strategy.build_batch(list(views.values()), n_batch, chunk_size, queue_depth=depth)
            if (
                self.drafts is not None
                and isinstance(plan, BatchPlan)
                and any(view.draft_tokens for view in views.values())
            ):
                plan = self.drafts.with_drafts(strategy, views, plan, busy)
            checked = check_plan(plan, views, n_batch, chunk_size)
            for entry in checked.slots:
                busy[entry.seq_id].served_tick = state.n_ticks
            return checked
        except BaseException as e:  # sys.exit() in a strategy must not stop every actor
            error = e if isinstance(e, StrategyError) else StrategyError(f"{strategy!r} raised {e!r}")
            _log.error("batch strategy failed; failing %d active requests: %s", len(busy), error)
            for slot in busy.values():
                self.lifecycle.fail(slot, error)
            return None
