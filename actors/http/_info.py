"""What the server says about itself: ``/health``, ``/models``, ``/props``, ``/slots``
and ``/metrics``, in llama-server's shapes.

Handlers run on the event loop; the engine's load comes from ``GetStats`` in a worker
thread, and the slots from the last ``tick`` signal. While the model sleeps
(``--sleep-idle-seconds``) ``/health``, ``/props``, ``/models`` and ``/metrics`` answer
from what the server read before, without waking it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

import actors
from actors import GetStats
from actors.http import _models
from actors.http._errors import HttpError
from actors.http._native import generation_settings, json_response
from actors.http._service import Service, routed

__all__ = ["health", "metrics", "models", "props", "slots"]


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def health(request: Request) -> Response:
    """``GET /health``: 200 once the model has loaded (the gate answers 503 before), and
    while it sleeps; 503 if the engine has stopped since."""
    service = _service(request)
    if service.sleeping:
        return json_response({"status": "ok"})
    engine = service.handle()
    if not engine.is_alive():
        raise HttpError(503, "the engine has stopped")
    return json_response({"status": "ok"})


async def models(request: Request) -> Response:
    """``GET /v1/models``: the model under its names (OpenAI's list, llama-server's fields);
    in router mode every model, with its status."""
    service = _service(request)
    if service.views is not None:
        return await _models.listing(service, service.views)
    info = service.info
    created = int(service.t_started)
    ids = service.model_ids
    data = {
        "id": ids[0],
        "aliases": list(ids),
        "tags": list(service.settings.tags),
        "object": "model",
        "created": created,
        "owned_by": "llamacpp",
        "meta": {"n_vocab": info.get("n_vocab"), "n_ctx_train": info.get("n_ctx_train")},
    }
    listing = {"name": ids[0], "model": ids[0], "modified_at": "", "size": "", "digest": "", "type": "model"}
    return json_response({"models": [listing], "object": "list", "data": [data]})


async def _stats(service: Service) -> dict[str, Any]:
    try:
        stats = await service.call(lambda: service.handle().ask(GetStats(), timeout=10))
    except Exception as e:
        raise HttpError(503, f"the engine did not answer: {e}") from None
    return dict(stats)


async def props(request: Request) -> Response:
    """``GET /props``: the server's settings, as llama-server reports them; in router
    mode the router's without ``?model=``, else the model's."""
    service = _service(request)
    if service.views is not None:
        if not request.query_params.get("model"):
            return _models.router_props(service)
        service = await routed(request)
    defaults = {
        "max_tokens": service.limits.n_ctx_slot
        if service.settings.n_predict < 0
        else service.settings.n_predict
    }
    return json_response(
        {
            "default_generation_settings": {
                "n_ctx": service.n_ctx_slot,
                "params": generation_settings(service, defaults, stream=False),
            },
            "total_slots": service.total_slots,
            "model_alias": service.model_ids[0],
            "model_path": service.model_path,
            "modalities": {"vision": False, "audio": False},
            "chat_template": "",
            "build_info": f"llama-cpp-actors {actors.__version__}",
            "is_sleeping": service.sleeping,
        }
    )


async def slots(request: Request) -> Response:
    """``GET /slots``: each slot's state as the last tick left it (501 without ``--slots``)."""
    service = await routed(request)
    if not service.settings.slots:
        raise HttpError(501, "This server does not support slots endpoint. Start it with `--slots`")
    samples = (await _stats(service)).get("slots", ())
    listing = []
    for index, sample in enumerate(samples):
        busy = sample.state != "idle"
        listing.append(
            {
                "id": index,
                "id_task": -1,
                "n_ctx": service.n_ctx_slot,
                "speculative": False,
                "is_processing": busy,
                "state": sample.state,
                "n_tokens": sample.kv_tokens,
                "next_token": [
                    {
                        "has_next_token": busy,
                        "n_decoded": sample.generated_tokens if busy else 0,
                        "n_remain": -1,
                    }
                ],
            }
        )
    return json_response(listing)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text (501 without ``--metrics``); in router mode the
    gauges are ``?model=``'s, the counters the whole server's."""
    service = await routed(request)
    if service.metrics is None:
        raise HttpError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
    metrics = service.metrics

    def render() -> str:
        # Asleep, the engine's gauges are those of the moment it went to sleep.
        return metrics.render(
            service.stats if service.sleeping else service.handle().ask(GetStats(), timeout=10)
        )

    text = await service.call(render)
    response = Response(text, media_type="text/plain; version=0.0.4")
    # Appended raw: Starlette lowercases header names, llama-server's clients read this one as is.
    response.raw_headers.append((b"Process-Start-Time-Unix", str(int(service.t_started)).encode()))
    return response
