"""Messages that cross the actor boundary: frozen dataclasses, checked on creation.

Every check that needs no model runs in ``__post_init__``, in the caller's thread,
and raises ``InvalidRequest``; checks that need the model (token ids against the
vocabulary, the prompt against the context, the grammar) run at admission in the
actor thread.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from actors.contract._errors import InvalidRequest
from actors.contract._gbnf import MAX_GRAMMAR_BYTES, check_grammar

if TYPE_CHECKING:
    import pykka

__all__ = [
    "MAX_LOGPROBS",
    "MAX_SCHEMA_DEPTH",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "ROLES",
    "Cancel",
    "Chat",
    "Drain",
    "Generate",
    "GenerateTokens",
    "GetInfo",
    "GetStats",
    "GetTokenizer",
    "ReplyTo",
    "RequestMessage",
    "SamplingParams",
    "Stream",
    "StreamChat",
    "StreamTokens",
]

_SEED_MAX = 2**32 - 2  # 2**32 - 1 is LLAMA_DEFAULT_SEED: llama.cpp would draw a random seed
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
"""The most alternatives ``logprobs=k`` may ask for per token."""
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256
"""Stop strings per request, and characters per stop string, at most."""
MAX_SCHEMA_DEPTH = 32
"""JSON Schemas nested deeper than this are refused (the grammar grows with each level)."""
MAX_PROMPT_CHARS = 16 * 1024 * 1024
"""Characters in a prompt, or in all of a chat's contents, at most (16 Mi)."""
MAX_PROMPT_TOKENS = 1 << 20
"""Token ids in a token prompt at most; the context bounds it further at admission."""
MAX_CHAT_MESSAGES = 10_000
MAX_LOGIT_BIAS = 1 << 18
"""Chat messages, and logit_bias entries, per request at most."""
MAX_ID_LENGTH = 256
"""Characters in a ``request_id``, ``cache_scope`` or ``session`` at most."""
ROLES = frozenset({"system", "user", "assistant"})
"""The roles a chat message may have."""


class ReplyTo(Protocol):
    """Where a stream's events go: anything with ``put()``, e.g. ``queue.Queue``.

    The engine calls ``put_nowait`` when the object has it, else ``put``, from its own
    thread: it must not block. ``queue.Full`` means "not now": the event is held and
    retried (see :mod:`actors.engine._delivery`); any other exception means the consumer is
    gone and the request is cancelled.
    """

    def put(self, item: Any, /) -> Any: ...


def put_nowait(reply_to: ReplyTo, event: object) -> None:
    """Put ``event`` without waiting: ``put_nowait`` when the reply path has it (a full
    bounded queue then raises instead of blocking the engine), else ``put``."""
    put: Callable[[object], object] = getattr(reply_to, "put_nowait", None) or reply_to.put
    put(event)


