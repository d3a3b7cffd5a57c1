"""Bringing a reply to its end in time: a spent thinking budget's close, and a
constrained tool call closed before ``max_tokens`` (see :data:`CLOSE_MARGIN`).

Each function returns the token to force instead of sampling, having checked that the
request's sampler (its grammar) takes it, or None to sample as usual. Runs in the
engine's thread only (it advances the sampler's grammar).
"""

from __future__ import annotations

import math

from actors.backend import Backend
from actors.engine._slots import Request

__all__ = ["CLOSE_MARGIN", "CLOSE_WINDOW", "closing_token", "forced_token"]

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


def forced_token(backend: Backend, request: Request) -> int | None:
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
    if backend.sampling.force(request.sampler, token):
        return token
    request.forced.clear()  # the grammar refuses the close: let the model go on
    return None


def closing_token(backend: Backend, request: Request, ban_eog: bool) -> int | None:
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
        token = _close_with(backend, request, text, left, reserve, ban_eog)
        if token is not None:
            request.closed_early = request.closed_early or not between
        return token
    if text == "" and between and not ban_eog and left <= reserve + CLOSE_MARGIN:
        for eog in sorted(backend.vocab.eog_ids):
            if backend.sampling.force(request.sampler, eog):
                return eog
    return None


def _close_with(
    backend: Backend, request: Request, text: str, left: int, reserve: int, ban_eog: bool
) -> int | None:
    """The first token of the longest start of ``text`` the grammar takes, once the
    tokens ``left`` are no more than ``text`` needs (or the ``reserve``) plus the
    margin; a token is taken only if its text is that start's (a vocabulary that puts
    a space before a word's first piece would add one), the request does not ban it,
    and it does not end the reply where the end is banned."""
    vocab = backend.vocab
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
        if backend.sampling.force(request.sampler, token):
            return token
    return None
