"""Embeddings over HTTP: OpenAI's ``POST /v1/embeddings`` and llama-server's
``POST /embedding`` (and ``/embeddings``), served by one ``Embed`` per request.

llama-server serves them only with ``--embedding``, and ``/v1/embeddings`` only with a
pooling other than ``none``; ours serves them always, pooled by ``--pooling`` (the
model's own by default, else mean). Inputs are read as llama-server reads them
(``tokenize_input_prompts``): a string, token ids, text and ids mixed, a list of those,
``{"prompt_string": ...}`` or ``{"content": [{"type": "text", "text": ...}]}`` objects.

Runs on the event loop; mixed prompts are tokenized in a work thread, and the texts in
the sending thread of ``aembed_result`` (a worker thread).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from actors import Embed, Tokenizer, aembed_result
from actors.http._access import access_of
from actors.http._errors import HttpError
from actors.http._native import json_response
from actors.http._params import echoed_model
from actors.http._service import routed

__all__ = ["embeddings", "embeddings_oai"]

_FORMAT_ERROR = "The format to return the embeddings in. Can be either float or base64"


def _content_text(value: Mapping[str, Any]) -> str:
    """The text of a ``{"content": [{"type": "text", "text": ...}, ...]}`` prompt."""
    parts = value["content"]
    if not isinstance(parts, list) or not parts:
        raise HttpError(400, "'content' must be a non-empty list of {'type': 'text', 'text': ...} parts")
    texts = []
    for part in parts:
        text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise HttpError(400, "only text content is supported by this server (no multimodal projector)")
        texts.append(text)
    return "".join(texts)


def _one(value: object, pieces: list[tuple[int, list[Any]]], index: int) -> str | list[int]:
    """One prompt; a mixed one (text and ids) is noted in ``pieces`` to be tokenized."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        if "prompt_string" in value and isinstance(value["prompt_string"], str):
            return value["prompt_string"]
        if "content" in value:
            return _content_text(value)
        raise HttpError(400, "a JSON prompt needs a string 'prompt_string' or a list of text 'content'")
    if isinstance(value, list) and value and all(type(t) is int or isinstance(t, str) for t in value):
        if all(type(t) is int for t in value):
            return value
        pieces.append((index, value))
        return []
    raise HttpError(400, "'input' must be a string, a list of token ids, or a list of prompts")


def _prompts(value: object) -> tuple[list[str | list[int]], list[tuple[int, list[Any]]]]:
    """``input`` as llama-server reads it: one prompt, or a list of prompts."""
    pieces: list[tuple[int, list[Any]]] = []
    if isinstance(value, list):
        if not value:
            raise HttpError(400, "'input' must not be empty")
        many = any(isinstance(p, list | Mapping) for p in value) or all(isinstance(p, str) for p in value)
        if many:  # Embed refuses too many
            return [_one(p, pieces, i) for i, p in enumerate(value)], pieces
    return [_one(value, pieces, 0)], pieces


def _mixed(tokenizer: Tokenizer, pieces: list[tuple[int, list[Any]]]) -> dict[int, list[int]]:
    """Mixed prompts as llama.cpp tokenizes them: each text piece in place, special
    tokens added before the first piece only (a work thread)."""
    out = {}
    for index, parts in pieces:
        tokens: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                tokens.extend(tokenizer.tokenize(part, add_special=i == 0, parse_special=True))
            else:
                tokens.append(part)
        out[index] = tokens
    return out


async def _embed(request: Request) -> tuple[dict[str, Any], Any, bool]:
    """The body, its ``Embeddings``, and whether the body is OpenAI's (``input``)."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, Mapping):
        raise HttpError(400, "the request body must be a JSON object")
    if "input" in body:
        value, oai = body["input"], True
    elif "content" in body:
        value, oai = body["content"], False
    else:
        raise HttpError(400, '"input" or "content" must be provided')
    if service.settings.pooling == "none":  # llama-server's answer; its per-token output is not offered
        if oai and request.url.path == "/v1/embeddings":
            raise HttpError(
                400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
            )
        raise HttpError(501, "per-token embeddings (--pooling none) are not supported by llama-cpp-actors")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise HttpError(400, _FORMAT_ERROR)
    normalize = body.get("embd_normalize", 2)
    if normalize not in (-1, 2) or isinstance(normalize, bool):
        raise HttpError(400, "embd_normalize must be 2 (euclidean, the default) or -1 (none)")
    texts, pieces = _prompts(value)
    if pieces:
        tokenizer = service.tokenizer
        if tokenizer is None:
            raise HttpError(503, "the model is loading")
        for index, tokens in (await service.run(_mixed, tokenizer, pieces)).items():
            texts[index] = tokens
    if any(not t for t in texts):
        raise HttpError(400, "Input content cannot be empty")
    pooling = service.settings.pooling
    # Checking up to 16 Mi characters of texts is a work thread's job, not the loop's.
    access = access_of(request)
    request_id = access.engine_id() if access is not None else None

    def make() -> Embed:
        if request_id is None:
            return Embed(texts, pooling=pooling, normalize=normalize == 2)
        return Embed(texts, pooling=pooling, normalize=normalize == 2, request_id=request_id)

    message = await service.run(make)
    result = await aembed_result(service.handle(), message)
    if access is not None:
        access.prompt_tokens = sum(result.prompt_tokens)
    return dict(body), result, oai


async def embeddings_oai(request: Request) -> Response:
    """``POST /v1/embeddings``: OpenAI's list of ``{"embedding", "index", "object"}``,
    with ``usage``; a body with ``content`` instead of ``input`` is answered as
    ``/embedding`` is (llama-server's rule)."""
    body, result, oai = await _embed(request)
    if not oai:
        return _native(result)
    service = await routed(request)
    base64_format = body.get("encoding_format") == "base64"
    data = []
    for i, vector in enumerate(result.vectors):
        if base64_format:
            encoded = base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
            entry = {"embedding": encoded, "index": i, "object": "embedding", "encoding_format": "base64"}
            data.append(entry)
        else:
            data.append({"embedding": vector.tolist(), "index": i, "object": "embedding"})
    n_tokens = result.total_tokens
    return json_response(
        {
            "model": echoed_model(body, service.model_ids[0]),
            "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "data": data,
        }
    )


async def embeddings(request: Request) -> Response:
    """``POST /embedding``: llama-server's list of ``{"index", "embedding": [[...]]}``
    (one pooled vector per input)."""
    _, result, _ = await _embed(request)
    return _native(result)


def _native(result: Any) -> Response:
    vectors = result.vectors
    return json_response([{"index": i, "embedding": [vector.tolist()]} for i, vector in enumerate(vectors)])
