"""Typed decisions: ``Decide`` in, ``Decision`` out (the System One shape).

A ``Decide`` asks named, typed questions about one *state* (text, or JSON rendered as
text) and gets, for each, a probability for every allowed answer, read from the model's
next-token scores: nothing is generated and nothing parsed. Three types:

- ``noul``: a yes/no question. The answer's ``noul`` is the probability that it holds.
- ``choice``: 2 to ``MAX_OPTIONS`` named options, each with an optional description.
  The answer's ``choice`` is the likeliest option.
- ``score``: an ordered scale of 2 to ``MAX_LEVELS`` described levels, lowest first.
  The answer's ``score`` is the expected level, counted from 0 (``sum(i * p_i)``).

Every answer has ``probabilities`` (option -> probability, in the order given, summing
to 1 over the offered options), a ``confidence`` (1 when one option has all the mass,
0 when it is spread evenly: ``(n * p_max - 1) / (n - 1)`` for a noul or a choice; for
a score, one minus the expected distance from the likeliest level over that of a
uniform answer, the formula TypeSafe publishes and llama.cpp uses) and ``option_mass``:
the share of the model's next-token probability that fell on the offered labels at all
(low means the prompt did not suit the model).

Everything here is checked in the caller's thread when the message is made; what needs
the model (rendering the questions with the chat template, the labels as single tokens,
the state against the context) is checked when the request is prepared.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from actors.contract._checks import (
    MAX_ID_LENGTH,
    MAX_PROMPT_CHARS,
    _depth,
    _require,
    _show,
    checked_deadline,
    checked_request_id,
    checked_template_kwargs,
    checked_text,
    is_int,
    template_variables,
)
from actors.contract._errors import InvalidRequest
from actors.contract._lora import LoraScales, checked_lora
from actors.contract._names import suggesting

__all__ = [
    "MAX_LEVELS",
    "MAX_OPTIONS",
    "MAX_QUESTIONS",
    "MAX_QUESTION_CHARS",
    "Answer",
    "Decide",
    "Decision",
    "Question",
    "QuestionType",
]

QuestionType = Literal["noul", "choice", "score"]
QUESTION_TYPES: tuple[QuestionType, ...] = ("noul", "choice", "score")
MAX_QUESTIONS = 64
"""Questions per ``Decide`` at most (each is a sequence in the batch)."""
MAX_OPTIONS = 26
"""Options of a choice at most: each is read as one single-token label, ``A`` to ``Z``."""
MAX_LEVELS = 10
"""Levels of a score at most: each is read as one digit, ``0`` to ``9``."""
MAX_QUESTION_CHARS = 64 * 1024
"""Characters in one question's instructions and descriptions together, at most."""
MAX_STATE_DEPTH = 64
"""Lists and dicts nested in a JSON state at most."""
_QUESTION_KEYS = ("type", "instructions", "criteria")


def _new_id() -> str:
    return uuid.uuid4().hex


def _json_text(name: str, value: Mapping[str, Any] | list[Any] | tuple[Any, ...]) -> str:
    """A JSON object or list as the compact JSON text the model reads."""
    _require(
        _depth(value, MAX_STATE_DEPTH) <= MAX_STATE_DEPTH,
        f"{name} nests deeper than {MAX_STATE_DEPTH} levels",
    )
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:  # a key or value JSON has no form for, NaN...
        raise InvalidRequest(f"{name} is not JSON: {e}") from None


def _text(name: str, value: object, budget: list[int]) -> str:
    """A question's text: a string as it is, a JSON object or list as compact JSON."""
    if isinstance(value, Mapping | list | tuple):
        value = _json_text(name, value)
    text = checked_text(name, value, MAX_QUESTION_CHARS)
    budget[0] -= len(text)
    _require(budget[0] >= 0, f"a question's texts may have at most {MAX_QUESTION_CHARS} characters in all")
    return text


