"""llama.cpp's native API: ``POST /completion``, ``/tokenize``, ``/detokenize`` and
``/apply-template``, with llama-server's request fields and response shapes.

Handlers run on the event loop; the engine is reached only through the public helpers.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import Completion, Done, EngineError, Progress, Token
from actors.http._access import access_of
from actors.http._errors import HttpError, from_engine_error
from actors.http._generation import (
    Opened,
    complete,
    dumps,
    error_event,
    logprobs_json,
    open_stream,
    progress_json,
    progress_timings,
    sse,
    stop_type,
    timings,
)
from actors.http._params import (
    _OFF_VALUES,
    RANDOM_SEED,
    choices_count,
    max_tokens,
    probabilities,
    sampling_options,
    stream_options,
)
from actors.http._service import Service, request_client, routed
from actors.http._stream import EventStream, unless_disconnected

__all__ = [
    "apply_template",
    "complete_all",
    "completion",
    "completion_options",
    "detokenize",
    "final_json",
    "json_response",
    "native_reply",
    "prompts_of",
    "tokenize",
]


def json_response(value: Any, status: int = 200) -> Response:
    """A JSON response as llama-server sends it."""
    return Response(dumps(value), status_code=status, media_type="application/json; charset=utf-8")


# The most prompts one request may carry (each runs as its own request).
MAX_PROMPTS = 16


def _one_prompt(value: object, tokenize: Callable[[str], list[int]]) -> str | list[int]:
    """A single prompt: text, token ids, text and ids mixed, or ``{"prompt_string": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        if value.get("multimodal_data"):
            raise HttpError(400, "multimodal prompts are not supported by this server (no projector)")
        text = value.get("prompt_string")
        if not isinstance(text, str):
            raise HttpError(400, "a JSON prompt needs a string 'prompt_string'")
        return text
    if isinstance(value, list) and value and all(type(t) is int or isinstance(t, str) for t in value):
        if all(type(t) is int for t in value):
            return value
        tokens: list[int] = []  # llama.cpp's mixed prompt: text pieces tokenized in place
        for piece in value:
            tokens.extend(tokenize(piece) if isinstance(piece, str) else [piece])
        return tokens
    raise HttpError(400, "'prompt' must be a string, a list of token ids, or a list of prompts")


def prompts_of(value: object, tokenize: Callable[[str], list[int]]) -> list[str | list[int]]:
    """``prompt`` as llama-server reads it: one prompt, or a list of prompts."""
    if isinstance(value, list) and value and any(isinstance(p, list | Mapping) for p in value):
        if len(value) > MAX_PROMPTS:
            raise HttpError(400, f"at most {MAX_PROMPTS} prompts per request")
        return [_one_prompt(p, tokenize) for p in value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value) and len(value) > 1:
        if len(value) > MAX_PROMPTS:
            raise HttpError(400, f"at most {MAX_PROMPTS} prompts per request")
        return list(value)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return [value[0]]
    return [_one_prompt(value, tokenize)]


def _post(options: Mapping[str, Any]) -> bool:
    return bool(options.get("post_sampling_probs"))


def generation_settings(service: Service, options: Mapping[str, Any], stream: bool) -> dict[str, Any]:
    """llama-server's ``generation_settings``: the request's options over the server's defaults."""
    defaults = service.info.get("sampling", {})

    def value(name: str) -> Any:
        return options.get(name, defaults.get(name))

    seed = value("seed")
    bias: list[dict[str, Any]] = []
    if options.get("ignore_eos") and service.tokenizer is not None:  # llama-server lists the bans
        bias += [{"bias": None, "token": t} for t in sorted(service.tokenizer.eog_token_ids)]
    for token, amount in (options.get("logit_bias") or {}).items():
        bias.append({"bias": None if amount == -math.inf else amount, "token": token})
    return {
        "n_ctx": service.n_ctx_slot,
        "n_predict": options["max_tokens"],
        "max_tokens": options["max_tokens"],
        "seed": RANDOM_SEED if seed is None else seed,
        "temperature": value("temp"),
        "top_k": value("top_k"),
        "top_p": value("top_p"),
        "min_p": value("min_p"),
        "repeat_last_n": value("penalty_last_n"),
        "repeat_penalty": value("penalty_repeat"),
        "presence_penalty": value("penalty_present"),
        "frequency_penalty": value("penalty_freq"),
        "n_keep": options.get("n_keep", 0),
        "ignore_eos": bool(options.get("ignore_eos", False)),
        "stream": stream,
        "n_probs": options.get("logprobs") or 0,
        "post_sampling_probs": _post(options),
        "min_keep": 0,
        "stop": list(options.get("stop") or ()),
        # Samplers this engine does not have, at the values that turn them off.
        **{name: off[0] for name, off in _OFF_VALUES.items() if name not in ("min_keep",)},
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
        "grammar": options.get("grammar", ""),
        "logit_bias": bias,
    }


def final_json(
    service: Service,
    completion: Completion,
    options: Mapping[str, Any],
    *,
    stream: bool,
    tokens: bool,
    prompt: str = "",
) -> dict[str, Any]:
    """llama-server's last object of a native completion (``prompt``: the prompt's text,
    which ``/infill`` shows)."""
    body: dict[str, Any] = {
        "index": 0,
        "content": "" if stream else completion.text,
        "tokens": list(completion.token_ids) if tokens and not stream else [],
        "id_slot": completion.slot,
        "stop": True,
        "model": service.model_ids[0],
        "tokens_predicted": completion.generated_tokens,
        "tokens_evaluated": completion.prompt_tokens,
        "generation_settings": generation_settings(service, options, stream),
        "prompt": prompt,
        "has_new_line": "\n" in completion.text,
        # llama-server's: tokens of the context were dropped (a shift), or it ran out.
        "truncated": completion.context_shifts > 0 or completion.stop_reason == "length",
        "stop_type": stop_type(completion),
        "stopping_word": completion.stop_string or "",
        "tokens_cached": completion.prompt_tokens + completion.generated_tokens,
        "timings": timings(completion),
    }
    if not stream and completion.logprobs:
        body["completion_probabilities"] = logprobs_json(completion.logprobs, _post(options))
    return body


async def _body(request: Request) -> dict[str, Any]:
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body


def completion_options(service: Service, body: Mapping[str, Any]) -> dict[str, Any]:
    """The engine options of a native ``/completion`` body."""
    options = sampling_options(body, service.tokenize)
    requested = body.get("n_predict", body.get("max_tokens"))
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)):
        raise HttpError(400, "'n_predict' must be an integer")
    options["max_tokens"] = max_tokens(requested, service.limits)
    # llama-server's n_cmpl, with OpenAI's n as its alias
    n = choices_count(body, service.limits, "n_cmpl", "n")
    if n > 1:
        options["n"] = n
    return probabilities(options)


