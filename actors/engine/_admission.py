"""Admission: a prepared request is checked against the model and the engine's limits,
then placed in an idle slot (reusing the longest cached prefix) or in the wait queue,
by priority; waiting requests enter slots as slots and KV cells free up.

Runs in the engine's thread only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import pykka

from actors.chat import ReplySpec
from actors.contract import (
    STREAMING,
    CancelExact,
    EngineStopped,
    InvalidRequest,
    QueueFull,
    ReplyTo,
    RequestMessage,
    SamplingParams,
)
from actors.engine._embedding import PreparedEmbed
from actors.engine._forward import ForwardPass
from actors.engine._output import TextStream
from actors.engine._prepare import Prepared, fit_prompt
from actors.engine._slots import Choices, Request, Slot, running_choices
from actors.engine._speculative import Acceptances
from strategies import SlotState

__all__ = ["Admission"]

_log = logging.getLogger("llama_cpp_actors.engine")

_SEEDS = 2**32 - 1  # seeds are 0 .. 2**32 - 2 (2**32 - 1 asks llama.cpp for a random one)


class Admission(ForwardPass):
    """Admit, queue, start, cancel and expire requests (engine thread only)."""

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
        n = message.n
        keys = [message.request_id, *(f"{message.request_id}#{i}" for i in range(1, n))]
        if message.request_id in self.choices or any(key in self.requests for key in keys):
            raise InvalidRequest(f"request_id {message.request_id!r} is already in use")
        if isinstance(message, STREAMING) != (reply_to is not None):
            raise InvalidRequest("internal: reply path does not match the message")
        prompt = list(prepared.prompt)
        if not prompt:
            raise InvalidRequest("prompt tokenizes to nothing")
        if max(prompt) >= backend.vocab.n_vocab or min(prompt) < 0:
            bad = next(t for t in prompt if not 0 <= t < backend.vocab.n_vocab)
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (n_vocab={backend.vocab.n_vocab})"
            )
        prompt = fit_prompt(prompt, message, self.n_ctx_slot)
        bias = dict(message.logit_bias) if message.logit_bias else None
        if bias and max(bias) >= backend.vocab.n_vocab:
            raise InvalidRequest(f"logit_bias names token {max(bias)}, outside the vocabulary")
        free = [slot for slot in self.slots if slot.state is SlotState.IDLE]
        if len(self.waiting) + max(0, n - len(free)) > self.config.max_queue or (
            not free and len(self.waiting) >= self.config.max_queue
        ):
            raise QueueFull(f"all {len(self.slots)} slots busy and {len(self.waiting)} requests waiting")
        params = self.config.defaults.merged(message)
        if prepared.grammar is not None:
            params = dataclasses.replace(params, grammar=prepared.grammar)
        self._arrivals += 1
        requests = [self._request(prepared, prompt, params, bias, i, future, reply_to) for i in range(n)]
        if n > 1:
            group = Choices(requests, future, [None] * n)
            self.choices[message.request_id] = group
            for request in requests:
                request.choices, request.future = group, None
        leader = requests[0]
        if free and not self.waiting and not self.memory.worth_waiting(leader, self.slots):
            self._start(leader, free)
        else:
            self._enqueue(leader)
        for request in requests[1:]:  # they copy the leader's prompt once it is computed
            self._enqueue(request)

    def admit_embed(self, prepared: PreparedEmbed, future: pykka.ThreadingFuture[object]) -> None:
        """Queue a prepared ``Embed`` for the next embedding pass; ``future`` gets its
        ``Embeddings`` or its error.

        Raises:
            InvalidRequest: its id is in use, or a token is outside the vocabulary.
            QueueFull: ``max_queue`` embedding requests wait.
            EngineStopped: the engine is draining.
        """
        if self.draining:
            raise EngineStopped("the engine is draining: it takes no new requests")
        request_id = prepared.message.request_id
        if request_id in self.requests or request_id in self.choices:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        self.embedder.admit(prepared, future)

    def _request(
        self,
        prepared: Prepared,
        prompt: list[int],
        params: SamplingParams,
        bias: dict[int, float] | None,
        index: int,
        future: pykka.ThreadingFuture[object] | None,
        reply_to: ReplyTo | None,
    ) -> Request:
        """Choice ``index`` of an admitted request: its own sampler (seed + index), in the table."""
        message = prepared.message
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + index) % _SEEDS)
        sampler = self.backend.sampling.make(params, bias, prompt, prepared.triggers)
        request = Request(message, prompt, params, self._arrivals, sampler, future, reply_to, index=index)
        request.text = TextStream(message.stop or (), message.min_tokens)
        if prepared.reply is not None:
            request.reply = prepared.reply.parser()
            request.shown = self._shown(prepared.reply)
            request.budget, request.budget_tokens = prepared.budget, prepared.budget_tokens
            request.call_after_thinking = prepared.call_after_thinking
        if message.logprobs is not None:
            request.logprobs = []
        if self.drafter is not None and message.speculate:
            request.acceptance = Acceptances()
        if reply_to is not None:
            request.on_stall = functools.partial(self._stalled, message)
            request.progress = getattr(message, "progress", False) and index == 0
        self.requests[request.key] = request
        if message.deadline_s is not None:
            request.deadline = request.t_admitted + message.deadline_s
            self._n_deadlines += 1
        return request

    def _shown(self, reply: ReplySpec) -> frozenset[int]:
        """The special tokens that spell one of the reply's markers: their text is shown
        to the parser (a special token's text is otherwise empty)."""
        tokens = (self.backend.vocab.special_token(word) for word in reply.markers)
        return frozenset(t for t in tokens if t is not None)

    def _stalled(self, message: RequestMessage) -> None:
        """A stream's consumer stopped reading: cancel it (the courier's thread)."""
        _log.warning("the consumer of stream %s stopped reading; cancelling it", message.request_id)
        with contextlib.suppress(pykka.ActorDeadError):
            self.sender.tell(CancelExact(message.request_id, message))

    def _enqueue(self, request: Request) -> None:
        """Lower ``priority`` first, first come first served within a priority."""
        key = request.message.priority
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].message.priority > key:
            index -= 1
        self.waiting.insert(index, request)

    def _start(self, request: Request, idle: list[Slot]) -> None:
        """Give ``request`` an idle slot, reusing the longest cached prefix."""
        slot, n_reuse = self.memory.claim(request, idle, self._make_room)
        self._occupy(slot, request, n_reuse)

    def cancel(self, request_id: str, message: object = None) -> None:
        """Cancel a queued or running request; an unknown id is ignored, and so is a
        request not admitted from ``message`` when one is given."""
        if self.embedder.queue and self.embedder.cancel(request_id, message):
            return
        group = self.choices.get(request_id)
        requests = group.requests if group is not None else [self.requests.get(request_id)]
        for request in requests:
            if request is None or (message is not None and request.message is not message):
                return
            if request.key in self.requests:
                self._stop_request(request, "cancelled")

    def _expire(self) -> None:
        """End every request past its ``deadline_s``, queued or running: ``"timeout"``."""
        now = time.monotonic()
        for request in [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]:
            self._stop_request(request, "timeout")

    def _dequeue(self) -> None:
        """Waiting requests enter idle slots while the KV cells have room (see ``_next``)."""
        while self.waiting:
            idle = [slot for slot in self.slots if slot.state is SlotState.IDLE]
            if not idle:
                return
            request = self._next(idle)
            if request is None or not self._kv_room_for(request):
                return
            self.waiting.remove(request)
            self._start(request, idle)

    def _next(self, idle: list[Slot]) -> Request | None:
        """The waiting request to start: of the top priority, the first of those whose
        request has the fewest choices in the slots (so the choices of an ``n`` > 1
        request take turns with other requests, instead of holding every slot until they
        are all done), except that one of a session an idle slot served goes first
        (LlamaCppEx's ``dequeue_session_matches``), and one whose prefix a slot is
        prefilling now waits for it (``worth_waiting``)."""
        sessions = {(slot.scope, slot.session) for slot in idle if slot.session is not None}
        priority = self.waiting[0].message.priority
        chosen, fewest = None, 0
        for request in self.waiting:
            if request.message.priority != priority:
                break
            if self._follows(request) or self.memory.worth_waiting(request, self.slots):
                continue
            if request.session is not None and (request.scope, request.session) in sessions:
                return request
            running = running_choices(request, self.requests)
            if chosen is None or running < fewest:
                chosen, fewest = request, running
                if fewest == 0 and not sessions:
                    break
        return chosen

    def _follows(self, request: Request) -> bool:
        """A choice i > 0 waits while its leader has not sampled (then ``_fork`` copies it)."""
        group = request.choices
        if group is None or request.index == 0:
            return False
        leader = group.leader
        return leader.t_first_token is None and leader.key in self.requests
