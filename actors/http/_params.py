"""From a request's JSON to the engine's options: llama.cpp's native fields and the
OpenAI ones, with llama-server's meaning, checked for type before the engine's own
checks run (which then give ranges, sizes and combinations their 400).

Runs on the event loop; pure functions of the JSON body and the server's limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.http._errors import HttpError

__all__ = [
    "MAX_CHOICES",
    "RANDOM_SEED",
    "Limits",
    "choices_count",
    "echoed_model",
    "max_tokens",
    "probabilities",
    "sampling_options",
    "stream_options",
]

# Text keys of logit_bias are tokenized on the event loop: bounded, like a prompt is.
_MAX_BIAS_TEXT = 64 * 1024
# Entries of one logit_bias (there are fewer tokens than this in any vocabulary we serve).
_MAX_BIAS_ENTRIES = 1 << 17

# The most completions of one prompt a request may ask for (the engine's own limit).
MAX_CHOICES = 16

# llama-server's "random seed" (LLAMA_DEFAULT_SEED); our engine takes None for it.
RANDOM_SEED = 0xFFFFFFFF

# Sampler settings llama.cpp has and this engine does not: accepted at the value that
# turns them off (what clients send by default), refused otherwise, never ignored.
_OFF_VALUES: dict[str, tuple[float, ...]] = {
    "mirostat": (0,),
    "typical_p": (1.0,),
    "dynatemp_range": (0.0,),
    "xtc_probability": (0.0,),
    "dry_multiplier": (0.0,),
    "top_n_sigma": (-1.0,),
    "min_keep": (0, 1),
    "n_indent": (0,),
}


@dataclass(frozen=True, slots=True)
class Limits:
    """What a request may ask for on this server (from ``HttpSettings`` and the engine)."""

    n_predict: int
    """The server's cap for generated tokens (``-n``), -1 for none."""
    n_ctx_slot: int
    """One slot's context: no request can generate more."""
    n_parallel: int = MAX_CHOICES
    """An engine's slots: a request's ``n`` choices at most (llama-server's bound)."""


def _fail(message: str) -> HttpError:
    return HttpError(400, message)


def _show(value: object) -> str:
    """A short, printable picture of a client's value for an error message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _finite(value: object) -> float | None:
    """A JSON number as a finite float, or ``None``: not a number, a boolean, infinite, or an
    integer past the float range (JSON integers have any number of digits)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(f"'{name}' must be a number")
    number = _finite(value)
    if number is None:
        raise _fail(f"'{name}' must be a finite number within the float range")
    return number


def _int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"'{name}' must be an integer")
    return value


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _fail(f"'{name}' must be true or false")
    return value


