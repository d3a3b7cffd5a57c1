"""The output stage: what the forward pass's rows become. Each decoded row is recorded
in its slot's KV books; each row with logits is sampled (or verified, for a draft run),
the token streamed, stop strings, ``max_tokens`` and the context checked (shifting it
when allowed), and a request that stopped finished; the leader of ``n`` choices forks
the others from its first row.

Runs in the engine's thread only.
"""

from __future__ import annotations

import logging
import math
import time

from actors.backend import DeadEnd
from actors.contract import EngineError, InvalidRequest, Token, TokenLogprob, TopLogprob
from actors.engine._batch import Segment
from actors.engine._closing import closing_token, forced_token
from actors.engine._lifecycle import Lifecycle
from actors.engine._prepare import MAX_GRAMMAR_MS_PER_TOKEN
from actors.engine._slots import Request, Slot, running_choices
from actors.engine._state import EngineState
from strategies import SlotState

__all__ = ["OutputStage"]

_log = logging.getLogger("llama_cpp_actors.engine")

# A grammar over MAX_GRAMMAR_MS_PER_TOKEN for this many tokens in a row fails its request.
_GRAMMAR_STRIKES = 3


def _log_p(p: float) -> float:
    return math.log(p) if p > 0.0 else -math.inf


class OutputStage:
    """Record, sample, stream and stop the rows of a decoded batch (engine thread only).

    Args:
        state: the engine's shared state.
        lifecycle: how requests start and end.
    """

    def __init__(self, state: EngineState, lifecycle: Lifecycle) -> None:
        self.state = state
        self.backend = state.backend
        self.lifecycle = lifecycle

    def commit(self, segments: list[Segment], start: int) -> None:
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
                self.state.memory.computed(slot, [slot.pending])
            else:
                self.state.memory.computed(slot, tokens[segment.start : segment.end].tolist())
                request = slot.request
                # A Progress for streams that asked; a consumer found gone leaves nothing to sample.
                if request is not None and request.progress and not request.token_ids:
                    self.lifecycle.progress(slot)
        for segment, request in zip(segments, owners, strict=True):
            slot = segment.slot
            if segment.logits_row < 0 or request is None or slot.request is not request:
                continue
            if segment.drafts:
                self._verify(slot, request, segment, start)
                continue
            if request.reads is not None:
                self._read(slot, request, segment.logits_row - start)
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
                self.state.memory.computed(slot, [token])
        finally:
            # Draft cells past what the slot holds: never on the books, dropped now.
            self.backend.kv.trim(slot.seq_id, len(slot.cached))
            self.state.draft_tokens += len(drafts)
            self.state.draft_accepted += accepted
            self.state.now.draft_tokens += len(drafts)
            self.state.now.drafts += 1
            self.state.now.draft_accepted += accepted
            if request.acceptance is not None:
                request.acceptance.of(kind).verified(len(drafts), accepted)

    def _read(self, slot: Slot, request: Request, row: int) -> None:
        """A decision's question: read its labels' log-probabilities from the row (over
        the whole vocabulary, before any sampler) and end it; the leader only ends."""
        if request.reads:
            log_softmax, _ = self.backend.sampling.logprobs(row, 0)
            request.read = tuple(float(log_softmax[token]) for token in request.reads)
        else:
            request.read = ()
        self.lifecycle.finish(slot, "stop")

    def _sample_alone(self, slot: Slot, row: int) -> int | None:
        """Sample ``row`` for the slot; a sampler that breaks fails its request alone.
        The token sampled, or None when none was."""
        try:
            return self._sample(slot, row)
        except Exception as e:
            _log.exception("sampling failed for %s", slot.request and slot.request.request_id)
            if slot.request is not None:
                self.lifecycle.fail(slot, EngineError(f"sampling failed: {e!r}"))
            return None

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
            for r in self.state.waiting
            if r.choices is not group
            and r.message.priority <= priority
            and running_choices(r, self.state.requests) == 0
        )
        for choice in group.requests[1:]:
            if choice.started or choice.key not in self.state.requests:
                continue
            idle = [s for s in self.state.slots if s.state is SlotState.IDLE and s is not leader]
            if len(idle) <= reserved or not self.state.kv_room_for(choice):
                return
            slot = self.state.memory.fork(leader, choice, idle)
            self.state.waiting.remove(choice)
            self.lifecycle.occupy(slot, choice, len(choice.prompt))
            self._sample_alone(slot, row)

    def _sample(self, slot: Slot, index: int) -> int | None:
        """Sample row ``index`` for the slot and hand the token to ``_on_token``; the
        token, or None when there was none (a dead end or a costly grammar ended it)."""
        request = slot.request
        assert request is not None
        message = request.message
        log_softmax = None
        post = message.post_sampling_probs
        if request.logprobs is not None and not post:  # from the raw logits, before any ban or bias
            log_softmax, top = self.backend.sampling.logprobs(index, message.logprobs or 0)
        ban_eog = (
            message.ignore_eos
            or len(request.token_ids) < message.min_tokens
            or (request.call_after_thinking and request.reply is not None and request.reply.thinking)
        )
        forced = forced_token(self.backend, request)
        if forced is None:
            forced = closing_token(self.backend, request, ban_eog)
        try:
            token = (
                forced
                if forced is not None
                else self.backend.sampling.sample(request.sampler, index, ban_eog=ban_eog)
            )
        except DeadEnd as dead_end:
            if dead_end.eog_allowed:  # only the end is allowed: min_tokens/ignore_eos yield
                self.lifecycle.finish(slot, "eog")
            else:
                self.lifecycle.fail(
                    slot,
                    InvalidRequest(
                        "no token is allowed here: the grammar and logit_bias leave nothing to sample"
                    ),
                )
            return None
        if self._too_costly(request):
            self.lifecycle.fail(
                slot,
                InvalidRequest(
                    f"the grammar costs over {MAX_GRAMMAR_MS_PER_TOKEN:.0f} ms per token, which would "
                    "slow every other request; simplify it"
                ),
            )
            return None
        logprob = None
        if request.logprobs is not None and token not in self.backend.vocab.eog_ids:
            if post and forced is not None:  # forced (a thinking budget's close): certain
                chosen, top = 0.0, [(token, 0.0)]
            elif post:  # what the chain drew from: read before anything samples again
                prob, probs = self.backend.sampling.sampled_probs(
                    request.sampler, token, message.logprobs or 0
                )
                chosen, top = _log_p(prob), [(t, _log_p(p)) for t, p in probs]
            else:
                assert log_softmax is not None
                chosen = float(log_softmax[token])
            piece = self.backend.vocab.piece
            logprob = TokenLogprob(
                token,
                piece(token).decode("utf-8", "replace"),
                chosen,
                tuple(TopLogprob(t, piece(t).decode("utf-8", "replace"), lp) for t, lp in top),
            )
        self._on_token(slot, token, logprob)
        return token

    @staticmethod
    def _too_costly(request: Request) -> bool:
        """The request's grammar took over the limit for several tokens in a row."""
        sampler = request.sampler
        if not sampler.has_grammar:
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
        if token in self.backend.vocab.eog_ids:
            self.lifecycle.finish(slot, "eog")
            return
        request.token_ids.append(token)
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        piece = (
            self.backend.vocab.special_piece(token)
            if token in request.shown
            else self.backend.vocab.piece(token)
        )
        text, stop = request.text.push(piece)
        if request.reply is None:
            request.pieces.append(text)
            event = Token(request.request_id, text, token, logprob, request.index)
        else:
            if request.reply.thinking:
                request.thought += 1
            parsed = request.reply.feed(text)
            request.pieces.append(parsed.content)
            event = Token(
                request.request_id,
                parsed.content,
                token,
                logprob,
                request.index,
                parsed.reasoning,
                parsed.tool_calls,
            )
        if request.reply_to is not None and not self.lifecycle.put(request, event):
            return
        if stop is not None:
            request.stop_string = stop
            self.lifecycle.finish(slot, "stop")
        elif len(request.token_ids) >= request.message.max_tokens:
            self.lifecycle.finish(slot, "max_tokens")
        elif len(slot.cached) + 1 >= self.state.n_ctx_slot and not self._shift(slot):
            self.lifecycle.finish(slot, "length")
        else:
            slot.pending = token

    def _shift(self, slot: Slot) -> bool:
        """Make room for the next token: keep ``n_keep``, drop half the rest (llama.cpp's rule)."""
        if not (self.state.config.context_shift and self.backend.kv.can_shift):
            return False
        request = slot.request
        assert request is not None
        n_past = len(slot.cached)
        n_keep = max(0, min(request.message.n_keep, n_past - 2))
        n_discard = (n_past - n_keep) // 2
        # A slot of 1 or 2 positions has nothing to discard.
        if n_discard < 1 or not self.state.memory.shift(slot, n_keep, n_discard):
            return False
        request.context_shifts += 1
        self.state.kv_event("context_shift", {"discarded_tokens": n_discard}, request)
        return True