@dataclass(frozen=True, slots=True)
class Question:
    """One typed question, checked: its ``type``, its ``instructions``, and its options
    with their descriptions (None: none), in the order given.

    A noul's options are ``("true", "false")``; a choice's are its labels; a score's are
    its levels' indices ``"0"`` to ``"n-1"``, lowest first. Make one with
    :meth:`noul`, :meth:`choice`, :meth:`score`, or from the wire's dict with :meth:`of`.
    """

    type: QuestionType
    instructions: str
    options: tuple[str, ...]
    descriptions: tuple[str | None, ...]

    @classmethod
    def noul(cls, instructions: str, true: str | None = None, false: str | None = None) -> Question:
        """A yes/no question; ``true`` and ``false`` optionally say what each means."""
        criteria = {k: v for k, v in (("true", true), ("false", false)) if v is not None}
        return cls.of({"type": "noul", "instructions": instructions, "criteria": criteria or None})

    @classmethod
    def choice(cls, instructions: str, options: Mapping[str, str | None] | Sequence[str]) -> Question:
        """Pick one of ``options``: labels to descriptions (or None), or a list of labels."""
        return cls.of({"type": "choice", "instructions": instructions, "criteria": options})

    @classmethod
    def score(cls, instructions: str, levels: Sequence[str]) -> Question:
        """Rate on ``levels``, described lowest first."""
        return cls.of({"type": "score", "instructions": instructions, "criteria": levels})

    @classmethod
    def of(cls, value: object, name: str = "question") -> Question:
        """A question from its System One dict ``{"type", "instructions", "criteria"}``.

        Raises:
            InvalidRequest: a missing or unknown field, a wrong type, too many or too few
                options, a label used twice, or too much text.
        """
        if isinstance(value, Question):  # made directly, unchecked: check it as its dict
            value = {"type": value.type, "instructions": value.instructions, "criteria": _criteria(value)}
        _require(isinstance(value, Mapping), f"{name} must be a dict with type, instructions, criteria")
        assert isinstance(value, Mapping)
        for key in value:
            _require(
                key in _QUESTION_KEYS,
                f"{name} has an unknown field {_show(key)} (a question has {', '.join(_QUESTION_KEYS)})",
            )
        kind = value.get("type")
        _require(
            isinstance(kind, str) and kind in QUESTION_TYPES,
            f"{name}.type must be one of {', '.join(QUESTION_TYPES)}, got {_show(kind)}",
        )
        _require(value.get("instructions") is not None, f"{name}.instructions is required")
        budget = [MAX_QUESTION_CHARS]
        instructions = _text(f"{name}.instructions", value["instructions"], budget)
        _require(instructions.strip() != "", f"{name}.instructions must not be empty")
        criteria = value.get("criteria")
        if kind == "noul":
            return cls("noul", instructions, ("true", "false"), _noul(name, criteria, budget))
        if kind == "choice":
            options, descriptions = _choice(name, criteria, budget)
            return cls("choice", instructions, options, descriptions)
        levels = _levels(name, criteria, budget)
        return cls("score", instructions, tuple(str(i) for i in range(len(levels))), levels)


def _noul(name: str, criteria: object, budget: list[int]) -> tuple[str | None, ...]:
    if criteria is None:
        return (None, None)
    _require(isinstance(criteria, Mapping), f"{name}.criteria of a noul must be a dict with true and false")
    assert isinstance(criteria, Mapping)
    for key in criteria:
        _require(
            key in ("true", "false"), f"{name}.criteria of a noul takes true and false, got {_show(key)}"
        )
    return tuple(
        None if criteria.get(k) is None else _text(f"{name}.criteria.{k}", criteria[k], budget)
        for k in ("true", "false")
    )


def _choice(name: str, criteria: object, budget: list[int]) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    _require(
        isinstance(criteria, Mapping | list | tuple),
        f"{name}.criteria of a choice must map each option to its description (or null)",
    )
    assert isinstance(criteria, Mapping | list | tuple)
    count = len(criteria)
    _require(
        2 <= count <= MAX_OPTIONS,
        f"a choice has 2 to {MAX_OPTIONS} options (each is read as one letter, A to Z), {name} has {count}",
    )
    pairs = list(criteria.items()) if isinstance(criteria, Mapping) else [(label, None) for label in criteria]
    options: list[str] = []
    descriptions: list[str | None] = []
    for label, description in pairs:
        label = checked_text(f"an option of {name}", label, MAX_ID_LENGTH)
        _require(label.strip() != "", f"{name} has an empty option label")
        _require(label not in options, f"{name} has the option {label!r} twice")
        budget[0] -= len(label)
        options.append(label)
        descriptions.append(
            None if description is None else _text(f"{name}.criteria[{label!r}]", description, budget)
        )
    _require(budget[0] >= 0, f"a question's texts may have at most {MAX_QUESTION_CHARS} characters in all")
    return tuple(options), tuple(descriptions)