def _new_id() -> str:
    return uuid.uuid4().hex


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: object) -> str:
    """A short repr of a caller's value for an error message (it may be huge)."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr() fails past 4300 digits
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a caller's __repr__ that raises
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def _checked_text(name: str, value: object, max_length: int) -> str:
    """``value`` as a plain ``str`` that encodes to UTF-8, at most ``max_length`` characters.

    A lone surrogate (``json.loads('"\\ud83d"')`` makes one from an ordinary JSON body)
    would raise ``UnicodeEncodeError`` wherever the text is encoded later: the tokenizer,
    llama.cpp, a log line, an HTTP response.
    """
    _require(isinstance(value, str), f"{name} must be a str, got {type(value).__name__}")
    assert isinstance(value, str)
    text = str.__getitem__(value, slice(None))  # a plain str even from a subclass
    _require(len(text) <= max_length, f"{name} may have at most {max_length} characters, got {len(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{name} is not valid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}"
        ) from None
    return text


def _any_piece(piece: str) -> bool:
    return True


def _checked_float(name: str, value: object) -> float:
    """A finite float; ints are converted (and refused when too large for a float)."""
    _require(_is_number(value), f"{name} must be a finite number, got {_show(value)}")
    assert isinstance(value, int | float)
    try:
        number = float(value)
    except OverflowError:
        raise InvalidRequest(f"{name} is too large: {_show(value)}") from None
    _require(math.isfinite(number), f"{name} must be a finite number, got {_show(value)}")
    return number


def _checked_sampling(name: str, value: Any) -> Any:
    """Check one sampling option and return it normalized; ``None`` (the server's
    default) is always fine."""
    if value is None:
        return None
    if name in ("top_k", "penalty_last_n", "seed"):
        _require(_is_int(value), f"{name} must be an int, got {_show(value)}")
        value = int(value)
    elif name == "grammar":
        text = _checked_text("grammar", value, MAX_GRAMMAR_BYTES)
        _require(text.strip() != "", "grammar must be a non-empty GBNF string")
        # Syntax and cost limits here; a <piece> token is checked against the vocabulary
        # when the request is prepared.
        check_grammar(text, is_single_token=_any_piece)
        return text
    else:
        value = _checked_float(name, value)
    if name == "temp":
        _require(value >= 0, f"temp must be >= 0 (0 is greedy), got {_show(value)}")
    elif name == "top_k":
        _require(
            0 <= value <= _INT32_MAX,
            f"top_k must be within [0, 2**31 - 1] (0 disables it), got {_show(value)}",
        )
    elif name in ("top_p", "min_p"):
        _require(0.0 <= value <= 1.0, f"{name} must be within [0, 1], got {_show(value)}")
    elif name == "seed":
        _require(0 <= value <= _SEED_MAX, f"seed must be within [0, 2**32 - 2], got {_show(value)}")
    elif name == "penalty_last_n":
        _require(
            -1 <= value <= _INT32_MAX,
            f"penalty_last_n must be within [-1, 2**31 - 1] (-1 is the whole context), got {_show(value)}",
        )
    elif name == "penalty_repeat":
        _require(value > 0, f"penalty_repeat must be > 0 (1.0 is off), got {_show(value)}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling options of a request, resolved against the server's defaults.

    ``temp=0`` is greedy; ``seed=None`` draws a fresh random seed per request.
    """

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    grammar: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _checked_sampling(f.name, getattr(self, f.name)))

    def merged(self, overrides: _RequestMessage) -> SamplingParams:
        """These defaults with every option the request sets (not ``None``) replaced."""
        changes = {
            f.name: getattr(overrides, f.name) for f in fields(self) if getattr(overrides, f.name) is not None
        }
        if not changes:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _thaw(value: Any) -> Any:
    if isinstance(value, MappingProxyType):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple) and any(isinstance(v, MappingProxyType) for v in value):
        return [_thaw(v) for v in value]
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
    stop: Sequence[str] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_scope: str | None = None
    session: str | None = None
    truncate: bool = False
    n_keep: int = 0
    deadline_s: float | None = None
    priority: int = 0

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a ServerPool sends requests to Ray replicas): frozen mappings are
        # rebuilt from plain dicts, and every check runs again on the other side.
        return (_rebuild, (type(self), {f.name: _thaw(getattr(self, f.name)) for f in fields(self)}))

    def _check_options(self) -> None:
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {_show(self.max_tokens)}",
        )
        self._set("request_id", _checked_text("request_id", self.request_id, MAX_ID_LENGTH))
        _require(self.request_id != "", "request_id must be a non-empty str")
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
        if self.stop is not None:
            _require(
                isinstance(self.stop, Sequence) and not isinstance(self.stop, str | bytes),
                "stop must be a list of strings",
            )
            _require(len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings")
            stops = tuple(_checked_text("a stop string", s, MAX_STOP_LENGTH) for s in self.stop)
            _require(all(stops), "stop strings must be non-empty")
            self._set("stop", stops)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be an int >= 0")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos must be a bool")
        for name in ("cache_scope", "session"):
            value = getattr(self, name)
            if value is not None:
                self._set(name, _checked_text(name, value, MAX_ID_LENGTH))
        _require(isinstance(self.truncate, bool), "truncate must be a bool")
        if self.deadline_s is not None:
            deadline_s = _checked_float("deadline_s", self.deadline_s)
            _require(
                deadline_s > 0, f"deadline_s must be a number of seconds > 0, got {_show(self.deadline_s)}"
            )
            self._set("deadline_s", deadline_s)
        _require(_is_int(self.priority), f"priority must be an int, got {_show(self.priority)}")
        _require(_is_int(self.n_keep) and self.n_keep >= 0, "n_keep must be an int >= 0")
        for name in ("max_tokens", "min_tokens", "n_keep", "priority"):
            value = getattr(self, name)
            _require(-_INT64_MAX <= value <= _INT64_MAX, f"{name} must fit 64 bits, got {_show(value)}")
        if self.logprobs is not None:
            _require(
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be an int within [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}",
            )

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @property
    def mode(self) -> Literal["generate", "stream"]:
        """``"stream"`` for messages with a ``reply_to``, else ``"generate"``."""
        return "stream" if hasattr(self, "reply_to") else "generate"


