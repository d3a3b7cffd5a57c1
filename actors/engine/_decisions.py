"""Typed decisions in the engine: a ``Decide`` as one request per question over the
state's shared cells, read from the answer position's logits.

Each question is rendered with the model's chat template: one user turn holding the
state, then the question, its options with single-token labels (``A`` to ``Z`` for a
choice, ``0`` to ``9`` for a score, ``yes``/``no`` for a noul) and an instruction to
answer with one label; the assistant's turn is opened, thinking off unless the
request's ``template_kwargs`` turn it on. Every question's prompt starts with the same
tokens (the template's header and the state), so:

- a *leader* request holds that common prefix: it is prefilled once, in chunks like any
  prompt, and ends without sampling;
- each question is a request whose prompt is the prefix plus its own part. It waits
  while the leader is running (``Scheduler._follows``), then takes the leader's cells
  by prefix sharing (``llama_memory_seq_cp``: no compute), so all of a request's
  questions decode their own parts side by side, in one tick when the slots and the
  batch allow;
- a question's request reads the log-softmax of its labels at the answer position and
  ends (``OutputStage``): nothing is sampled or generated.

With one question, or ``cache_prompt=False``, there is no leader. The requests share
one :class:`~actors.engine._slots.Choices` group, so the decision has one outcome: a
``Decision`` once every question is read, or the first error (a question that fails
fails the rest; one cancelled or timed out ends the decision with an error).

:func:`prepare_decision` runs in the caller's thread; :func:`decision_of` in the
engine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from actors.backend import Backend
from actors.chat import ReplySpec
from actors.contract import (
    Answer,
    Chat,
    Completion,
    Decide,
    Decision,
    EngineError,
    GenerateTokens,
    InvalidRequest,
    PromptTooLong,
    Question,
    RequestTimeout,
)
from actors.engine._prepare import Prepared, request_adapters
from actors.engine._slots import Choices, common_prefix_len

__all__ = ["PreparedDecision", "decision_of", "flat_reads", "labels", "prepare_decision", "question_text"]

_LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_DIGITS = tuple("0123456789")


def labels(question: Question) -> tuple[str, ...]:
    """The labels a question's options are shown with, in their order."""
    if question.type == "noul":
        return ("yes", "no")
    if question.type == "choice":
        return _LETTERS[: len(question.options)]
    return _DIGITS[: len(question.options)]


def _spellings(question: Question) -> tuple[tuple[str, ...], ...]:
    """Each option's label as the model may write it: a noul's ``yes`` also as ``Yes``
    (a model answers a yes/no question capitalized as often as not: both are the
    answer); a letter or a digit as itself."""
    if question.type == "noul":
        return tuple((label, label.capitalize()) for label in labels(question))
    return tuple((label,) for label in labels(question))


def question_text(question: Question) -> str:
    """What the model reads after the state: the question, its labelled options, and
    how to answer (any thread)."""
    lines = [f"Question: {question.instructions}"]
    if question.type == "noul":
        for label, description in zip(("yes", "no"), question.descriptions, strict=True):
            if description is not None:
                lines.append(f"{label}: {description}")
        lines.append("Answer with yes or no only.")
    elif question.type == "choice":
        for label, option, description in zip(
            labels(question), question.options, question.descriptions, strict=True
        ):
            lines.append(f"{label}: {option}" + (f" - {description}" if description is not None else ""))
        lines.append("Answer with the letter of one option only.")
    else:
        for label, description in zip(labels(question), question.descriptions, strict=True):
            lines.append(f"{label}: {description}")
        lines.append("Answer with the number of one level only.")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PreparedDecision:
    """A ``Decide`` rendered and checked against the model.

    ``leader`` prefills the questions' common prefix (None: one question, or no cache
    reuse); ``questions`` are the questions' requests in the order asked, and ``reads``
    each one's options' token ids (each option's spellings that are one token), in its
    options' order.
    """

    message: Decide
    leader: Prepared | None
    questions: tuple[Prepared, ...]
    reads: tuple[tuple[tuple[int, ...], ...], ...]
    limit: int


def prepare_decision(backend: Backend, message: Decide, limit: int) -> PreparedDecision:
    """Render each question, check its labels and length, and find the shared prefix
    (thread-safe: the caller's thread).

    Raises:
        InvalidRequest: a label is not one token of this model, two labels are the same
            token, or the template leaves the model thinking where the answer is read.
        PromptTooLong: the state, or a question with it, does not fit a slot's context.
    """
    try:
        return _prepare(backend, message, limit)
    except EngineError:
        raise
    except Exception as e:  # a message changed behind its checks, a library's surprise
        raise InvalidRequest(f"the decision could not be prepared: {e!r}") from None