def _stop(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if value else None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _fail("'stop' must be a string or a list of strings")
    return [s for s in value if s] or None


def _logit_bias(value: object, tokenize: Callable[[str], list[int]]) -> dict[int, float] | None:
    """llama-server's forms: ``{"15043": 1.0}``, ``[[15043, 1.0]]``, ``[["Hello", -0.5]]``,
    ``{"Hello": -0.5}`` (text: every token of it); a bias of ``false`` bans the token."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list):
        if not all(isinstance(p, list) and len(p) == 2 for p in value):
            raise _fail("'logit_bias' as a list takes [token, bias] pairs")
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise _fail("'logit_bias' must be an object of token id -> bias, or a list of [token, bias]")
    if len(pairs) > _MAX_BIAS_ENTRIES:
        raise _fail(f"'logit_bias' may have at most {_MAX_BIAS_ENTRIES} entries")
    text = sum(len(key) for key, _ in pairs if isinstance(key, str))
    if text > _MAX_BIAS_TEXT:
        raise _fail(f"logit_bias text keys may have at most {_MAX_BIAS_TEXT} characters in all")
    bias: dict[int, float] = {}
    for key, raw in pairs:
        finite = _finite(raw)
        if raw is False:
            amount = -math.inf
        elif finite is None:
            raise _fail(f"logit_bias for {_show(key)} must be a finite number or false")
        else:
            amount = finite
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise _fail(f"a logit_bias token must be a token id or a string, got {_show(key)}")
        if isinstance(key, int):
            ids = [key]
        elif key.isascii() and key.isdigit() and len(key) <= 10:
            ids = [int(key)]
        else:
            ids = tokenize(key)  # a piece of text: every token of it
        for token in ids:
            bias[token] = amount
    return bias or None


def echoed_model(body: Mapping[str, Any], default: str) -> str:
    """The model name a response echoes: the request's, if it is a sensible name (a
    printable string of at most 256 characters, valid Unicode), else ``default``."""
    model = body.get("model")
    if isinstance(model, str) and 0 < len(model) <= 256 and model.isprintable():
        try:
            model.encode("utf-8")  # not a lone surrogate
            return model
        except UnicodeEncodeError:
            pass
    return default


def max_tokens(requested: int | None, limits: Limits) -> int:
    """llama-server's rule: the request's ``n_predict`` when it gives one, else the
    server's ``-n``, else no limit; a slot's context bounds them all."""
    if requested == 0:
        raise _fail("n_predict / max_tokens must be at least 1 (or -1 for no limit)")
    if requested is None or requested < 0:
        requested = limits.n_predict if limits.n_predict > 0 else limits.n_ctx_slot
    return min(requested, limits.n_ctx_slot)


def choices_count(body: Mapping[str, Any], limits: Limits, *names: str) -> int:
    """How many completions of the prompt a request asks for: the first of ``names``
    given (OpenAI's ``n``; llama-server's ``n_cmpl``, then ``n``, on ``/completion``),
    1 when none is; an integer from 1 to ``MAX_CHOICES`` and the engine's slots (as
    llama-server: more choices than slots would hold every slot, and the queue)."""
    most = max(1, min(MAX_CHOICES, limits.n_parallel))
    for name in names:
        count = _int(body, name)
        if count is None:
            continue
        if not 1 <= count <= most:
            raise _fail(f"'{name}' must be between 1 and {most} (this server's slots), got {_show(count)}")
        return count
    return 1


def sampling_options(body: Mapping[str, Any], tokenize: Callable[[str], list[int]]) -> dict[str, Any]:
    """The engine options of the sampling fields both APIs share (llama-server reads
    its native fields on the OpenAI endpoints too)."""
    for name, off in _OFF_VALUES.items():
        value = body.get(name)
        if value is not None and value not in off:
            raise _fail(f"'{name}' is not supported by this server (only {off[0]!r}, which turns it off)")
    options: dict[str, Any] = {}
    for ours, theirs in (
        ("temp", "temperature"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("penalty_repeat", "repeat_penalty"),
        ("penalty_freq", "frequency_penalty"),
        ("penalty_present", "presence_penalty"),
    ):
        value = _number(body, theirs)
        if value is not None:
            options[ours] = value
    for ours, theirs in (("top_k", "top_k"), ("penalty_last_n", "repeat_last_n"), ("n_keep", "n_keep")):
        number = _int(body, theirs)
        if number is not None:
            options[ours] = number
    if options.get("penalty_last_n") == -1:
        options.pop("penalty_last_n")  # llama-server: -1 is "the whole context", our cap
    if options.get("n_keep") == -1:
        options.pop("n_keep")
    seed = _int(body, "seed")
    if seed is not None and seed not in (-1, RANDOM_SEED):
        options["seed"] = seed
    stop = _stop(body.get("stop"))
    if stop:
        options["stop"] = stop
    ignore_eos = _bool(body, "ignore_eos")
    if ignore_eos:
        options["ignore_eos"] = True
    if _bool(body, "truncate"):  # ours: a prompt past a slot keeps its start and end
        options["truncate"] = True
    grammar = body.get("grammar")
    if grammar is not None and grammar != "":
        if not isinstance(grammar, str):
            raise _fail("'grammar' must be a string (GBNF)")
        options["grammar"] = grammar
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, Mapping):
            raise _fail("'json_schema' must be an object (a JSON Schema)")
        options["json_schema"] = schema
    bias = _logit_bias(body.get("logit_bias"), tokenize)
    if bias:
        options["logit_bias"] = bias
    n_probs = _int(body, "n_probs")
    if n_probs:
        options["logprobs"] = n_probs
    if _bool(body, "post_sampling_probs"):
        options["post_sampling_probs"] = True  # kept by probabilities() if logprobs are asked for
    if _bool(body, "cache_prompt") is False:
        options["cache_prompt"] = False  # it reuses no one's KV and leaves none of its own
    lora = body.get("lora")
    if lora is not None:  # llama-server's [{"id", "scale"}]; checked by the message
        options["lora"] = lora
    return options


def probabilities(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` once the endpoint has set its ``logprobs``: llama-server's
    ``post_sampling_probs`` changes which probabilities are reported, and is dropped when
    none are (the engine refuses it alone)."""
    if "logprobs" not in options:
        options.pop("post_sampling_probs", None)
    return options


def stream_options(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """A stream's engine options and whether its chunks carry ``timings``: llama-server's
    ``return_progress`` (prompt-progress events: the engine's ``progress``) and
    ``timings_per_token``; checked for type whether the request streams or not."""
    progress = _bool(body, "return_progress")
    per_token = _bool(body, "timings_per_token")
    return ({"progress": True} if progress else {}), per_token is True
