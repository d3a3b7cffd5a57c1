"""llama-server's ``POST /infill``: fill-in-the-middle for code editors (llama.vim,
llama.vscode), a parser into the native completion's prompt and options, answered by
its renderer (:func:`~actors.http._native.native_reply`).

The request: ``input_prefix`` and ``input_suffix`` (required: text, or llama-server's
list of text and token ids), ``input_extra`` (other files: ``[{"filename", "text"}]``,
the filename optional), ``prompt`` (text written after the prefix, which the model
continues), and every ``/completion`` option (``n_predict``, ``stream``, sampling,
``n_probs``...). The prompt's tokens are ``Tokenizer.infill``'s, llama-server's layout
and budgets with this server's slot context, ``n_batch``, ``-n`` and ``--spm-infill``.

Errors, llama-server's: a model without FIM prefix, suffix or middle tokens gets its
501 (``not_supported_error``, "Infill is not supported by this model: prefix token is
missing. ..."), before the body is looked at; a chunk without a string ``text``, or
with a ``filename`` that is not a string, gets its 400 and message. Where llama-server
goes on with a wrong value (a ``prompt`` that is not a string becomes empty there) or
fails with a 500 (``input_prefix`` missing or a number), ours is a 400 that names the
field.

Runs on the event loop; the body is read into the prompt in a work thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors.http._errors import HttpError
from actors.http._native import completion_options, native_reply
from actors.http._service import Service, request_client, routed
from actors.http._stream import EventStream

__all__ = ["MAX_EXTRA_CHUNKS", "infill"]

MAX_EXTRA_CHUNKS = 1024
"""The most ``input_extra`` chunks one request may carry (editors send tens; only those
at the end that fit the context are tokenized, but every one is checked)."""

_CHUNKS = '"input_extra" must be an array of {"filename": string, "text": string}'


def _framing(body: Mapping[str, Any], name: str) -> str | list[str | int]:
    """``input_prefix`` or ``input_suffix``: text, or a list of text and token ids."""
    if name not in body:
        raise HttpError(400, f'"{name}" is required')
    value = body[name]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, str) or type(p) is int for p in value):
        return value
    raise HttpError(400, f'"{name}" must be a string, or an array of strings and token ids')


def _chunks(value: object) -> list[tuple[str, str]]:
    """``input_extra`` as ``(filename, text)`` pairs (llama-server's default name, ``tmp``)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise HttpError(400, _CHUNKS)
    if len(value) > MAX_EXTRA_CHUNKS:
        raise HttpError(400, f'"input_extra" may have at most {MAX_EXTRA_CHUNKS} chunks, got {len(value)}')
    chunks = []
    for i, chunk in enumerate(value):
        text = chunk.get("text") if isinstance(chunk, dict) else None
        if not isinstance(text, str):
            raise HttpError(
                400, f'extra_context chunk must contain a "text" field with a string value (input_extra[{i}])'
            )
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise HttpError(
                400, f'extra_context chunk\'s "filename" field must be a string (input_extra[{i}])'
            )
        chunks.append((filename, text))
    return chunks


def _prompt(body: Mapping[str, Any]) -> str:
    value = body.get("prompt")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise HttpError(400, '"prompt" must be a string')
    return value


def _read(service: Service, body: Mapping[str, Any]) -> tuple[list[int], str, dict[str, Any]]:
    """The infill prompt's tokens and text (special tokens spelled out, as llama-server's
    response shows it) and the engine options (a work thread)."""
    prefix, suffix = _framing(body, "input_prefix"), _framing(body, "input_suffix")
    extra, prompt = _chunks(body.get("input_extra")), _prompt(body)
    options = completion_options(service, body)
    tokenizer = service.need_tokenizer()
    tokens = tokenizer.infill(
        prefix,
        suffix,
        extra=extra,
        prompt=prompt,
        n_ctx=service.n_ctx_slot,
        n_batch=int(service.info.get("n_batch") or service.n_ctx_slot),
        n_predict=service.settings.n_predict,  # the server's -n, as llama-server budgets
        spm=service.settings.spm_infill,
    )
    return tokens, tokenizer.detokenize(tokens), options


async def infill(request: Request) -> Response | EventStream:
    """``POST /infill``: the code for the hole between ``input_prefix`` and ``input_suffix``."""
    service = await routed(request)
    missing = service.need_tokenizer().fim_tokens.missing
    if missing:  # before the body, as llama-server
        raise HttpError(501, f"Infill is not supported by this model: {missing}")
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    tokens, text, options = await service.parse(request_client(request), lambda: _read(service, body))
    return await native_reply(service, request, body, [tokens], options, shown_prompt=text)