async def completion(request: Request) -> Response | EventStream:
    """``POST /completion`` (and ``/completions``): llama.cpp's native completion."""
    service = await routed(request)
    body = await _body(request)
    if "prompt" not in body:
        raise HttpError(400, "'prompt' is required")
    # Off the event loop: a prompt's text pieces are tokenized, its ids checked.
    prompts, options = await service.parse(
        request_client(request),
        lambda: (prompts_of(body["prompt"], service.tokenize), completion_options(service, body)),
    )
    return await native_reply(service, request, body, prompts, options)


async def native_reply(
    service: Service,
    request: Request,
    body: Mapping[str, Any],
    prompts: Sequence[str | list[int]],
    options: dict[str, Any],
    shown_prompt: str = "",
) -> Response | EventStream:
    """The native answer to a request read into ``prompts`` and engine ``options``:
    llama-server's JSON (one object, or a list for several prompts or choices), or its
    event stream under ``stream`` (``/completion``'s, and ``/infill``'s, whose last
    object shows its laid-out prompt as ``shown_prompt``, as llama-server's does)."""
    streaming, per_token = stream_options(body)
    stream = body.get("stream") is True
    return_tokens = body.get("return_tokens") is True
    if not stream:
        # llama-server's order: each prompt's n completions in turn, indexed across them all.
        dones = [done for group in await complete_all(service, request, prompts, options) for done in group]
        results = [
            {
                **final_json(service, done, options, stream=False, tokens=return_tokens, prompt=shown_prompt),
                "index": i,
            }
            for i, done in enumerate(dones)
        ]
        return json_response(results[0] if len(results) == 1 else results)
    if len(prompts) > 1:
        raise HttpError(400, "streaming several prompts in one request is not supported; send one each")
    opened = await open_stream(
        service, request, prompt=prompts[0], messages=None, options={**options, **streaming}
    )
    return EventStream(_native_events(service, opened, options, per_token, shown_prompt))


