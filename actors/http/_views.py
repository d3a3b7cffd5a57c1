"""Router mode: which model a request names, and that model's view (a ``Service`` of
its own: its engine handle, info, stats and tokenizer), as llama-server's router
resolves a request's ``model`` before proxying it.

A view is made when its model is first needed and loaded, and dropped when the
``ModelManager`` unloads the model (the ``model_unload`` signal): a reloaded model gets
a fresh view, so a request never tokenizes with the vocabulary of an engine that has
stopped (one that raced an unload gets ``EngineStopped``, a 503, never a crash: the
backend refuses calls once its model is freed).

A model that cannot load until another goes idle (``--models-max``, the memory budget)
waits, as llama-server's router queues it: requests for one model share one load, the
models waiting ask again in the order they came, and a model is busy for the router
from the moment a request is routed to it until the last byte of its answer (the app's
gate calls :meth:`ModelViews.release`), so a waiting model never evicts it mid-request.

Runs on the event loop, except the work of loading (a control thread) and the signal's
receiver (the manager's thread; it only pops a dict entry and counts).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import telemetry
from actors import (
    EngineHandle,
    EngineStopped,
    GetInfo,
    GetStats,
    GetTokenizer,
    ModelFailedLately,
    ModelLoadError,
    ModelManager,
)
from actors.http._errors import HttpError, from_engine_error
from actors.http._settings import HttpSettings

_T = TypeVar("_T")


class View(Protocol):
    """What the router needs of a service (``actors.http._service.Service``): its
    settings, its control threads, and the fields a model's view fills."""

    settings: HttpSettings
    engine: EngineHandle | None
    info: dict[str, Any]
    stats: dict[str, Any]
    tokenizer: Any
    ready: bool

    @property
    def model_path(self) -> str:
        """The loaded model's file."""
        ...

    async def call(self, function: Callable[..., _T], *args: Any) -> _T:
        """Run ``function(*args)`` on a control thread."""
        ...

    def child(self, settings: HttpSettings, start_engine: Callable[[], Any]) -> View:
        """A service for one of the router's models, sharing this one's threads."""
        ...


__all__ = ["RUNNING", "ModelViews", "model_states"]

_LOAD_TIMEOUT_S = 600.0  # a model's first request waits this long for it to load
_CALL_TIMEOUT_S = 30.0
_STATS_TIMEOUT_S = 2.0
# A model that cannot load until another goes idle: its requests wait this long at most,
# asking again every _QUEUE_POLL_S (llama-server's router queues them too).
_QUEUE_TIMEOUT_S = ModelManager.DEFAULT_WAIT_S  # as a ModelManager's own requests wait
_QUEUE_POLL_S = 0.1
_LOAD_HOLD_S = 1.0  # a model just loaded stays busy this long for its waiting requests to hold it
_HELD = "llama_cpp_actors.model"  # in a request's scope state: the model it holds
_MAX_NAME_SHOWN = 256


def _shown(name: str) -> str:
    return name if len(name) <= _MAX_NAME_SHOWN else name[:_MAX_NAME_SHOWN] + "..."


# The manager's states in which llama-server calls a model running (a failed one is not).
RUNNING = frozenset({"loading", "ready", "restarting"})


