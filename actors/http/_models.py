"""Router mode's own endpoints, in llama-server's router shapes: ``GET /models`` (every
model with its status), ``POST /models/load``, ``POST /models/unload`` and the router's
``GET /props``.

Handlers run on the event loop; the manager is asked in a control thread.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

import actors
from actors import ModelLoadError
from actors.http._errors import HttpError, from_engine_error
from actors.http._generation import dumps
from actors.http._service import Service
from actors.http._views import RUNNING, ModelViews, model_states

__all__ = ["listing", "load", "router_props", "unload"]

# The manager's states as llama-server's router names them (a restarting engine is
# loading again; a failed one is unloaded, with "failed": true).
_STATUS = {"unloaded": "unloaded", "loading": "loading", "ready": "loaded", "restarting": "loading"}


def _json(value: Any) -> Response:
    return Response(dumps(value), media_type="application/json; charset=utf-8")


# The listing reads the models' states, not their engines' stats: it waits for those only
# this long, else a model being loaded would hold it for the whole load and show as
# loaded, never as loading (llama-server's router answers at once).
_STATES_WAIT_S = 0.1


async def _states(service: Service, views: ModelViews) -> dict[str, dict[str, Any]]:
    try:
        return await service.call(model_states, views.manager, _STATES_WAIT_S)
    except Exception as e:
        raise HttpError(503, f"the model manager did not answer: {e}") from None


async def listing(service: Service, views: ModelViews) -> Response:
    """``GET /models`` and ``/v1/models`` in router mode: every registered model, with
    llama-server's ``status`` (``unloaded``, ``loading``, ``loaded``; ``failed`` and
    ``exit_code`` after a load that failed) and, once loaded, its ``meta``."""
    states = await _states(service, views)
    created = int(time.time())  # llama-server: the time of the listing
    data = []
    for name in views.names:
        state = states.get(name, {})
        status: dict[str, Any] = {"value": _STATUS.get(state.get("state", ""), "unloaded"), "args": []}
        if state.get("state") == "failed" or (status["value"] == "unloaded" and state.get("last_error")):
            status.update(failed=True, exit_code=1, error=str(state.get("last_error") or ""))
        entry: dict[str, Any] = {
            "id": name,
            "aliases": [],
            "tags": list(views.settings[name].tags),
            "object": "model",
            "owned_by": "llamacpp",
            "created": created,
            "status": status,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "can_remove": False,
            "memory_mb": round(float(state.get("estimate_mb") or 0.0)),  # ours: the estimate
        }
        view = views.loaded_view(name)
        if view is not None and status["value"] == "loaded":
            info = view.info
            entry["path"] = view.model_path
            entry["meta"] = {"n_vocab": info.get("n_vocab"), "n_ctx_train": info.get("n_ctx_train")}
        data.append(entry)
    return _json({"data": data, "object": "list"})


def router_props(service: Service) -> Response:
    """``GET /props`` without ``?model=`` in router mode: llama-server's router props."""
    settings = service.settings
    return _json(
        {
            "role": "router",
            "max_instances": settings.models_max,
            "models_autoload": settings.models_autoload,
            "model_alias": "llama-server",
            "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "ui_settings": {},
            "build_info": f"llama-cpp-actors {actors.__version__}",
            "cors_proxy_enabled": False,
        }
    )


def _router(request: Request) -> tuple[Service, ModelViews, str | None]:
    service: Service = request.app.state.service
    if service.views is None:
        raise HttpError(404, "File Not Found")  # llama-server has these routes only as a router
    body = request.state.json
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    name = body.get("model")
    return service, service.views, name if isinstance(name, str) and name in service.views.settings else None


async def load(request: Request) -> Response:
    """``POST /models/load`` ``{"model": name}``: start loading it (``{"success": true}``
    at once, as llama-server; it is ``loaded`` in ``/models`` once ready)."""
    service, views, name = _router(request)
    if name is None:
        raise HttpError(404, "model is not found")
    if (await _states(service, views))[name]["state"] in RUNNING:
        raise HttpError(400, "model is already running")
    try:
        await service.call(views.manager.load, name)
    except ModelLoadError as e:
        raise from_engine_error(e) from None
    return _json({"success": True})


async def unload(request: Request) -> Response:
    """``POST /models/unload`` ``{"model": name}``: unload it now (its requests in flight
    end with an error, as llama-server's stopped instance's do)."""
    service, views, name = _router(request)
    if name is None:
        raise HttpError(400, "model is not found")
    if (await _states(service, views))[name]["state"] not in RUNNING:
        raise HttpError(400, "model is not running")
    await service.call(views.manager.unload, name)
    return _json({"success": True})
