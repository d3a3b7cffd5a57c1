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
    "chat_messages",
    "choices_count",
    "continuation",
    "echoed_model",
    "max_tokens",
    "probabilities",
    "sampling_options",
    "stream_options",
    "template_kwargs",
    "text_content",
    "tool_options",
    "tools_option",
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


def continuation(body: Mapping[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's ``add_generation_prompt`` and ``continue_final_message`` (vLLM's):
    a final assistant message is always continued (a prefill); otherwise the assistant's
    turn is opened unless ``add_generation_prompt`` is false. The engine's option, if any."""
    add = _bool(body, "add_generation_prompt")
    cont = _bool(body, "continue_final_message")
    if add and cont:
        raise _fail("add_generation_prompt and continue_final_message cannot both be true")
    prefill = len(messages) > 1 and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    if cont and not prefill:
        raise _fail("continue_final_message needs a final assistant message to continue")
    return {"add_generation_prompt": False} if add is False and not prefill else {}


def tools_option(body: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's ``tools`` for a template's render (``/apply-template``, the input token
    count): llama-server passes a non-empty list to the template, as is. Only the type is
    checked here; the tokenizer checks size and depth."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return {}
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise _fail("'tools' must be a list of objects")
    return {"tools": tools}


def template_kwargs(defaults: tuple[tuple[str, Any], ...], body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's variables: the server's (``--reasoning``,
    ``--chat-template-kwargs``) under the request's ``chat_template_kwargs``; the
    engine checks names, types and sizes."""
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, Mapping):
        raise _fail("'chat_template_kwargs' must be an object")
    return {**dict(defaults), **(given or {})}


def chat_messages(value: object) -> list[dict[str, Any]]:
    """OpenAI ``messages`` as the engine's dicts: text parts are joined, ``developer`` is
    a system message; an assistant's ``tool_calls`` and ``reasoning_content`` and a tool
    result's ``tool_call_id`` and ``name`` pass on (the engine checks them); images and
    audio are refused."""
    if not isinstance(value, list) or not value:
        raise _fail("'messages' must be a non-empty list")
    messages = []
    for message in value:
        if not isinstance(message, Mapping):
            raise _fail("each message must be an object with 'role' and 'content'")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise _fail(f"message role {str(role)[:40]!r} is not supported (system, user, assistant, tool)")
        content = text_content(message.get("content"), allow_none=role == "assistant")
        entry: dict[str, Any] = {"role": role, "content": content}
        for name in ("tool_calls", "reasoning_content") if role == "assistant" else ("tool_call_id", "name"):
            if message.get(name) is not None:
                entry[name] = message[name]
        if role == "assistant" and message.get("function_call") is not None:
            raise _fail("'function_call' (OpenAI's deprecated functions) is not supported; use tool_calls")
        messages.append(entry)
    if len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
        raise _fail("a chat cannot end with two assistant messages")
    return messages


def text_content(content: object, *, allow_none: bool = False) -> str:
    """A message's content as text: a string, or text parts joined by a blank line (as
    llama-server joins them); None is "" where ``allow_none``."""
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise _fail(f"content parts of type {str(kind)[:40]!r} are not supported (text only)")
            text = part.get("text")
            if not isinstance(text, str):
                raise _fail("a text content part needs a string 'text'")
            texts.append(text)
        return "\n\n".join(texts)  # llama-server joins a message's text parts so
    if not isinstance(content, str):
        raise _fail("a message's 'content' must be a string or a list of text parts")
    return content


_REASONING_FORMATS = ("auto", "none", "deepseek")


def tool_options(
    body: Mapping[str, Any],
    reasoning_default: str | None,
    budget_default: int | None = None,
    budget_message: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and llama-server's
    ``reasoning_format`` and thinking budget (``reasoning_budget_tokens`` or
    ``thinking_budget_tokens``, -1 the server's; ``reasoning_budget_message``), as engine
    options (the engine checks the tools themselves)."""
    options: dict[str, Any] = {}
    budget = _int(body, "reasoning_budget_tokens")
    if budget is None:
        budget = _int(body, "thinking_budget_tokens")
    reasoning = body.get("reasoning_format", reasoning_default)
    if budget is None or budget == -1:
        budget = budget_default if reasoning != "none" else None
    if budget is not None:
        options["reasoning_budget"] = budget
        message = body.get("reasoning_budget_message", budget_message)
        if message is not None:
            options["reasoning_budget_message"] = message
    tools = body.get("tools")
    if tools is not None and tools != []:
        if not isinstance(tools, list):
            raise _fail("'tools' must be a list of function tools")
        options["tools"] = tools
    if body.get("functions"):
        raise _fail("'functions' (OpenAI's deprecated form of tools) is not supported; use 'tools'")
    choice = body.get("tool_choice")
    if choice is not None:
        options["tool_choice"] = choice
    parallel = _bool(body, "parallel_tool_calls")
    if parallel is not None:
        options["parallel_tool_calls"] = parallel
    if reasoning is not None:
        if reasoning not in _REASONING_FORMATS:
            raise _fail(
                f"'reasoning_format' must be one of {', '.join(_REASONING_FORMATS)}, got {_show(reasoning)}"
            )
        options["reasoning_format"] = reasoning
    return options