def model_states(manager: Any, wait_s: float = _STATS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """Every model's entry of the manager's ``GetStats`` (a control thread); ``wait_s``
    bounds the wait for the engines' own stats (a loading engine gives them once loaded)."""
    models: dict[str, dict[str, Any]] = manager.ask(GetStats(), timeout=wait_s)["models"]
    return models


class _ModelEngine:
    """A model's handle as a view's engine (callers' threads): every message goes to
    the model, and ``GetStats`` gives its engine's stats, as a ServerActor's does (a
    handle's gives the model's entry of the manager's stats, the engine's inside)."""

    __slots__ = ("handle", "name")

    def __init__(self, handle: EngineHandle, name: str) -> None:
        self.handle = handle
        self.name = name

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        if isinstance(message, GetStats):
            stats = self.handle.ask(message, timeout=timeout)["engine"]
            if stats is None:  # unloaded, or loading again since
                raise EngineStopped(f"model {self.name!r} is not loaded")
            return stats
        return self.handle.ask(message, block=block, timeout=timeout)

    def tell(self, message: Any) -> None:
        self.handle.tell(message)

    def is_alive(self) -> bool:
        return bool(self.handle.is_alive())


class ModelViews:
    """The models of a router: their settings, and a view for each loaded one.

    Args:
        root: the router's own service (its threads and metrics are shared).
        manager: the ``ModelManager`` the router's engine is.
    """

    def __init__(self, root: View, manager: Any) -> None:
        self.root = root
        self.manager = manager
        self.settings: Mapping[str, HttpSettings] = dict(root.settings.models)
        self.names = tuple(self.settings)
        self._views: dict[str, View] = {}
        self._loading: dict[str, asyncio.Future[View]] = {}
        self._unloads: dict[str, int] = {}
        self._queue: list[str] = []  # models waiting for room, in arrival order
        # Requests being handled per model, from routing to their last byte: a model
        # is busy for the router from before its engine sees the request (tokenizing)
        # to the end of its stream, so a queued model never takes its place meanwhile.
        self._active: dict[str, int] = {}
        self._waiting: dict[str, int] = {}  # requests waiting for each model's load
        # Threads of their own: a load waits seconds for its model, which must not hold
        # the control threads /slots, /metrics and the queue's looks use.
        self._loads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llama-cpp-actors-http-load")
        self._subscription = telemetry.Subscription({telemetry.model_unload: self._on_unload})

    def close(self) -> None:
        """Stop listening for unloads (lifespan shutdown)."""
        self._subscription.close()
        self._loads.shutdown(wait=False, cancel_futures=True)

    def _on_unload(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        # The manager's thread: the next request for this model makes a fresh view.
        if sender is self.manager:
            name = metadata["model"]
            self._views.pop(name, None)
            self._unloads[name] = self._unloads.get(name, 0) + 1

    def loaded_view(self, name: str) -> View | None:
        """The model's view if it is loaded as far as the router knows."""
        return self._views.get(name)

    def name_of(self, value: object) -> str:
        """The registered model ``value`` names (llama-server's ``router_validate_model``):
        with one model, a request may leave it out (ours; llama-server always asks).

        Raises:
            HttpError: 400, no model named (with several) or an unknown one.
        """
        if value is None or value == "":
            if len(self.names) == 1:
                return self.names[0]
            raise HttpError(400, "model name is missing from the request")
        if not isinstance(value, str):
            raise HttpError(400, f"model must be a string, got {type(value).__name__}")
        if value not in self.settings:
            raise HttpError(400, f"model '{_shown(value)}' not found")
        return value

    def release(self, scope: Mapping[str, Any]) -> None:
        """The request of ``scope`` has ended: its model is no longer busy for it (event loop)."""
        state = scope.get("state")
        name = state.pop(_HELD, None) if isinstance(state, dict) else None
        if name is not None:
            self._active[name] -= 1

    async def view(
        self,
        body: object,
        query: Mapping[str, str],
        state: dict[str, Any],
        unless_gone: Callable[[Awaitable[View]], Awaitable[View]],
    ) -> View:
        """The view of the model a request names (its body's ``model``, or ``?model=``
        for a GET), loaded first when autoload allows (event loop). The request holds
        the model (``state``: its scope's) until :meth:`release`; ``unless_gone`` awaits
        the load, or raises ``ClientGone`` when the client leaves first.

        Raises:
            HttpError: 400 as :meth:`name_of`, or ``model is not loaded`` (autoload
                off); 503 when it cannot load: the budget or ``--models-max`` is held
                by pinned models, or by busy ones for longer than the queue's wait.
        """
        named = body.get("model") if isinstance(body, dict) else query.get("model")
        name = self.name_of(named)
        view = self._views.get(name) or await unless_gone(self._loaded(name, query))
        if _HELD not in state:
            state[_HELD] = name
            self._active[name] = self._active.get(name, 0) + 1
        return view

    async def _loaded(self, name: str, query: Mapping[str, str]) -> View:
        choice = query.get("autoload")
        autoload = self.root.settings.models_autoload if choice is None else choice in ("true", "1")
        loading = self._loading.get(name)
        if loading is None:
            loading = asyncio.ensure_future(self._load(name, autoload))
            self._loading[name] = loading
            loading.add_done_callback(lambda done: self._done(name, done))
        self._waiting[name] = self._waiting.get(name, 0) + 1
        try:
            return await asyncio.shield(loading)  # a client that leaves leaves the load to the others
        finally:
            self._waiting[name] -= 1

    def _done(self, name: str, loading: asyncio.Future[View]) -> None:
        self._loading.pop(name, None)
        if not loading.cancelled():
            loading.exception()  # retrieved: its waiters got it, or left (no "never retrieved")

    async def _admit(self, name: str) -> None:
        """Load ``name`` (at once if it is loaded; its engine loads in its own thread),
        waiting while the models that hold the room are busy: the first model to wait
        is the first to ask again (llama-server's router queue, FIFO)."""
        deadline = time.monotonic() + _QUEUE_TIMEOUT_S
        queued = False
        try:
            while True:
                late = time.monotonic() > deadline
                if (not queued or self._queue[0] == name) and (late or await self.root.call(self._now, name)):
                    try:
                        await asyncio.get_running_loop().run_in_executor(self._loads, self.manager.load, name)
                        return
                    except ModelFailedLately as e:
                        raise from_engine_error(e) from None  # waiting would not help it
                    except ModelLoadError as e:
                        if late or not await self.root.call(self._may_free, name):
                            raise from_engine_error(e) from None
                if not self._waiting.get(name):  # its clients all left: it takes no one's place
                    raise HttpError(503, f"every request for model '{name}' left while it waited")
                if not queued:
                    self._queue.append(name)
                    queued = True
                await asyncio.sleep(_QUEUE_POLL_S)
        finally:
            if queued:
                self._queue.remove(name)

    def _now(self, name: str) -> bool:
        """Whether to ask the manager for ``name`` now (a control thread): it is loaded,
        there is room, a model that holds the room is idle here and in its engine, or
        only pinned ones hold it (the manager's refusal then says so)."""
        snapshot = self.manager.ask(GetStats(), timeout=_STATS_TIMEOUT_S)
        models, most = snapshot["models"], snapshot["max_models"]
        loaded = [n for n, s in models.items() if s["loaded"] and n != name]
        if models[name]["loaded"] or not most or len(loaded) < most:
            return True
        if all(models[n]["pinned"] for n in loaded):
            return True
        return any(
            not models[n]["pinned"] and not self._active.get(n) and not models[n]["in_flight"] for n in loaded
        )

    def _may_free(self, name: str) -> bool:
        """Whether a loaded model other than ``name`` may go idle and make way (a
        control thread): pinned ones never do."""
        states = model_states(self.manager)
        return any(s["loaded"] and not s["pinned"] for other, s in states.items() if other != name)

    def _unhold(self, name: str) -> None:
        self._active[name] -= 1

    async def _load(self, name: str, autoload: bool) -> View:
        # Busy from now: a queued model must not take its place before its requests hold it.
        self._active[name] = self._active.get(name, 0) + 1
        try:
            return await self._make(name, autoload)
        finally:
            asyncio.get_running_loop().call_later(_LOAD_HOLD_S, self._unhold, name)

    async def _make(self, name: str, autoload: bool) -> View:
        unloads = self._unloads.get(name, 0)
        manager = self.manager
        if autoload:
            await self._admit(name)

        def work() -> tuple[Any, Any, Any, Any]:  # a control thread
            if not autoload and model_states(manager)[name]["state"] not in RUNNING:
                raise HttpError(400, "model is not loaded")
            handle = _ModelEngine(manager.engine(name), name)
            info = handle.ask(GetInfo(), timeout=_LOAD_TIMEOUT_S)  # answered once loaded
            stats = handle.ask(GetStats(), timeout=_CALL_TIMEOUT_S)
            return handle, info, stats, handle.ask(GetTokenizer(), timeout=_CALL_TIMEOUT_S)

        try:
            handle, info, stats, tokenizer = await asyncio.get_running_loop().run_in_executor(
                self._loads, work
            )
        except ModelLoadError as e:
            if not autoload:  # the manager's autoload is off and the model is not loaded
                raise HttpError(400, "model is not loaded") from None
            raise from_engine_error(e) from None
        view = self.root.child(self.settings[name], lambda: handle)
        view.engine, view.info, view.stats, view.tokenizer = handle, dict(info), dict(stats), tokenizer
        view.ready = True
        if self._unloads.get(name, 0) == unloads:  # else it was unloaded meanwhile: not kept
            self._views[name] = view
        return view
