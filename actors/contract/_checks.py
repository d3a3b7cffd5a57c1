"""The value checks request messages run in their constructors, in the caller's thread.

Each takes what a caller passed, refuses it with ``InvalidRequest`` (a message that
names the field and shows the value, briefly), or returns it normalized: a plain
``str`` that encodes to UTF-8, a finite ``float``, a tuple of token ids, a private copy
of a JSON Schema, frozen chat messages. The limits below bound what a request may ask
for before any of it reaches the actor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from actors.contract._errors import InvalidRequest
from actors.contract._gbnf import check_grammar
from actors.contract._gbnf_limits import MAX_GRAMMAR_BYTES

__all__ = [
    "MAX_CHAT_MESSAGES",
    "MAX_CHOICES",
    "MAX_ID_LENGTH",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_PROMPT_CHARS",
    "MAX_PROMPT_TOKENS",
    "MAX_SCHEMA_DEPTH",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MAX_TEMPLATE_KWARGS_BYTES",
    "MAX_TEMPLATE_KWARGS_DEPTH",
    "RESERVED_TEMPLATE_NAMES",
    "ROLES",
]

_SEED_MAX = 2**32 - 2  # 2**32 - 1 is LLAMA_DEFAULT_SEED: llama.cpp would draw a random seed
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
"""The most alternatives ``logprobs=k`` may ask for per token."""
MAX_CHOICES = 16
"""The most completions ``n`` one request may ask for."""
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
ROLES = frozenset({"system", "user", "assistant", "tool"})
"""The roles a chat message may have."""
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
"""The JSON text of a chat's ``template_kwargs`` at most, in bytes (64 KiB)."""
MAX_TEMPLATE_KWARGS_DEPTH = 16
"""Lists and dicts nested in one template variable at most."""
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now",
     "functions", "function_call", "tools", "tool_choice"}
)  # fmt: skip
"""Variables the chat formatter sets itself (llama_cpp's ``Jinja2ChatFormatter``):
``template_kwargs`` may not name them."""


def is_int(value: object) -> bool:
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


def checked_text(name: str, value: object, max_length: int) -> str:
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


def checked_request_id(value: object) -> str:
    """A ``request_id``: a non-empty plain ``str`` of at most ``MAX_ID_LENGTH`` characters."""
    request_id = checked_text("request_id", value, MAX_ID_LENGTH)
    _require(request_id != "", "request_id must be a non-empty str")
    return request_id


def checked_deadline(value: object) -> float | None:
    """A ``deadline_s``: None, or a finite number of seconds > 0 (as a float)."""
    if value is None:
        return None
    deadline_s = _checked_float("deadline_s", value)
    _require(deadline_s > 0, f"deadline_s must be a number of seconds > 0, got {_show(value)}")
    return deadline_s


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
        _require(is_int(value), f"{name} must be an int, got {_show(value)}")
        value = int(value)
    elif name == "grammar":
        text = checked_text("grammar", value, MAX_GRAMMAR_BYTES)
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


def _depth(value: object, limit: int) -> int:
    """How deeply dicts and lists nest in a JSON value, counted up to ``limit + 1``.

    Iterative: a value nested deeper than Python's recursion limit (which ``json.loads``
    accepts) must be refused, not raise ``RecursionError``.
    """
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Iterable[object] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((child, depth) for child in children)
    return deepest


