"""After the forward pass: sample a slot's logits, stream the token, check stop
strings, ``max_tokens`` and the context (shifting it when allowed).

Runs in the engine's thread only.
"""

from __future__ import annotations

import math
import time

from actors.backend import DeadEnd
from actors.contract import InvalidRequest, Progress, Token, TokenLogprob, TopLogprob
from actors.engine._finishing import Finishing
from actors.engine._prepare import MAX_GRAMMAR_MS_PER_TOKEN
from actors.engine._slots import Request, Slot
from strategies import SlotState

__all__ = ["CLOSE_MARGIN", "CLOSE_WINDOW", "Sampling"]

# A grammar over MAX_GRAMMAR_MS_PER_TOKEN for this many tokens in a row fails its request.
_GRAMMAR_STRIKES = 3

CLOSE_MARGIN = 8
"""A constrained tool call whose arguments are JSON is brought to its end before
``max_tokens``: once the tokens left are no more than its closing text needs (its open
strings, objects and arrays closed where they stand, then the format's closing
markers) plus this margin, each token checked against the grammar; a required key the
arguments still lack is written by the model first, within the margin. The request
then ends ``"max_tokens"``, its calls complete. Between calls, the turn ends once the
tokens left are no more than a call is expected to take plus this margin."""

CLOSE_WINDOW = 64
"""How near ``max_tokens`` an open call's closing text is measured (the measure
tokenizes it, so it is done only this close to the end)."""


def _log(p: float) -> float:
    return math.log(p) if p > 0.0 else -math.inf


class Sampling(Finishing):
    """One token per slot that asked for logits (engine thread only)."""

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
        forced = self._forced(request)
        if forced is None:
            forced = self._closing(request, ban_eog)
        try:
            token = (
                forced
                if forced is not None
                else self.backend.sampling.sample(request.sampler, index, ban_eog=ban_eog)
            )
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
            return None
        if self._too_costly(request):
            self._fail(
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
                chosen, top = _log(prob), [(t, _log(p)) for t, p in probs]
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

    def _forced(self, request: Request) -> int | None:
        """The next token of a spent thinking budget's close, when one is due and the
        sampler (its grammar) takes it; None: sample as usual."""
        reply = request.reply
        spent = request.budget is not None and request.thought >= request.budget
        if spent and reply is not None and reply.thinking and not request.forced:
            request.forced = list(request.budget_tokens)
            request.budget = None  # spent: closed once
        if not request.forced:
            return None
        token = request.forced.pop(0)
        if self.backend.sampling.force(request.sampler, token):
            return token
        request.forced.clear()  # the grammar refuses the close: let the model go on
        return None

    def _closing(self, request: Request, ban_eog: bool) -> int | None:
        """The token that brings a constrained call to its end before ``max_tokens``,
        when its grammar takes it (see :data:`CLOSE_MARGIN`): the first token of the
        longest start of the call's closing text (``'"}}</tool_call>'``, then shorter),
        or the end of the turn between calls; None: sample as usual (the grammar leads
        the way through what no suffix can skip, such as a required key)."""
        reply, sampler = request.reply, request.sampler
        if reply is None or not sampler.has_grammar:
            return None
        n = len(request.token_ids)
        left = request.message.max_tokens - n
        done = len(reply.calls)
        if reply.in_call and request.call_start < 0:
            request.call_start = n  # the first call's marker: calls cost from here on
        if done and (done > request.calls_seen or not reply.in_call):
            # What a call took, markers and the gaps between calls included (on average,
            # with a quarter more): what the next may take.
            per_call = -(-(n - request.call_start) * 5 // (4 * done))
            request.call_tokens = max(request.call_tokens, per_call)
            request.calls_seen = done
        # Between calls the turn ends rather than begin a call it could not finish.
        between = done > 0 and (not reply.in_call or reply.after_call)
        reserve = request.call_tokens if between else 0
        if left > max(CLOSE_WINDOW if reply.in_call else 0, reserve + CLOSE_MARGIN):
            return None
        text = reply.closing() if reply.in_call else ""
        if text:
            token = self._close_with(request, text, left, reserve, ban_eog)
            if token is not None:
                request.closed_early = request.closed_early or not between
            return token
        if text == "" and between and not ban_eog and left <= reserve + CLOSE_MARGIN:
            for eog in sorted(self.backend.vocab.eog_ids):
                if self.backend.sampling.force(request.sampler, eog):
                    return eog
        return None

    def _close_with(self, request: Request, text: str, left: int, reserve: int, ban_eog: bool) -> int | None:
        """The first token of the longest start of ``text`` the grammar takes, once the
        tokens ``left`` are no more than ``text`` needs (or the ``reserve``) plus the
        margin; a token is taken only if its text is that start's (a vocabulary that puts
        a space before a word's first piece would add one), the request does not ban it,
        and it does not end the reply where the end is banned."""
        vocab = self.backend.vocab
        need = len(vocab.tokenize(text, add_special=False, parse_special=True))
        if left > max(need, reserve) + CLOSE_MARGIN:
            return None
        bias = request.message.logit_bias or {}
        tried: set[int] = set()
        for end in range(len(text), 0, -1):
            start = text[:end]
            ids = vocab.tokenize(start, add_special=False, parse_special=True)
            if not ids or ids[0] in tried:
                continue
            token = ids[0]
            tried.add(token)
            shown = vocab.piece(token) or vocab.special_piece(token)  # a special token renders empty
            if not shown or not start.encode("utf-8").startswith(shown):
                continue
            if bias.get(token, 0.0) == -math.inf or (ban_eog and token in vocab.eog_ids):
                continue
            if self.backend.sampling.force(request.sampler, token):
                return token
        return None

    def _progress(self, slot: Slot) -> bool:
        """Send the slot's prefill progress to its stream (``progress=True`` only); False
        when the consumer is gone and the request was cancelled."""
        request = slot.request
        assert request is not None
        cached = request.prefill_cached
        processed = len(slot.cached)
        elapsed_ms = (time.monotonic() - request.t_started) * 1000.0 if processed > cached else 0.0
        event = Progress(request.request_id, processed, len(request.prompt), cached, elapsed_ms)
        return self._put(request, event)

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
            self._finish(slot, "eog")
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
        if not (self.config.context_shift and self.backend.kv.can_shift):
            return False
        request = slot.request
        assert request is not None
        n_past = len(slot.cached)
        n_keep = max(0, min(request.message.n_keep, n_past - 2))
        n_discard = (n_past - n_keep) // 2
        if n_discard < 1 or not self.memory.shift(slot, n_keep, n_discard):  # a slot of 1 or 2 positions
            return False
        self._kv_event("context_shift", {"discarded_tokens": n_discard}, request)
        return True