def _levels(name: str, criteria: object, budget: list[int]) -> tuple[str | None, ...]:
    _require(
        isinstance(criteria, list | tuple),
        f"{name}.criteria of a score must be a list of level descriptions, lowest first",
    )
    assert isinstance(criteria, list | tuple)
    _require(
        2 <= len(criteria) <= MAX_LEVELS,
        f"a score has 2 to {MAX_LEVELS} levels (each is read as one digit), {name} has {len(criteria)}",
    )
    levels = tuple(_text(f"{name}.criteria[{i}]", level, budget) for i, level in enumerate(criteria))
    _require(all(level.strip() for level in levels), f"{name} has an empty level description")
    return levels


def _state(state: object) -> str:
    """The state as the text the model reads: a string as it is, JSON as compact JSON."""
    if isinstance(state, str):
        text = checked_text("state", state, MAX_PROMPT_CHARS)
        _require(text.strip() != "", "state must not be empty")
        return text
    _require(
        isinstance(state, Mapping | list | tuple),
        f"state must be text or a JSON object or list, got {type(state).__name__}",
    )
    assert isinstance(state, Mapping | list | tuple)
    return checked_text("state", _json_text("state", state), MAX_PROMPT_CHARS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decide:
    """Answer ``questions`` about ``state``: ``ref.ask(Decide(...))`` gives a future of
    the ``Decision``; the helpers ``decide()`` and ``adecide()`` wait for it.

    Attributes:
        state: text, or a JSON object or list (stored as its compact JSON text).
        questions: names to questions: :class:`Question`\\ s or their System One dicts
            ``{"type": "noul" | "choice" | "score", "instructions", "criteria"}``; 1 to
            ``MAX_QUESTIONS``. Stored as a frozen mapping of :class:`Question`.
        template_kwargs: the chat template's variables (``chat_template_kwargs``).
            Thinking is off (``enable_thinking=False``) unless these turn it on; a
            template that then opens a thinking block before the answer is refused.
        request_id, model, priority, deadline_s, cache_scope, cache_prompt, lora: as on
            the generation messages.
    """

    state: Any = field(kw_only=False)
    questions: Mapping[str, Any] = field(kw_only=False)
    request_id: str = field(default_factory=_new_id)
    model: str | None = None
    template_kwargs: Mapping[str, Any] | None = None
    priority: int = 0
    deadline_s: float | None = None
    cache_scope: str | None = None
    cache_prompt: bool = True
    lora: LoraScales | None = None

    def __post_init__(self) -> None:
        questions = self.questions
        _require(isinstance(questions, Mapping), "questions must be a dict of names to questions")
        _require(
            1 <= len(questions) <= MAX_QUESTIONS,
            f"a decision asks 1 to {MAX_QUESTIONS} questions, got {len(questions)}",
        )
        checked: dict[str, Question] = {}
        for key, value in tuple(questions.items()):
            name = checked_text("a question's name", key, MAX_ID_LENGTH)
            _require(name != "", "a question's name must be a non-empty str")
            checked[name] = Question.of(value, f"questions[{name!r}]")
        object.__setattr__(self, "questions", MappingProxyType(checked))
        object.__setattr__(self, "state", _state(self.state))
        object.__setattr__(self, "request_id", checked_request_id(self.request_id))
        for name in ("model", "cache_scope"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, checked_text(name, value, MAX_ID_LENGTH))
        _require(self.model != "", "model must be a non-empty str (a model's name) or None")
        if self.template_kwargs is not None:
            object.__setattr__(self, "template_kwargs", checked_template_kwargs(self.template_kwargs))
        _require(
            is_int(self.priority) and abs(self.priority) < 2**63,
            f"priority must be an int, got {_show(self.priority)}",
        )
        object.__setattr__(self, "deadline_s", checked_deadline(self.deadline_s))
        _require(isinstance(self.cache_prompt, bool), "cache_prompt must be a bool")
        object.__setattr__(self, "lora", checked_lora(self.lora))

    # What routing reads of every request (a ServerPool's router, the engine's table).
    @property
    def n(self) -> int:
        """One outcome: the ``Decision`` or an error."""
        return 1

    @property
    def session(self) -> None:
        """A decision belongs to no session."""
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable for Ray replicas: plain values, checked again on the other side.
        questions = {
            name: {"type": q.type, "instructions": q.instructions, "criteria": _criteria(q)}
            for name, q in self.questions.items()
        }
        variables = None if self.template_kwargs is None else template_variables(self.template_kwargs)
        kwargs = {
            "request_id": self.request_id, "model": self.model, "template_kwargs": variables,
            "priority": self.priority, "deadline_s": self.deadline_s,
            "cache_scope": self.cache_scope, "cache_prompt": self.cache_prompt,
            "lora": None if self.lora is None else dict(self.lora),
        }  # fmt: skip
        return (_rebuild, (self.state, questions, kwargs))


def _criteria(question: Question) -> Any:
    if question.type == "noul":
        return {k: v for k, v in zip(question.options, question.descriptions, strict=True) if v is not None}
    if question.type == "choice":
        return dict(zip(question.options, question.descriptions, strict=True))
    return list(question.descriptions)


def _rebuild(state: str, questions: dict[str, Any], kwargs: dict[str, Any]) -> Decide:
    return Decide(state, questions, **kwargs)


@dataclass(frozen=True, slots=True)
class Answer:
    """One question's answer (the wire's fields as attributes).

    Attributes:
        type: the question's type.
        probabilities: each option's probability, in the order given (a noul's are
            ``"true"`` and ``"false"``; a score's ``"0"`` to ``"n-1"``).
        confidence: 1 when one option has all the mass, 0 when it is spread evenly.
        option_mass: the share of the next-token probability on the offered labels.
        noul: a noul's probability that it holds, else None.
        choice: a choice's likeliest option, else None.
        score: a score's expected level from 0, else None.
    """

    type: QuestionType
    probabilities: Mapping[str, float]
    confidence: float
    option_mass: float
    noul: float | None = None
    choice: str | None = None
    score: float | None = None

    @classmethod
    def read(cls, question: Question, logprobs: Sequence[float]) -> Answer:
        """The answer that the labels' log-probabilities (over the whole vocabulary, in
        the order of ``question.options``) give; pure, any thread."""
        n = len(question.options)
        assert len(logprobs) == n >= 2
        top = max(logprobs)
        # No mass at all on the labels: uniform, as option_mass 0 says.
        weights = [1.0] * n if top == -math.inf else [math.exp(lp - top) for lp in logprobs]
        total = sum(weights)
        p = [w / total for w in weights]
        mass = math.fsum(math.exp(lp) for lp in logprobs)
        best = max(range(n), key=lambda i: (p[i], -i))  # the first of equals
        probabilities = MappingProxyType(dict(zip(question.options, p, strict=True)))
        option_mass = min(mass, 1.0)
        if question.type == "score":
            spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
            distance = sum(p[i] * abs(i - best) for i in range(n))
            confidence = max(0.0, 1.0 - distance / spread)
            score = math.fsum(i * p[i] for i in range(n))
            return cls("score", probabilities, confidence, option_mass, score=score)
        confidence = min(1.0, max(0.0, (n * p[best] - 1) / (n - 1)))
        if question.type == "noul":
            return cls("noul", probabilities, confidence, option_mass, noul=p[0])
        return cls("choice", probabilities, confidence, option_mass, choice=question.options[best])


@dataclass(frozen=True, slots=True)
class Decision:
    """What a ``Decide`` gets back.

    Attributes:
        request_id: the request's id.
        answers: the questions' names to their :class:`Answer`, in the order asked.
        prompt_tokens: the tokens the model read: the state once, then each question's
            own part (a question's prompt shares the state's cells).
        cached_tokens: of those, how many a cache held already (not computed).
        duration_ms: from admission to the last answer.
    """

    request_id: str
    answers: Mapping[str, Answer]
    prompt_tokens: int
    cached_tokens: int
    duration_ms: float


# A keyword the constructor does not take names the option it likely meant.
suggesting(
    Decide, "Decide()", {"id": "request_id", "chat_template_kwargs": "template_kwargs", "input": "state"}
)