def _checked_bias(bias: object) -> dict[int, float]:
    _require(isinstance(bias, Mapping), "logit_bias must be a dict of token id -> bias")
    assert isinstance(bias, Mapping)
    _require(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias may have at most {MAX_LOGIT_BIAS} entries")
    checked: dict[int, float] = {}
    for token, value in bias.items():
        _require(
            is_int(token) and 0 <= token <= _INT32_MAX, f"logit_bias key {_show(token)} is not a token id"
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
    deep = _depth(copy, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH
    _require(not deep, f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return copy


def _check_prompt(prompt: object) -> str:
    text = checked_text("prompt", prompt, MAX_PROMPT_CHARS)
    _require(text != "", "prompt must not be empty")
    return text


def checked_tokens(tokens: object) -> tuple[int, ...]:
    _require(
        isinstance(tokens, Sequence) and not isinstance(tokens, str | bytes),
        "tokens must be a list of token ids",
    )
    assert isinstance(tokens, Sequence)
    _require(len(tokens) > 0, "tokens must not be empty")
    _require(len(tokens) <= MAX_PROMPT_TOKENS, f"tokens may hold at most {MAX_PROMPT_TOKENS} ids")
    checked = tuple(tokens)
    _require(
        not any(isinstance(t, Mapping) for t in checked[:1]),
        "these look like chat messages, not token ids: use chat(ref, messages) or Chat(messages) "
        "(generate() and Generate take a prompt string or token ids)",
    )
    for token in checked:
        _require(
            is_int(token) and 0 <= token <= _INT32_MAX,
            f"token id {_show(token)} is not a non-negative int32",
        )
    return tuple(int(t) for t in checked)


def _check_reply_to(reply_to: object) -> None:
    _require(
        callable(getattr(reply_to, "put", None)),
        "reply_to must have a put() method, e.g. queue.Queue",
    )


def checked_template_kwargs(value: object, name: str = "template_kwargs") -> Mapping[str, Any]:
    """A frozen private copy of a chat template's variables: identifier keys (not a
    name the formatter sets itself) to JSON values, within the size and depth limits.

    Dicts become ``MappingProxyType``s and lists tuples (:func:`template_variables`
    makes plain ones again for each render).
    """
    _require(isinstance(value, Mapping), f"{name} must be a dict of variable name -> JSON value")
    assert isinstance(value, Mapping)
    budget = [MAX_TEMPLATE_KWARGS_BYTES]  # every value costs at least one byte of JSON
    checked: dict[str, Any] = {}
    for key, item in tuple(value.items()):
        _require(
            isinstance(key, str) and str.isidentifier(key) and len(key) <= MAX_ID_LENGTH,
            f"{name} key {_show(key)} is not a variable name (a Python identifier)",
        )
        assert isinstance(key, str)
        key = checked_text(f"{name} key", key, MAX_ID_LENGTH)
        _require(
            key not in RESERVED_TEMPLATE_NAMES,
            f"{name} key {key!r} is set by the chat formatter itself; choose another name",
        )
        checked[key] = _frozen_json(f"{name}[{key!r}]", item, MAX_TEMPLATE_KWARGS_DEPTH, budget)
    try:
        size = len(json.dumps(template_variables(checked), ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as e:  # not expected after the walk: refuse, never crash
        raise InvalidRequest(f"{name} is not JSON: {e}") from None
    _require(
        size <= MAX_TEMPLATE_KWARGS_BYTES,
        f"{name} may have at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {size}",
    )
    return MappingProxyType(checked)


def checked_template_tools(value: object) -> tuple[Mapping[str, Any], ...]:
    """A frozen private copy of the tools a chat template renders (OpenAI's ``tools``: a
    list of JSON objects), within the limits of ``template_kwargs``."""
    _require(
        isinstance(value, Sequence) and not isinstance(value, str | bytes),
        "tools must be a list of JSON objects",
    )
    assert isinstance(value, Sequence)
    frozen = _frozen_json("tools", tuple(value), MAX_TEMPLATE_KWARGS_DEPTH, [MAX_TEMPLATE_KWARGS_BYTES])
    _require(all(isinstance(tool, Mapping) for tool in frozen), "each of tools must be a JSON object")
    size = len(json.dumps(_plain(frozen), ensure_ascii=False).encode("utf-8"))
    _require(
        size <= MAX_TEMPLATE_KWARGS_BYTES,
        f"tools may have at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON, got {size}",
    )
    return tuple(frozen)


def _frozen_json(name: str, value: object, depth: int, budget: list[int]) -> Any:
    """``value`` as a frozen JSON value; walks at most ``budget[0]`` values and
    ``depth`` levels, so a huge or self-containing value is refused early."""
    budget[0] -= 1
    _require(budget[0] >= 0, f"{name} is too large (at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON)")
    if value is None or isinstance(value, bool):
        return value
    if is_int(value):
        assert isinstance(value, int)
        _require(-_INT64_MAX <= value <= _INT64_MAX, f"{name} must fit 64 bits, got {_show(value)}")
        return int(value)
    if isinstance(value, float):
        return _checked_float(name, value)
    if isinstance(value, str):
        text = checked_text(name, value, MAX_TEMPLATE_KWARGS_BYTES)
        budget[0] -= len(text)
        _require(budget[0] >= 0, f"{name} is too large (at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON)")
        return text
    if isinstance(value, list | tuple | Mapping):
        _require(depth > 0, f"{name} nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
    if isinstance(value, list | tuple):
        return tuple(_frozen_json(f"{name}[{i}]", v, depth - 1, budget) for i, v in enumerate(tuple(value)))
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for key, item in tuple(value.items()):
            _require(isinstance(key, str), f"{name} has a key {_show(key)}: JSON object keys are strings")
            key = checked_text(f"a key of {name}", key, MAX_TEMPLATE_KWARGS_BYTES)
            budget[0] -= len(key)
            frozen[key] = _frozen_json(f"{name}[{_show(key)}]", item, depth - 1, budget)
        return MappingProxyType(frozen)
    raise InvalidRequest(
        f"{name} must be a JSON value (None, bool, int, float, str, list, dict), got {type(value).__name__}"
    )


def template_variables(frozen: Mapping[str, Any]) -> dict[str, Any]:
    """Plain dicts and lists again, a fresh copy for one render (any thread): the
    template's ``tojson`` cannot serialize a ``MappingProxyType``."""
    return {key: _plain(value) for key, value in frozen.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
