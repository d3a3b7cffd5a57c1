"""The engine as the HTTP layer sees it: the handle, what it reported at load, its
slots as the last ``tick`` showed them, and the server's own state (loading, ready,
draining, sleeping, requests in flight).

In router mode (several models, ``HttpSettings.models``) the engine is a
``ModelManager``, and each model gets a view of its own, a ``Service`` made when the
model is first loaded (:mod:`actors.http._views`), which handlers get from
:func:`routed`; one model's server never builds one.

Built on the event loop; ``load`` runs in a worker thread, and the ``tick`` receiver in
the engine's thread (it only replaces one reference).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from starlette.requests import Request

from actors import EngineHandle, EngineStopped, GetInfo, GetStats, GetTokenizer, Tokenizer
from actors.http._errors import HttpError
from actors.http._metrics import Metrics
from actors.http._params import MAX_CHOICES, Limits
from actors.http._settings import HttpSettings
from actors.http._sleep import Sleeper
from actors.http._stream import unless_disconnected
from actors.http._views import ModelViews

__all__ = ["CLIENT", "PARSE_TURNS", "Service", "client_key", "request_client", "routed"]

T = TypeVar("T")

_log = logging.getLogger("llama_cpp_actors.http")

# How long one call to the engine for its metadata may take (the model loads first).
_LOAD_TIMEOUT_S = 600.0
_CALL_TIMEOUT_S = 30.0


CLIENT = "llama_cpp_actors.client"
"""In a request's scope state: which API key the gate matched (``key#<index>``)."""

PARSE_TURNS = 2
"""Request bodies one client may have read in work threads at once (of 4)."""


def client_key(host: str) -> str:
    """Whose connection or request this is: the address, or an IPv6 address's /64."""
    if ":" not in host:
        return host
    try:
        return str(ipaddress.ip_network(f"{host}/64", strict=False))
    except ValueError:
        return host