def _prepare(backend: Backend, message: Decide, limit: int) -> PreparedDecision:
    vocab = backend.vocab
    n_state = len(vocab.tokenize(message.state, add_special=False, parse_special=False))
    if n_state + 1 >= limit:  # checked before rendering it once per question
        raise PromptTooLong(
            f"the state is {n_state} tokens: it cannot fit a slot's context of {limit} tokens "
            f"(n_ctx_per_slot={limit}) with a question",
            n_state,
            limit,
            truncatable=False,
        )
    kwargs = {"enable_thinking": False, **(message.template_kwargs or {})}
    prompts: list[list[int]] = []
    reads: list[tuple[tuple[int, ...], ...]] = []
    for name, question in message.questions.items():
        ids = tuple(_label_tokens(backend, name, spellings) for spellings in _spellings(question))
        flat = [t for option in ids for t in option]
        if len(set(flat)) != len(flat):
            raise InvalidRequest(f"question {name!r}: two of its labels are the same token in this model")
        content = f"{message.state}\n\n{question_text(question)}"
        chat = Chat([{"role": "user", "content": content}], template_kwargs=kwargs, max_tokens=1)
        prompt, _, reply = backend.chat.prompt(chat)
        if _thinks_first(backend, prompt, reply):
            raise InvalidRequest(
                f"question {name!r}: the chat template leaves the model thinking where the answer "
                "is read (template_kwargs turn thinking on, or the template always thinks); a "
                "decision reads the answer's first token, so turn thinking off"
            )
        if len(prompt) + 1 > limit:
            raise PromptTooLong(
                f"question {name!r} with the state is {len(prompt)} tokens: it cannot fit a slot's "
                f"context of {limit} tokens (n_ctx_per_slot={limit})",
                len(prompt),
                limit,
                truncatable=False,
            )
        prompts.append(prompt)
        reads.append(ids)
    shared = min(common_prefix_len(prompts[0], p) for p in prompts)
    options: dict[str, Any] = {
        "request_id": message.request_id,
        "max_tokens": 1,
        "temp": 0.0,
        "priority": message.priority,
        "deadline_s": message.deadline_s,
        "cache_scope": message.cache_scope,
        "cache_prompt": message.cache_prompt,
        "lora": message.lora,
        "speculate": False,
    }
    adapters = request_adapters(backend, message.lora)
    leader = None
    if len(prompts) > 1 and message.cache_prompt and shared > 0:
        head = tuple(prompts[0][:shared])
        leader = Prepared(GenerateTokens(head, **options), head, limit, adapters=adapters)
    questions = tuple(
        Prepared(GenerateTokens(p, **options), tuple(p), limit, adapters=adapters) for p in prompts
    )
    return PreparedDecision(message, leader, questions, tuple(reads), limit)


def _thinks_first(backend: Backend, prompt: list[int], reply: ReplySpec | None) -> bool:
    """Whether the model's first token after ``prompt`` is thinking, not the answer: the
    template opened a thinking block, or the family thinks and the prompt does not end
    with the block closed (Qwen3's ``enable_thinking=False`` writes it empty)."""
    if reply is None or not reply.reasoning or reply.syntax.think is None:
        return False
    if reply.thinking:
        return True
    tail = b"".join(backend.vocab.special_piece(t) for t in prompt[-16:]).decode("utf-8", "replace")
    return not tail.rstrip().endswith(reply.syntax.think[1])


def _label_tokens(backend: Backend, name: str, spellings: tuple[str, ...]) -> tuple[int, ...]:
    """The token of each spelling of a label that is one token; at least the first's."""
    ids = []
    for i, spelling in enumerate(spellings):
        tokens = backend.vocab.tokenize(spelling, add_special=False, parse_special=False)
        if len(tokens) == 1:
            ids.append(tokens[0])
        elif i == 0:
            raise InvalidRequest(
                f"question {name!r}: its label {spelling!r} is {len(tokens)} tokens in this model's "
                "vocabulary, and an answer is read from one token"
            )
    return tuple(ids)


def flat_reads(reads: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """A question's token ids to read, every option's in a row."""
    return tuple(t for option in reads for t in option)


def _option_logprobs(reads: tuple[tuple[int, ...], ...], read: tuple[float, ...]) -> list[float]:
    """Each option's log-probability: the log of its spellings' summed probability."""
    out, at = [], 0
    for option in reads:
        values = read[at : at + len(option)]
        at += len(option)
        top = max(values)
        out.append(top if top == -math.inf else top + math.log(math.fsum(math.exp(v - top) for v in values)))
    return out


def decision_of(prepared: PreparedDecision, group: Choices) -> Decision:
    """The ``Decision`` of a group whose every request ended (engine thread).

    Raises:
        RequestTimeout: a question ran out of its ``deadline_s``.
        EngineError: a question was cancelled.
    """
    first = 1 if prepared.leader is not None else 0
    ended = [r for r in group.results if isinstance(r, Completion)]
    reasons = {r.stop_reason for r in ended}
    message = prepared.message
    if "timeout" in reasons:
        raise RequestTimeout(f"decision {message.request_id!r} ran out of its deadline_s")
    requests = group.requests[first:]
    if "cancelled" in reasons or any(r.read is None for r in requests):
        raise EngineError(f"decision {message.request_id!r} was cancelled")
    answers = {
        name: Answer.read(question, _option_logprobs(reads, request.read or ()))
        for (name, question), request, reads in zip(
            message.questions.items(), requests, prepared.reads, strict=True
        )
    }
    shared = len(prepared.leader.prompt) if prepared.leader is not None else 0
    prompt_tokens, cached = shared, 0
    if prepared.leader is not None:
        cached = ended[0].prefix_cache_tokens
    for completion in ended[first:]:
        prompt_tokens += completion.prompt_tokens - shared
        cached += max(0, completion.prefix_cache_tokens - shared)
    duration_ms = max((c.duration_ms for c in ended), default=0.0)
    return Decision(message.request_id, answers, prompt_tokens, cached, duration_ms)
