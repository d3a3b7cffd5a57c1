"""The values of ``ServerActor``'s start options, each checked on its own (the
caller's thread): llama.cpp's limits as constants, and a checker per kind of value.
Why each bound is what it is: :mod:`actors.actor._options`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from actors.backend import check_chat_template
from actors.contract import ConfigError, InvalidRequest, SamplingParams, checked_template_kwargs

__all__ = [
    "KV_CACHE_TYPES",
    "MAX_CHAT_TEMPLATE_CHARS",
    "MAX_DRAFT",
    "MAX_NAME_LENGTH",
    "MAX_N_CTX",
    "MAX_N_PARALLEL",
    "MAX_N_THREADS",
    "MAX_PROMPT_CACHE_RAM_MB",
    "host_ram_mb",
]

MAX_N_PARALLEL = 256
"""Sequences per context at most: llama.cpp's ``LLAMA_MAX_SEQ``."""
MAX_N_THREADS = 512
"""Threads at most: ggml's ``GGML_MAX_N_THREADS`` (its CPU masks have this many entries)."""
MAX_N_CTX = 2**31 - 256
"""Context cells (and ``n_batch``, ``n_ubatch``) at most: positions are ``int32`` and
llama.cpp pads ``n_ctx`` up to a multiple of 256 in a ``uint32``."""
MAX_PROMPT_CACHE_RAM_MB = 2**40
"""The RAM prompt cache budget at most (an exabyte), and at most :func:`host_ram_mb`."""
MAX_NAME_LENGTH = 256
"""Characters in a server's ``name`` at most (it labels telemetry and log lines)."""
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024
"""Characters in a custom ``chat_template`` at most (256 Ki; real ones are a few KiB).

A template is Jinja2: its loops run for every chat, in the caller's thread, unbounded
by the sandbox. It is the operator's option, never a caller's, so its size is bound
and its syntax checked here, and the rest is trusted."""
KV_CACHE_TYPES = MappingProxyType(
    {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 20: "iq4_nl", 6: "q5_0", 7: "q5_1"}
)
"""The ``type_k``/``type_v`` values allowed, ``llama_cpp.GGML_TYPE_*`` id -> ggml name:
llama.cpp's own list of KV cache types; every other id aborts or is refused."""
_FLOAT_KV_TYPES = frozenset({0, 1, 30})
_INT32_MAX = 2**31 - 1
_SAMPLING_INTS = ("top_k", "penalty_last_n", "seed")
_SAMPLING_FLOATS = ("temp", "top_p", "min_p", "penalty_repeat", "penalty_freq", "penalty_present")


def _show(value: object) -> str:
    """A short description of a caller's value for an error message (any thread).

    ``repr`` of an int over 4300 digits raises ``ValueError``, and a caller's object
    may have a ``__repr__`` that raises: neither may turn a ``ConfigError`` into
    something else.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def _int(name: str, value: object, low: int, high: int | None, why: str = "") -> int:
    """``value`` as a plain int within ``[low, high]`` (bools are not ints here)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {_show(value)}{why}")
    number = int.__int__(value)  # a plain int even from a subclass
    if high is None and number < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {_show(number)}{why}")
    if high is not None and not low <= number <= high:
        raise ConfigError(f"{name} must be within [{low}, {high}], got {_show(number)}{why}")
    return number


def _optional_int(name: str, value: object, low: int, high: int, why: str = "") -> int | None:
    return None if value is None else _int(name, value, low, high, why)


def _flag(name: str, value: object) -> bool:
    # bool(x) would read "no", 0.0 or [] as a choice; ints too easily mean something else.
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {_show(value)}")
    return value


def _model_path(value: object, name: str = "model_path") -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        path = str.__getitem__(value, slice(None))
    elif isinstance(value, os.PathLike):
        try:
            path = os.fspath(value)
        except Exception as e:  # a caller's __fspath__
            raise ConfigError(f"{name} could not be read as a path: {e!r}") from None
        if not isinstance(path, str):
            raise ConfigError(f"{name} must be a str path, got {type(path).__name__}")
    else:
        raise ConfigError(f"{name} must be a str or os.PathLike (or None), got {_show(value)}")
    return _checked_path(path, name)