def _depth(value: object) -> int:
    """How deeply dicts and lists nest in a JSON value."""
    if isinstance(value, Mapping):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _checked_bias(bias: object) -> dict[int, float]:
    _require(isinstance(bias, Mapping), "logit_bias must be a dict of token id -> bias")
    assert isinstance(bias, Mapping)
    _require(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias may have at most {MAX_LOGIT_BIAS} entries")
    checked: dict[int, float] = {}
    for token, value in bias.items():
        _require(
            _is_int(token) and 0 <= token <= _INT32_MAX, f"logit_bias key {_show(token)} is not a token id"
        )
        # -inf bans a token; NaN and +inf would poison the softmax.
        if _is_number(value) and value == -math.inf:
            checked[int(token)] = -math.inf
        else:
            checked[int(token)] = _checked_float(f"logit_bias[{token}] (a finite number or -inf)", value)
    return checked


def _checked_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A private copy of a JSON Schema made of plain JSON values, or InvalidRequest."""
    try:
        text = json.dumps(schema, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
        copy: dict[str, Any] = json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise InvalidRequest(f"json_schema is not JSON: {e}") from None
    _require(_depth(copy) <= MAX_SCHEMA_DEPTH, f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return copy


def _check_prompt(prompt: object) -> str:
    text = _checked_text("prompt", prompt, MAX_PROMPT_CHARS)
    _require(text != "", "prompt must not be empty")
    return text


def _checked_tokens(tokens: object) -> tuple[int, ...]:
    _require(
        isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes),
        "tokens must be a list of token ids",
    )
    assert isinstance(tokens, Sequence)
    _require(len(tokens) > 0, "tokens must not be empty")
    _require(len(tokens) <= MAX_PROMPT_TOKENS, f"tokens may hold at most {MAX_PROMPT_TOKENS} ids")
    checked = tuple(tokens)
    for token in checked:
        _require(
            _is_int(token) and 0 <= token <= _INT32_MAX,
            f"token id {_show(token)} is not a non-negative int32",
        )
    return tuple(int(t) for t in checked)


def _check_reply_to(reply_to: object) -> None:
    _require(
        callable(getattr(reply_to, "put", None)),
        "reply_to must have a put() method, e.g. queue.Queue",
    )


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
        object.__setattr__(self, "tokens", _checked_tokens(self.tokens))
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stream(_RequestMessage):
    """Complete ``prompt``: ``Token`` events, then one ``Done`` or ``Failed``, on ``reply_to``."""

    prompt: str = field(kw_only=False)
    reply_to: ReplyTo

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _check_prompt(self.prompt))
        _check_reply_to(self.reply_to)
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamTokens(_RequestMessage):
    """Like ``Stream`` for a prompt given as token ids."""

    tokens: Sequence[int] = field(kw_only=False)  # stored as a tuple
    reply_to: ReplyTo

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _checked_tokens(self.tokens))
        _check_reply_to(self.reply_to)
        _RequestMessage._check_options(self)


def _checked_chat(messages: object) -> tuple[Mapping[str, str], ...]:
    _require(
        isinstance(messages, Sequence) and not isinstance(messages, str | bytes),
        "messages must be a list of {'role': ..., 'content': ...} dicts",
    )
    assert isinstance(messages, Sequence)
    _require(len(messages) > 0, "messages must not be empty")
    _require(len(messages) <= MAX_CHAT_MESSAGES, f"a chat may have at most {MAX_CHAT_MESSAGES} messages")
    checked = []
    total = 0
    for message in tuple(messages):
        _require(isinstance(message, Mapping), f"a chat message must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        _require(
            isinstance(role, str) and role in ROLES,
            f"unknown role {_show(role)}; expected one of {sorted(ROLES)}",
        )
        _require(isinstance(content, str), f"a {role} message needs a str content")
        text = _checked_text(f"a {role} message's content", content, MAX_PROMPT_CHARS)
        total += len(text)
        _require(
            total <= MAX_PROMPT_CHARS, f"a chat's contents may have at most {MAX_PROMPT_CHARS} characters"
        )
        checked.append(MappingProxyType({"role": str.__getitem__(role, slice(None)), "content": text}))
    return tuple(checked)


@dataclass(frozen=True, slots=True, kw_only=True)
class Chat(_RequestMessage):
    """Complete a conversation rendered with the model's own chat template; ``ask`` returns a Future."""

    messages: Sequence[Mapping[str, str]] = field(kw_only=False)  # stored as a tuple
    parse_special: bool = False
    """Let special-token text in message content (``<|im_start|>``) become special tokens;
    by default content is text, and special tokens come only from the template."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", _checked_chat(self.messages))
        _require(isinstance(self.parse_special, bool), "parse_special must be a bool")
        _RequestMessage._check_options(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamChat(_RequestMessage):
    """Like ``Chat``, streaming ``Token`` events then one ``Done``/``Failed`` to ``reply_to``."""

    messages: Sequence[Mapping[str, str]] = field(kw_only=False)  # stored as a tuple
    reply_to: ReplyTo
    parse_special: bool = False
    """As ``Chat.parse_special``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", _checked_chat(self.messages))
        _require(isinstance(self.parse_special, bool), "parse_special must be a bool")
        _check_reply_to(self.reply_to)
        _RequestMessage._check_options(self)


SubmitMessage = Generate | GenerateTokens | Chat
"""The requests answered with a future of their Completion (sent with ``ask``)."""
StreamMessage = Stream | StreamTokens | StreamChat
"""The requests answered event by event on their ``reply_to``."""
RequestMessage = SubmitMessage | StreamMessage
STREAMING = (Stream, StreamTokens, StreamChat)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel a queued or running request; unknown ids are ignored."""

    request_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_id", _checked_text("request_id", self.request_id, MAX_ID_LENGTH))


@dataclass(frozen=True, slots=True)
class _CancelExact:
    """Internal: cancel ``request_id`` only if it runs the request admitted from ``message``.

    The helpers cancel their own request with it: a late cancel (an abandoned stream
    iterator collected long after) must not hit a newer request that reuses the id.
    """

    request_id: str
    message: object


@dataclass(frozen=True, slots=True)
class GetStats:
    """Ask for a dict of the engine's current load."""


@dataclass(frozen=True, slots=True)
class GetInfo:
    """Ask for a dict describing the loaded model and context."""


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop taking requests, finish the running and queued ones, then stop the actor.

    ``ref.ask(Drain(timeout=30))`` returns a Future that resolves (to the number of
    requests that were still unfinished and got ``EngineStopped``) once the actor stops.
    """

    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            timeout = _checked_float("Drain timeout", self.timeout)
            _require(timeout >= 0, f"Drain timeout must be >= 0 seconds or None, got {_show(self.timeout)}")
            object.__setattr__(self, "timeout", timeout)


@dataclass(frozen=True, slots=True)
class _Submit:
    """Admit ``message`` (Generate, GenerateTokens or Chat) and complete ``future``.

    Internal: a ``ServerPool`` passes the future it hands to its caller, so it learns
    when the request ends without a thread per request. ``ask`` answers None once admitted.
    """

    message: SubmitMessage
    future: pykka.ThreadingFuture[object]


@dataclass(frozen=True, slots=True)
class GetTokenizer:
    """Ask for an ``actors.Tokenizer`` that tokenizes in the caller's thread."""
