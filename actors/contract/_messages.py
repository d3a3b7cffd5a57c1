"""Messages that cross the actor boundary: frozen dataclasses, checked on creation.

Every check that needs no model runs in ``__post_init__``, in the caller's thread,
and raises ``InvalidRequest``; checks that need the model (token ids against the
vocabulary, the prompt against the context, the grammar) run at admission in the
actor thread. The value checks themselves live in ``actors.contract._checks``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from actors.contract._checks import (
    _INT64_MAX,
    MAX_CHOICES,
    MAX_ID_LENGTH,
    MAX_LOGPROBS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    _check_prompt,
    _check_reply_to,
    _checked_bias,
    _checked_sampling,
    _checked_schema,
    _require,
    _show,
    checked_deadline,
    checked_request_id,
    checked_template_kwargs,
    checked_text,
    checked_tokens,
    is_int,
)
from actors.contract._lora import LoraScales, checked_lora
from actors.contract._names import REQUEST_ALIASES, suggesting
from actors.contract._sampling import ReplyTo, SamplingParams
from actors.contract._tools import REASONING_FORMATS, checked_chat, checked_tool_choice, checked_tools

__all__ = [
    "Chat",
    "Generate",
    "GenerateTokens",
    "RequestMessage",
    "Stream",
    "StreamChat",
    "StreamTokens",
]


def _new_id() -> str:
    return uuid.uuid4().hex


def _thaw(value: Any) -> Any:
    # MappingProxyType does not pickle: every one, however deep, becomes a dict (and a
    # tuple holding one a list); the constructor on the other side freezes them again.
    if isinstance(value, MappingProxyType):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        thawed = [_thaw(v) for v in value]
        return thawed if any(t is not v for t, v in zip(thawed, value, strict=True)) else value
    return value


def _rebuild(cls: type[Any], values: dict[str, Any]) -> Any:
    return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class _RequestMessage:
    """Options shared by every request message (all keyword-only)."""

    max_tokens: int = 256
    request_id: str = field(default_factory=_new_id)
    logit_bias: Mapping[int, float] | None = None
    temp: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    penalty_last_n: int | None = None
    penalty_repeat: float | None = None
    penalty_freq: float | None = None
    penalty_present: float | None = None
    grammar: str | None = None
    json_schema: Mapping[str, Any] | None = None
    stop: str | Sequence[str] | None = None
    """Strings that end the text when it contains one (a single string is one stop)."""
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    post_sampling_probs: bool = False
    cache_scope: str | None = None
    session: str | None = None
    cache_prompt: bool = True
    n: int = 1
    truncate: bool = False
    n_keep: int = 0
    deadline_s: float | None = None
    priority: int = 0
    speculate: bool = True
    model: str | None = None
    """The model to run it: a ``ModelManager`` routes by it; a single engine ignores it."""
    lora: LoraScales | None = None
    """The LoRA adapters to run it with: adapter id or name → scale (``{"tenant-a": 1.0}``),
    or llama-server's ``[{"id": 0, "scale": 0.5}]``; those not named are off. None: the
    server's default scales. Stored as a frozen mapping."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a ServerPool sends requests to Ray replicas): frozen mappings are
        # rebuilt from plain dicts, and every check runs again on the other side.
        return (_rebuild, (type(self), {f.name: _thaw(getattr(self, f.name)) for f in fields(self)}))

    def _check_options(self) -> None:
        _require(
            is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {_show(self.max_tokens)}",
        )
        self._set("request_id", checked_request_id(self.request_id))
        for f in fields(SamplingParams):
            self._set(f.name, _checked_sampling(f.name, getattr(self, f.name)))
        if self.logit_bias is not None:
            self._set("logit_bias", MappingProxyType(_checked_bias(self.logit_bias)))
        if self.json_schema is not None:
            _require(isinstance(self.json_schema, Mapping), "json_schema must be a dict (a JSON Schema)")
            _require(self.grammar is None, "give json_schema or grammar, not both")
            _require(
                not self.ignore_eos,
                "json_schema with ignore_eos can never end: the document is complete only at "
                "end-of-generation, which ignore_eos bans",
            )
            self._set("json_schema", MappingProxyType(_checked_schema(self.json_schema)))
        if isinstance(self.stop, str):  # one stop string, as OpenAI takes it
            self._set("stop", (self.stop,))
        if self.stop is not None:
            _require(
                isinstance(self.stop, Sequence) and not isinstance(self.stop, bytes),
                "stop must be a string or a list of strings",
            )
            _require(len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings")
            stops = tuple(checked_text("a stop string", s, MAX_STOP_LENGTH) for s in self.stop)
            _require(all(stops), "stop strings must be non-empty")
            self._set("stop", stops)
        _require(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an int >= 0")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos must be a bool")
        _require(isinstance(self.cache_prompt, bool), "cache_prompt must be a bool")
        _require(
            is_int(self.n) and 1 <= self.n <= MAX_CHOICES,
            f"n (completions of the prompt) must be an int from 1 to {MAX_CHOICES}, got {_show(self.n)}",
        )
        for name in ("cache_scope", "session", "model"):
            value = getattr(self, name)
            if value is not None:
                self._set(name, checked_text(name, value, MAX_ID_LENGTH))
        _require(self.model != "", "model must be a non-empty str (a model's name) or None")
        _require(isinstance(self.truncate, bool), "truncate must be a bool")
        _require(isinstance(self.speculate, bool), f"speculate must be a bool, got {_show(self.speculate)}")
        self._set("deadline_s", checked_deadline(self.deadline_s))
        self._set("lora", checked_lora(self.lora))
        _require(is_int(self.priority), f"priority must be an int, got {_show(self.priority)}")
        _require(is_int(self.n_keep) and self.n_keep >= 0, "n_keep must be an int >= 0")
        for name in ("max_tokens", "min_tokens", "n_keep", "priority"):
            value = getattr(self, name)
            _require(-_INT64_MAX <= value <= _INT64_MAX, f"{name} must fit 64 bits, got {_show(value)}")
        if self.logprobs is not None:
            _require(
                is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be an int within [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}",
            )
        _require(isinstance(self.post_sampling_probs, bool), "post_sampling_probs must be a bool")
        _require(
            not self.post_sampling_probs or self.logprobs is not None,
            "post_sampling_probs needs logprobs: it says which probabilities they are",
        )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @property
    def mode(self) -> Literal["generate", "stream"]:
        """``"stream"`` for messages with a ``reply_to``, else ``"generate"``."""
        return "stream" if hasattr(self, "reply_to") else "generate"


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate(_RequestMessage):
    """Complete ``prompt``; ``ref.ask()`` returns a Future of the ``Completion``."""

    prompt: str = field(kw_only=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _check_prompt(self.prompt))
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateTokens(_RequestMessage):
    """Complete a prompt given as token ids; the ask returns a Future."""

    tokens: Sequence[int] = field(kw_only=False)  # stored as a tuple

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", checked_tokens(self.tokens))
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream(_RequestMessage):
    """Complete ``prompt``: ``Token`` events, then one ``Done`` or ``Failed``, on ``reply_to``."""

    prompt: str = field(kw_only=False)
    reply_to: ReplyTo
    progress: bool = False
    """Also send ``Progress`` events while the prompt is prefilled: one when the request
    enters a slot, then one after each prefill chunk, before the first ``Token``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _check_prompt(self.prompt))
        _check_stream(self)
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamTokens(_RequestMessage):
    """Like ``Stream`` for a prompt given as token ids."""

    tokens: Sequence[int] = field(kw_only=False)  # stored as a tuple
    reply_to: ReplyTo
    progress: bool = False
    """As ``Stream.progress``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", checked_tokens(self.tokens))
        _check_stream(self)
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Chat(_RequestMessage):
    """Complete a conversation rendered with the chat template; ``ask`` returns a Future.

    A conversation that ends with an assistant message is a prefill: the reply continues
    that message (its text is not repeated in the ``Completion``).
    """

    messages: Sequence[Mapping[str, Any]] = field(kw_only=False)  # stored as a tuple
    parse_special: bool = False
    """Let special-token text in message content (``<|im_start|>``) become special tokens;
    by default content is text, and special tokens come only from the template."""
    template_kwargs: Mapping[str, Any] | None = None
    """Variables for the chat template's render (llama.cpp's ``chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``), over the server's ``chat_template_kwargs``: names are
    identifiers, values JSON (at most ``MAX_TEMPLATE_KWARGS_BYTES`` of it, nested at most
    ``MAX_TEMPLATE_KWARGS_DEPTH`` deep); stored as a frozen copy."""
    add_generation_prompt: bool = True
    """Open the assistant's turn after the messages (the template's
    ``add_generation_prompt``); False renders the chat as it is, and the reply continues
    from there. A final assistant message is a prefill either way."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """Functions the reply may call: OpenAI function tools, ``{"type": "function",
    "function": {"name", "description", "parameters"}}`` (at most ``MAX_TOOLS``; names
    unique). The chat template describes them as the model was trained; a template that
    knows no tools gets the generic format (see the tool-calls guide). Stored frozen."""
    tool_choice: str | Mapping[str, Any] | None = None
    """``"auto"`` (the default: the reply may call tools or answer), ``"none"`` (it
    answers; tools are still described), ``"required"`` (it must call at least one), or
    ``{"type": "function", "function": {"name": ...}}`` (it must call that one).
    ``"required"`` and a named function are enforced by a grammar."""
    parallel_tool_calls: bool = True
    """Whether one reply may make several calls (where the format can write several)."""
    reasoning_format: str | None = None
    """``"auto"`` or ``"deepseek"``: thinking (``<think>...</think>`` and the like) goes to
    ``Completion.reasoning``; ``"none"``: it stays in the text. None is the server's
    default (``"auto"`` unless it was started otherwise)."""
    reasoning_budget: int | None = None
    """The most tokens the reply may think (None: no bound): past it the thinking is
    closed for the model (``reasoning_budget_message``, then the format's end marker)
    and the reply goes on to its answer. 0 turns thinking off where the template can
    (``enable_thinking``), and closes it at once where it opens it anyway."""
    reasoning_budget_message: str | None = None
    """Text written into the thinking when its budget ends, before the end marker
    (e.g. "Time to answer."); None writes only the marker."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", checked_chat(self.messages))
        _check_chat_options(self)
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamChat(_RequestMessage):
    """Like ``Chat``, streaming ``Token`` events then one ``Done``/``Failed`` to ``reply_to``."""

    messages: Sequence[Mapping[str, Any]] = field(kw_only=False)  # stored as a tuple
    reply_to: ReplyTo
    parse_special: bool = False
    """As ``Chat.parse_special``."""
    template_kwargs: Mapping[str, Any] | None = None
    """As ``Chat.template_kwargs``."""
    add_generation_prompt: bool = True
    """As ``Chat.add_generation_prompt``."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """As ``Chat.tools``."""
    tool_choice: str | Mapping[str, Any] | None = None
    """As ``Chat.tool_choice``."""
    parallel_tool_calls: bool = True
    """As ``Chat.parallel_tool_calls``."""
    reasoning_format: str | None = None
    """As ``Chat.reasoning_format``."""
    reasoning_budget: int | None = None
    """As ``Chat.reasoning_budget``."""
    reasoning_budget_message: str | None = None
    """As ``Chat.reasoning_budget_message``."""
    progress: bool = False
    """As ``Stream.progress``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", checked_chat(self.messages))
        _check_chat_options(self)
        _check_stream(self)
        _RequestMessage._check_options(self)


def _check_stream(message: Stream | StreamTokens | StreamChat) -> None:
    """The options only streams have: where the events go, and whether progress too."""
    _check_reply_to(message.reply_to)
    _require(isinstance(message.progress, bool), f"progress must be a bool, got {_show(message.progress)}")


def _check_chat_options(message: Chat | StreamChat) -> None:
    _require(isinstance(message.parse_special, bool), "parse_special must be a bool")
    _require(
        isinstance(message.add_generation_prompt, bool),
        f"add_generation_prompt must be a bool, got {_show(message.add_generation_prompt)}",
    )
    if message.template_kwargs is not None:
        object.__setattr__(message, "template_kwargs", checked_template_kwargs(message.template_kwargs))
    tools = None
    if message.tools is not None and not (
        isinstance(message.tools, list | tuple) and len(message.tools) == 0
    ):
        tools = checked_tools(message.tools)
    object.__setattr__(message, "tools", tools)
    object.__setattr__(message, "tool_choice", checked_tool_choice(message.tool_choice, tools))
    _require(
        isinstance(message.parallel_tool_calls, bool),
        f"parallel_tool_calls must be a bool, got {_show(message.parallel_tool_calls)}",
    )
    _require(
        message.reasoning_format is None
        or (isinstance(message.reasoning_format, str) and message.reasoning_format in REASONING_FORMATS),
        f"reasoning_format must be one of {sorted(REASONING_FORMATS)} or None, "
        f"got {_show(message.reasoning_format)}",
    )
    if message.reasoning_budget is not None:
        _require(
            is_int(message.reasoning_budget) and 0 <= message.reasoning_budget <= _INT64_MAX,
            f"reasoning_budget must be an int >= 0 (tokens) or None, got {_show(message.reasoning_budget)}",
        )
        _require(
            message.reasoning_format != "none",
            "reasoning_budget counts the thinking the reply splits out: "
            "it cannot go with reasoning_format 'none'",
        )
    if message.reasoning_budget_message is not None:
        object.__setattr__(
            message,
            "reasoning_budget_message",
            checked_text("reasoning_budget_message", message.reasoning_budget_message, MAX_STOP_LENGTH * 4),
        )
    if tools is not None and message.tool_choice != "none":
        _require(
            message.grammar is None,
            "a chat with tools cannot take a grammar too: the tools' grammar constrains the reply",
        )
        _require(
            message.json_schema is None or message.tool_choice == "auto",
            "json_schema with tools constrains the answer, which tool_choice 'required' or a "
            "named function rules out",
        )


SubmitMessage = Generate | GenerateTokens | Chat
"""The requests answered with a future of their Completion (sent with ``ask``)."""
StreamMessage = Stream | StreamTokens | StreamChat
"""The requests answered event by event on their ``reply_to``."""
RequestMessage = SubmitMessage | StreamMessage
STREAMING = (Stream, StreamTokens, StreamChat)


# A keyword the constructor does not take names the option it likely meant.
for _message in (Generate, GenerateTokens, Stream, StreamTokens, Chat, StreamChat):
    suggesting(_message, f"{_message.__name__}()", REQUEST_ALIASES, " (see docs/reference/requests.md)")
