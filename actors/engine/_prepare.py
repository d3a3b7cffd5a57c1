"""Turning a request message into what admission needs, in the caller's thread.

Tokenizing a prompt, rendering a chat template and converting and probing a grammar
cost time in proportion to what a caller sends (a 1 MB prompt takes a few hundred ms).
``EngineRef`` runs :func:`prepare` in the thread that sends the request, so the engine
thread, which every tenant shares, spends no time on the prompt's text. Every check of
a request against the model is made here, once (token ids and ``logit_bias`` against
the vocabulary, the length against a slot's context); admission trusts a ``Prepared``
made for its own context, and checks only the engine's state (ids in use, the queue).
A message that reaches the actor unprepared (sent before the model loaded) is prepared
there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from actors.backend import Backend, Triggers, resolve_lora
from actors.chat import ReplySpec, Syntax, ToolGrammar, write_calls
from actors.contract import (
    Chat,
    EngineError,
    InvalidRequest,
    LoraScales,
    PromptTooLong,
    RequestMessage,
    StreamChat,
    check_grammar,
    checked_tokens,
    grammar_for_schema,
)

__all__ = ["CALL_ROOM", "MAX_GRAMMAR_MS_PER_TOKEN", "Prepared", "fit_prompt", "prepare", "request_adapters"]

CALL_ROOM = 48
"""Tokens of arguments a call required after thinking keeps room for: the thinking
ends that much (plus the call's markers) before ``max_tokens``."""

MAX_GRAMMAR_MS_PER_TOKEN = 50.0
"""The most one token's grammar check may cost, in ms of the engine thread.

A JSON-Schema grammar of a function call costs about 1-3 ms per token over
SmolLM2's 49,152-token vocabulary on this project's 2-core machine; a grammar that
costs more than this at its first token is refused, and one that costs more than this
for several tokens in a row while generating fails its request, so no tenant's grammar
can slow every other stream by more than this per token.
"""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request with its prompt tokenized and its grammar resolved and checked.

    ``grammar`` is the request's own grammar (``json_schema`` converted, or the chat's
    tool grammar), or None for the server's default.
    """

    message: RequestMessage
    prompt: tuple[int, ...]
    limit: int
    """The slot context it was fitted to (``n_ctx_per_slot``): admission takes it only
    for that context."""
    grammar: str | None = None
    triggers: Triggers | None = None
    """When set, ``grammar`` is lazy: it waits for one of these (a tool call's marker)."""
    reply: ReplySpec | None = None
    """How to split a chat's reply into content, thinking and tool calls (None: it is
    all content)."""
    budget: int | None = None
    """A chat's thinking budget in tokens (None: none), and the tokens that close the
    thinking when it is spent (its message, then the format's end marker)."""
    budget_tokens: tuple[int, ...] = ()
    call_after_thinking: bool = False
    """A call is required after the thinking the prompt opened: the reply may not end
    while it thinks (the budget closes the thinking in time for the call)."""
    adapters: tuple[tuple[int, float], ...] | None = None
    """The LoRA adapter set its ``lora`` resolves to (None: it names none, and runs with
    the server's default scales at admission)."""


def fit_prompt(prompt: list[int], message: RequestMessage, limit: int) -> list[int]:
    """The prompt if it fits a slot's context of ``limit`` tokens (with room for one
    generated token), truncated if the request allows it (any thread).

    Raises:
        PromptTooLong: it does not fit and ``truncate`` is off.
    """
    if len(prompt) + 1 <= limit:
        return prompt
    if not message.truncate:
        raise PromptTooLong(
            f"prompt of {len(prompt)} tokens cannot fit a slot's context of {limit} tokens "
            f"(n_ctx_per_slot={limit}): it exceeds the available context size; pass "
            "truncate=True to keep its start and end",
            len(prompt),
            limit,
        )
    # llama.cpp's rule: keep n_keep tokens, drop whole blocks of half the rest.
    n_keep = min(message.n_keep, limit // 2)
    block = max((limit - n_keep) // 2, 1)
    n_blocks = (len(prompt) - n_keep - block) // block
    return prompt[:n_keep] + prompt[n_keep + n_blocks * block :]


def prepare(backend: Backend, message: RequestMessage, limit: int) -> Prepared:
    """Tokenize ``message``'s prompt, resolve its grammar and check it against the model
    (thread-safe: any thread).

    ``limit`` is a slot's context (``n_ctx_per_slot``): a prompt too long for it is
    refused, or truncated, here rather than in the engine thread.

    Raises:
        InvalidRequest: the prompt or grammar cannot be used with this model.
        EngineStopped: the model was unloaded.
    """
    tools: ToolGrammar | None = None
    reply: ReplySpec | None = None
    try:
        if isinstance(message, Chat | StreamChat):
            prompt, tools, reply = backend.chat.prompt(message)
        elif hasattr(message, "prompt"):
            prompt = backend.vocab.tokenize(message.prompt)
        else:  # checked by the constructor; again, for a message changed since
            prompt = list(checked_tokens(message.tokens))
        if not prompt:
            raise InvalidRequest("prompt tokenizes to nothing")
        n_vocab = backend.vocab.n_vocab
        if max(prompt) >= n_vocab or min(prompt) < 0:
            bad = next(t for t in prompt if not 0 <= t < n_vocab)
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (n_vocab={n_vocab})")
        prompt = fit_prompt(prompt, message, limit)
        bias = dict(message.logit_bias) if message.logit_bias else None
        if bias and max(bias) >= n_vocab:
            raise InvalidRequest(f"logit_bias names token {max(bias)}, outside the vocabulary")
        grammar = message.grammar
        triggers: Triggers | None = None
        if tools is not None:  # it holds the answer's json_schema, if any
            grammar = tools.grammar
            if tools.lazy:
                triggers = _triggers(backend, tools)
        elif message.json_schema is not None:
            grammar = grammar_for_schema(dict(message.json_schema), backend.sampling.json_schema_grammar)
        if grammar is not None:
            check_grammar(grammar, is_single_token=backend.vocab.is_single_token)
            cost_ms = backend.sampling.probe_grammar(grammar, bias)
            if cost_ms > MAX_GRAMMAR_MS_PER_TOKEN:
                raise InvalidRequest(
                    f"the grammar costs {cost_ms:.0f} ms per token (the limit is "
                    f"{MAX_GRAMMAR_MS_PER_TOKEN:.0f} ms), which would slow every other request; simplify it"
                )
        adapters = request_adapters(backend, message.lora)
    except EngineError:
        raise
    except Exception as e:  # a bug or a library's surprise: the request's failure, not the caller's crash
        raise InvalidRequest(f"the request could not be prepared: {e!r}") from None
    budget: int | None = None
    budget_tokens: tuple[int, ...] = ()
    call_after_thinking = False
    if reply is not None and reply.reasoning and reply.syntax.think is not None:
        budget = getattr(message, "reasoning_budget", None)
        note = getattr(message, "reasoning_budget_message", None)
        close = (note + "\n" if note else "") + reply.syntax.think[1]
        if (
            isinstance(message, Chat | StreamChat)
            and message.tool_choice not in (None, "auto", "none")
            and reply.thinking
            and tools is not None
            and tools.lazy
        ):
            # A call is required after the thinking the prompt opened: the thinking ends
            # while max_tokens still holds its close (with the budget's message) and a
            # call (its markers, and CALL_ROOM tokens of arguments), or the turn could
            # end without a call.
            room = message.max_tokens - _call_cost(backend, reply.syntax, message, close)
            budget = max(0, room if budget is None else min(budget, room))
            call_after_thinking = True
        if budget is not None:
            budget_tokens = tuple(backend.vocab.tokenize(close, add_special=False, parse_special=True))
    return Prepared(
        message,
        tuple(prompt),
        limit,
        grammar,
        triggers,
        reply,
        budget,
        budget_tokens,
        call_after_thinking,
        adapters,
    )


def request_adapters(backend: Backend, lora: LoraScales | None) -> tuple[tuple[int, float], ...] | None:
    """The adapter set a request's ``lora`` names, checked against the server's adapters
    (None: it names none; any thread).

    Raises:
        InvalidRequest: it names an adapter the server does not have.
    """
    return None if lora is None else resolve_lora(lora, backend.adapters.loaded)


def _call_cost(backend: Backend, syntax: Syntax, message: Chat | StreamChat, close: str) -> int:
    """Tokens a required call needs after thinking: the thinking's ``close``, the call's
    markers (written with no arguments, for the named function or the longest name) and
    :data:`CALL_ROOM` tokens of arguments."""
    assert syntax.think is not None and message.tools
    choice = message.tool_choice
    names = [str(tool["function"]["name"]) for tool in message.tools]
    name = str(choice["function"]["name"]) if isinstance(choice, Mapping) else max(names, key=len)
    markup = close + write_calls(dataclasses.replace(syntax, think=None), [(name, {})])
    return len(backend.vocab.tokenize(markup, add_special=False, parse_special=True)) + CALL_ROOM


def _triggers(backend: Backend, grammar: ToolGrammar) -> Triggers:
    """What wakes the lazy grammar: the token of each trigger word that is one token
    (as llama.cpp does: the model writes its markers as the tokens it was trained on),
    else the word's pattern. A pattern is searched in the whole reply so far at every
    token, a cost that grows with the reply; a token costs nothing."""
    tokens = []
    for word in grammar.trigger_words:
        ids = backend.vocab.tokenize(word, add_special=False, parse_special=True)
        if len(ids) == 1:
            tokens.append(ids[0])
    if len(tokens) == len(grammar.trigger_words) and tokens:
        return (), tuple(tokens)
    return grammar.trigger_patterns, tuple(tokens)