async def _native_events(
    service: Service, opened: Opened, options: Mapping[str, Any], per_token: bool, shown_prompt: str
) -> AsyncIterator[bytes]:
    n_predicted = [0] * options.get("n", 1)  # each choice's tokens so far
    try:
        async for event in opened.events():
            if isinstance(event, Progress):
                chunk: dict[str, Any] = {
                    "index": 0,
                    "content": "",
                    "tokens": [],
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": 0,
                    "tokens_evaluated": event.total,
                    "prompt_progress": progress_json(event),
                }
                if per_token:
                    chunk["timings"] = progress_timings(event)
                yield sse(chunk)
            elif isinstance(event, Token):
                n_predicted[event.index] += 1
                chunk = {
                    "index": event.index,
                    "content": event.text,
                    "tokens": [event.token_id],
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": n_predicted[event.index],
                }
                if event.logprob is not None:
                    chunk["completion_probabilities"] = logprobs_json([event.logprob], _post(options))
                yield sse(chunk)
            elif isinstance(event, Done):
                final = final_json(
                    service, event.completion, options, stream=True, tokens=False, prompt=shown_prompt
                )
                yield sse({**final, "index": event.index})
    except HttpError as e:
        yield error_event(e)


async def complete_all(
    service: Service, request: Request, prompts: Sequence[str | list[int]], options: dict[str, Any]
) -> list[list[Completion]]:
    """Every prompt's choices (one each, or ``options["n"]``), each prompt its own
    request, side by side; the first failure (or the client leaving) cancels the others."""
    if len(prompts) == 1:
        return [await complete(service, request, prompt=prompts[0], messages=None, options=options)]
    access = access_of(request)
    tasks = [
        asyncio.ensure_future(
            complete(service, None, prompt=p, messages=None, options=options, access=access)
        )
        for p in prompts
    ]
    try:
        return list(await unless_disconnected(request, asyncio.gather(*tasks)))
    finally:
        for task in tasks:
            task.cancel()


def _special(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise HttpError(400, f"'{name}' must be true or false")
    return value


# /tokenize's text (a prompt is bounded the same way by the engine's own check).
MAX_TOKENIZE_CHARS = 1 << 20
# /detokenize's ids, and the pieces /tokenize lists one by one.
MAX_TOKENS = 1 << 18


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: ``{"content", "add_special", "parse_special", "with_pieces"}``."""
    service = await routed(request)
    body = await _body(request)
    content = body.get("content", "")
    if not isinstance(content, str):
        raise HttpError(400, "'content' must be a string")
    if len(content) > MAX_TOKENIZE_CHARS:
        raise HttpError(400, f"'content' may have at most {MAX_TOKENIZE_CHARS} characters")
    add_special = _special(body, "add_special", False)
    parse_special = _special(body, "parse_special", True)
    with_pieces = _special(body, "with_pieces", False)
    tokenizer = service.need_tokenizer()

    def work() -> dict[str, Any]:  # a work thread: llama.cpp's tokenizer releases the GIL
        ids = tokenizer.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return {"tokens": ids}
        if len(ids) > MAX_TOKENS:
            raise HttpError(400, f"'with_pieces' lists at most {MAX_TOKENS} tokens")
        pieces: list[dict[str, Any]] = []
        for token in ids:
            text = tokenizer.detokenize([token])
            piece: str | list[int] = text
            if "\ufffd" in text:  # not valid UTF-8 alone: llama-server sends its bytes
                piece = list(tokenizer.token_bytes(token))
            pieces.append({"id": token, "piece": piece})
        return {"tokens": pieces}

    try:
        return json_response(await service.run(work))
    except EngineError as e:
        raise from_engine_error(e) from None


def _token_ids(value: object) -> Sequence[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise HttpError(400, "'tokens' must be a list of token ids")
    if len(value) > MAX_TOKENS:
        raise HttpError(400, f"'tokens' may have at most {MAX_TOKENS} ids")
    return value


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: ``{"tokens": [...]}`` to ``{"content": "..."}``."""
    service = await routed(request)
    body = await _body(request)
    ids = _token_ids(body.get("tokens", []))
    tokenizer = service.need_tokenizer()
    bad = [t for t in ids if not 0 <= t < tokenizer.n_vocab]
    if bad:
        raise HttpError(400, f"token id {bad[0]} is outside the vocabulary (n_vocab={tokenizer.n_vocab})")
    try:
        return json_response({"content": await service.run(tokenizer.detokenize, ids)})
    except EngineError as e:
        raise from_engine_error(e) from None


async def apply_template(request: Request) -> Response:
    """``POST /apply-template``: the chat template applied to ``messages``, as ``prompt``."""
    from actors.http._chat_params import chat_messages, continuation, template_kwargs, tools_option

    service = await routed(request)
    body = await _body(request)
    messages = chat_messages(body.get("messages"))
    render = {**continuation(body, messages), **tools_option(body)}
    tokenizer = service.need_tokenizer()
    try:
        variables = template_kwargs(service.settings.chat_template_kwargs, body) or None
        prompt = await service.run(
            functools.partial(tokenizer.apply_chat_template, messages, variables, **render)
        )
    except EngineError as e:
        raise from_engine_error(e) from None
    return json_response({"prompt": prompt})