class Service:
    """Everything a handler needs besides its request (event loop, except where noted).

    Args:
        settings: the HTTP settings.
        start_engine: makes the engine handle (a ServerActor ref, a Supervisor, a
            ServerPool, or in router mode a ModelManager); called once, in a worker
            thread, by :meth:`load`.
        parent: router mode: the router's service, whose threads and metrics a model's
            view shares.
    """

    def __init__(
        self, settings: HttpSettings, start_engine: Callable[[], Any], parent: Service | None = None
    ) -> None:
        self.settings = settings
        self._start_engine = start_engine
        self.views: ModelViews | None = None  # router mode's models
        self.engine: EngineHandle | None = None
        self.tokenizer: Tokenizer | None = None
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.load_error: BaseException | None = None
        self.ready = False
        self.on_load_failed: Callable[[], None] | None = None
        self.on_ready: Callable[[], None] | None = None  # serve's banner
        self.draining = False
        self.sleeper: Sleeper | None = None  # --sleep-idle-seconds, once loaded
        self.in_flight = 0
        self.tasks: set[asyncio.Task[Any]] = set()  # every request being handled
        self.drain_expired = False
        self.control: ThreadPoolExecutor
        self.work: ThreadPoolExecutor
        self.metrics: Metrics | None
        self.t_started: float
        self._parsing: dict[str, tuple[asyncio.Semaphore, list[int]]]  # per client: its turns, its jobs
        if parent is not None:
            self.control, self.work = parent.control, parent.work
            self.t_started, self.metrics = parent.t_started, parent.metrics
            self._parsing = parent._parsing
            return
        self._parsing = {}
        # Worker threads of their own, so a burst of long prompts being prepared (in the
        # loop's default executor) never delays /slots, /metrics or /tokenize.
        self.control = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llama-cpp-actors-http-control")
        self.work = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llama-cpp-actors-http-work")
        self.t_started = time.time()
        self.metrics = Metrics() if settings.metrics else None

    # -- loading (a worker thread) ---------------------------------------------------

    def load(self) -> None:
        """Start the engine and read its metadata; a failure is kept in ``load_error``."""
        try:
            engine = self._start_engine()
            self.engine = engine
            if self.settings.models:  # router mode: each model's view is made when it loads
                self.views = ModelViews(self, engine)
                return
            self.info = dict(engine.ask(GetInfo(), timeout=_LOAD_TIMEOUT_S))
            self.stats = dict(engine.ask(GetStats(), timeout=_CALL_TIMEOUT_S))
            self.tokenizer = engine.ask(GetTokenizer(), timeout=_CALL_TIMEOUT_S)
        except BaseException as e:
            self.load_error = e
            if self.on_load_failed is None:  # else serve reports it, once, and exits
                _log.error("the model failed to load: %s", e)

    async def start(self) -> None:
        """Load in a worker thread, so ``/health`` answers 503 meanwhile; on failure
        call ``on_load_failed`` (the server then exits)."""
        await asyncio.to_thread(self.load)
        self.ready = self.load_error is None
        if self.ready:
            lower_priority(self.settings.loop_nice)
            if self.settings.sleep_idle_s is not None and not self.settings.models:
                self.sleeper = Sleeper(self, self.settings.sleep_idle_s)
                self.sleeper.start()
            if self.on_ready is not None:
                self.on_ready()
        if self.load_error is not None and self.on_load_failed is not None:
            self.on_load_failed()

    def cancel_all(self) -> None:
        """The drain's time is up: cancel every request still being handled (event loop)."""
        self.drain_expired = True
        for task in list(self.tasks):
            task.cancel()

    def child(self, settings: HttpSettings, start_engine: Callable[[], Any]) -> Service:
        """A service for one of the router's models, sharing this one's threads."""
        return Service(settings, start_engine, parent=self)

    async def call(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in a control thread (GetStats and the like)."""
        return await asyncio.get_running_loop().run_in_executor(self.control, function, *args)

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in a work thread (tokenizing, templates)."""
        return await asyncio.get_running_loop().run_in_executor(self.work, function, *args)

    async def parse(self, client: str, function: Callable[[], T]) -> T:
        """``function()`` (a request body read into prompts and options) in a work thread,
        at most ``PARSE_TURNS`` of ``client``'s at once (event loop): one client's huge
        bodies leave the other work threads to the others."""
        turns, jobs = self._parsing.setdefault(client, (asyncio.Semaphore(PARSE_TURNS), [0]))
        jobs[0] += 1
        try:
            async with turns:
                return await self.run(function)
        finally:
            jobs[0] -= 1
            if not jobs[0]:
                del self._parsing[client]

    def handle(self) -> EngineHandle:
        """The loaded engine (the gate admits a request only once it is; any thread).

        Raises:
            EngineStopped: no engine is loaded (yet, or any more).
        """
        if self.engine is None:
            raise EngineStopped("the model is not loaded")
        return self.engine

    def close(self) -> None:
        """Stop the engine (lifespan shutdown)."""
        if self.views is not None:
            self.views.close()
        if self.metrics is not None:
            self.metrics.close()
        self.control.shutdown(wait=False, cancel_futures=True)
        self.work.shutdown(wait=False, cancel_futures=True)
        # The engine this service started (a model's view has its manager's handle,
        # which the manager stops).
        stop = getattr(self.engine, "stop", None)
        if stop is not None:
            try:
                stop(timeout=30)
            except Exception as e:
                _log.warning("stopping the engine: %s", e)

    # -- what handlers read ----------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        """Whether the model is unloaded for idleness (``--sleep-idle-seconds``)."""
        return self.sleeper is not None and self.sleeper.sleeping

    @property
    def model_path(self) -> str:
        return str(self.info.get("model_path") or "")

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The names the model answers to, llama-server's way: the aliases sorted, or
        the model file's name."""
        if self.settings.model_ids:
            return tuple(sorted(set(self.settings.model_ids)))
        return (os.path.basename(self.model_path) or "model",)

    @property
    def n_ctx_slot(self) -> int:
        return int(self.stats.get("n_ctx_per_slot") or self.info.get("n_ctx") or 1)

    @property
    def total_slots(self) -> int:
        return int(self.stats.get("active_slots", 0)) + int(self.stats.get("idle_slots", 0))

    @property
    def limits(self) -> Limits:
        n_parallel = int(self.info.get("n_parallel") or MAX_CHOICES)  # one engine's (a pool's replica's)
        return Limits(n_predict=self.settings.n_predict, n_ctx_slot=self.n_ctx_slot, n_parallel=n_parallel)

    def need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise HttpError(503, "Loading model")
        return self.tokenizer

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a piece of text, without BOS (for logit_bias keys)."""
        return self.need_tokenizer().tokenize(text, add_special=False, parse_special=False)


async def routed(request: Request) -> Service:
    """The service of the model ``request`` names (event loop): in router mode, its
    model's view, loaded first if needed; else the one service, at once.

    Raises:
        HttpError: router mode: no model named (with several), an unknown one, one not
            loaded with autoload off (400), or one that cannot load now (503).
    """
    service: Service = request.app.state.service
    if service.views is None:
        return service
    state = request.scope.setdefault("state", {})  # the gate's scope too: it releases the model
    body = getattr(request.state, "json", None)
    view = await service.views.view(
        body, request.query_params, state, lambda loading: unless_disconnected(request, loading)
    )
    return cast(Service, view)  # the router's views are children of this service


def lower_priority(nice: int) -> None:
    """This thread (and the threads it starts from now on) at ``nice``, if that is lower
    priority than it has: Linux only, where a thread's nice value is its own (elsewhere
    ``setpriority`` would change the whole process, llama.cpp's threads included)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # 0: the calling thread, on Linux
    except OSError as e:
        _log.warning("could not lower the event loop's priority: %s", e)


def request_client(request: Request) -> str:
    """Who sent ``request``: the API key the gate matched (``CLIENT`` in the scope's
    state) when the server has keys, else its address (``client_key``); the turns of
    :meth:`Service.parse` are per client."""
    state = request.scope.get("state")
    key = state.get(CLIENT) if isinstance(state, dict) else None
    if key is not None:
        return str(key)
    return client_key(request.client.host) if request.client else ""