def _checked_path(path: str, name: str = "model_path") -> str:
    """``path`` if llama.cpp can be given it: UTF-8 (any thread).

    A file name that is not UTF-8 comes from ``os.listdir`` with lone surrogates in it,
    and encoding it for llama.cpp would fail in the actor thread instead of here.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} {_show(path)} is not valid UTF-8") from None
    return path


def _kv_type(name: str, value: object) -> int | None:
    if value is None:
        return None
    allowed = ", ".join(f"{i} ({n})" for i, n in KV_CACHE_TYPES.items())
    if not isinstance(value, int) or isinstance(value, bool) or value not in KV_CACHE_TYPES:
        raise ConfigError(
            f"{name} must be one of llama.cpp's KV cache types (llama_cpp.GGML_TYPE_*): "
            f"{allowed}; got {_show(value)}"
        )
    return int.__int__(value)


def _name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"name must be a non-empty str or None, got {_show(value)}")
    text = str.__getitem__(value, slice(None))
    if len(text) > MAX_NAME_LENGTH:
        raise ConfigError(f"name may have at most {MAX_NAME_LENGTH} characters, got {len(text)}")
    # It lands in log lines and telemetry labels: a newline could forge a log line,
    # a lone surrogate would fail wherever it is encoded.
    if not text.isprintable():
        raise ConfigError(f"name must be printable (no control characters), got {_show(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"name is not valid Unicode (a lone surrogate): {_show(text)}") from None
    return text


def _chat_template(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"chat_template must be a non-empty str of Jinja2 (or None), got {_show(value)}")
    text = str.__getitem__(value, slice(None))
    if len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ConfigError(
            f"chat_template may have at most {MAX_CHAT_TEMPLATE_CHARS} characters, got {len(text)}"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("chat_template is not valid Unicode (a lone surrogate)") from None
    check_chat_template(text)  # a syntax error is a ConfigError now, not every chat's later
    return text


def _chat_template_kwargs(value: object) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    try:
        return checked_template_kwargs(value, "chat_template_kwargs")
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


def host_ram_mb() -> float:
    """This machine's physical memory in MiB, or ``MAX_PROMPT_CACHE_RAM_MB`` where the
    OS does not say (any thread)."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / 2**20
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return float(MAX_PROMPT_CACHE_RAM_MB)


def _megabytes(value: object) -> float:
    name = "prompt_cache_ram_mb"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number >= 0, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise ConfigError(f"{name} is too large: {_show(value)}") from None
    if not 0 <= number <= MAX_PROMPT_CACHE_RAM_MB:  # False for NaN
        raise ConfigError(f"{name} must be within [0, {MAX_PROMPT_CACHE_RAM_MB}], got {_show(value)}")
    # The cache fills up to its budget: a budget past the machine's memory is no budget,
    # and the host would swap or be killed for memory before the cache evicts anything.
    ram = host_ram_mb()
    if number > ram:
        raise ConfigError(f"{name} ({number:g}) is more than this machine's memory ({ram:.0f} MiB)")
    return number


MAX_DRAFT = 256
"""``draft_max`` at most: draft tokens one slot may have verified in one tick."""


def _speculation(
    spec_type: object, draft_max: object, draft_min: object, draft_model_path: object, draft_p_min: object
) -> tuple[str | None, int, int, str | None, float]:
    if spec_type is not None and spec_type not in ("ngram", "draft"):
        raise ConfigError(f"spec_type must be None (off), 'ngram' or 'draft', got {_show(spec_type)}")
    draft_max = _int("draft_max", draft_max, 1, MAX_DRAFT)
    draft_min = _int("draft_min", draft_min, 0, MAX_DRAFT)
    if draft_min > draft_max:
        raise ConfigError(
            f"draft_min ({draft_min}) must be at most draft_max ({draft_max}): no draft could be verified"
        )
    if spec_type is None and draft_min != 0:  # never silently ignored
        raise ConfigError("draft_min is for speculative decoding: pass spec_type too")
    path = _model_path(draft_model_path, "draft_model_path")
    if spec_type == "draft" and path is None:
        raise ConfigError(
            "spec_type='draft' needs draft_model_path: a smaller model with the same vocabulary"
        )
    if spec_type != "draft" and path is not None:
        raise ConfigError("draft_model_path is for spec_type='draft'")
    if (
        not isinstance(draft_p_min, int | float)
        or isinstance(draft_p_min, bool)
        or not 0.0 <= draft_p_min <= 1.0  # False for NaN
    ):
        raise ConfigError(f"draft_p_min must be a number within [0, 1], got {_show(draft_p_min)}")
    if spec_type != "draft" and draft_p_min != 0.0:  # never silently ignored
        raise ConfigError("draft_p_min is for spec_type='draft' (a draft model's confidence)")
    return spec_type, draft_max, draft_min, path, float(draft_p_min)


def _sampling(values: dict[str, object]) -> SamplingParams:
    for name in (*_SAMPLING_INTS, *_SAMPLING_FLOATS):
        value = values[name]
        # SamplingParams would put a 4300-digit int in its message, and that raises.
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1023:
            raise ConfigError(f"{name} is out of range: {_show(value)}")
    try:
        return SamplingParams(**values)  # type: ignore[arg-type]  # checked by it
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
