"""llama-server's LoRA adapter endpoints: ``GET /lora-adapters`` lists the server's
adapters with their default scales, ``POST /lora-adapters`` sets those scales (the
adapters the body names take its scales, the others 0). A request's own ``lora`` field
is read with the other sampling options (``_params.sampling_options``)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import GetLora, LoraAdapter, SetLora
from actors.http._errors import HttpError
from actors.http._native import json_response
from actors.http._service import routed

__all__ = ["get_adapters", "set_adapters"]

_TIMEOUT_S = 10.0


def _listing(adapters: tuple[LoraAdapter, ...]) -> list[dict[str, Any]]:
    return [
        {"id": i, "path": a.path, "scale": a.scale, "name": a.name, "task_name": "", "prompt_prefix": ""}
        for i, a in enumerate(adapters)
    ]


async def get_adapters(request: Request) -> Response:
    """``GET /lora-adapters``: ``[{"id", "path", "scale", "name", ...}]`` in id order."""
    service = await routed(request)
    adapters = await service.call(lambda: service.handle().ask(GetLora(), timeout=_TIMEOUT_S))
    return json_response(_listing(adapters))


async def set_adapters(request: Request) -> Response:
    """``POST /lora-adapters`` with ``[{"id": 0, "scale": 0.5}, ...]``: ``{"success": true}``."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, list):
        raise HttpError(400, "Request body must be an array")
    message = SetLora(body)  # InvalidRequest (a 400) for a bad entry
    await service.call(lambda: service.handle().ask(message, timeout=_TIMEOUT_S))
    return json_response({"success": True})
