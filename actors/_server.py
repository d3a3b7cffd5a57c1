"""``ServerActor``: a pykka actor that owns one model and serves it to many callers.

Options are checked in ``__init__`` (the caller's thread, so ``start()`` raises); the
model is loaded in ``on_start`` (the actor's thread, the only one that touches it).
The actor sends itself a tick message while a slot or the queue has work; caller
messages interleave with ticks, and an idle engine uses no CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pykka

import telemetry
from actors._engine import Engine, EngineConfig
from actors._errors import ConfigError, EngineError, EngineStopped, InvalidRequest
from actors._llama import BackendOptions, LlamaBackend, default_n_threads
from actors._messages import (
    STREAMING,
    Cancel,
    Drain,
    GetInfo,
    GetStats,
    GetTokenizer,
    SamplingParams,
    SubmitMessage,
    _Submit,
)
from actors._model import resolve_model_path
from actors._results import Failed
from actors._tokenizer import Tokenizer
from strategies import BatchStrategy, DecodeMaximal

__all__ = ["ServerActor"]

_log = logging.getLogger("llama_cpp_actors.server")


@dataclass(frozen=True, slots=True)
class _Tick:
    """The message the actor sends itself while there is work."""


_TICK = _Tick()
_live_servers: weakref.WeakSet[ServerActor] = weakref.WeakSet()
# Why an actor died, by actor URN: a Supervisor reads it to tell a crash from a stop.
_crashes: dict[str, str] = {}


def crash_reason(actor_urn: str) -> str | None:
    """Why the actor with this URN crashed, or None if it stopped on request (any thread)."""
    return _crashes.pop(actor_urn, None)


@atexit.register
def _stop_live_servers() -> None:
    # The actor threads are daemons so a forgotten server never hangs interpreter
    # exit; stop them here so llama.cpp is not torn down in the middle of a decode.
    for server in list(_live_servers):
        with contextlib.suppress(Exception):  # best effort at exit
            server.actor_ref.stop(block=True, timeout=5)


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


class ServerActor(pykka.ThreadingActor):
    """Serves one llama.cpp model to many concurrent callers with continuous batching.

    Start it with ``ServerActor.start(**options)`` and talk to the returned ``ActorRef``:
    ``ref.ask(Generate(...))`` returns a future of the ``Completion`` once the request is
    admitted; ``ref.tell(Stream(..., reply_to=q))`` puts ``Token`` events then one
    ``Done`` or ``Failed`` on ``q``. See the README for every option.
    """

    use_daemon_thread = True

    def __init__(
        self,
        *,
        model_path: str | os.PathLike[str] | None = None,
        n_parallel: int = 4,
        n_ctx: int = 8192,
        n_batch: int | None = None,
        chunk_size: int = 512,
        max_queue: int = 64,
        cache_prompt: bool = True,
        batch_strategy: BatchStrategy | None = None,
        n_threads: int | None = None,
        temp: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        seed: int | None = None,
        penalty_last_n: int = 64,
        penalty_repeat: float = 1.0,
        penalty_freq: float = 0.0,
        penalty_present: float = 0.0,
        grammar: str | None = None,
        n_ubatch: int | None = None,
        n_threads_batch: int | None = None,
        flash_attn: bool | None = None,
        type_k: int | None = None,
        type_v: int | None = None,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        use_mlock: bool = False,
        n_ctx_per_slot: int | None = None,
        context_shift: bool = True,
        prompt_cache_ram_mb: float = 0,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty str or None, got {name!r}")
        n_ctx = _positive("n_ctx", n_ctx)
        n_parallel = _positive("n_parallel", n_parallel)
        n_batch = _positive("n_batch", n_batch) if n_batch is not None else min(n_ctx, 2048)
        n_ubatch = _positive("n_ubatch", n_ubatch) if n_ubatch is not None else min(n_batch, 512)
        n_threads = _positive("n_threads", n_threads) if n_threads is not None else default_n_threads()
        n_threads_batch = (
            _positive("n_threads_batch", n_threads_batch) if n_threads_batch is not None else n_threads
        )
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise ConfigError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if batch_strategy is None:
            batch_strategy = DecodeMaximal()
        if not isinstance(batch_strategy, BatchStrategy):
            raise ConfigError(f"batch_strategy must be a BatchStrategy, got {batch_strategy!r}")
        try:
            defaults = SamplingParams(
                temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                penalty_last_n=penalty_last_n, penalty_repeat=penalty_repeat,
                penalty_freq=penalty_freq, penalty_present=penalty_present, grammar=grammar,
            )  # fmt: skip
        except InvalidRequest as e:
            raise ConfigError(str(e)) from None
        self.actor_options = BackendOptions(
            model_path=resolve_model_path(model_path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_parallel=n_parallel,
            n_threads=n_threads,
            n_threads_batch=n_threads_batch,
            flash_attn=flash_attn,
            type_k=type_k,
            type_v=type_v,
            n_gpu_layers=n_gpu_layers,
            use_mmap=use_mmap,
            use_mlock=use_mlock,
        )
        if n_ctx_per_slot is not None and _positive("n_ctx_per_slot", n_ctx_per_slot) > n_ctx:
            raise ConfigError(f"n_ctx_per_slot ({n_ctx_per_slot}) cannot exceed n_ctx ({n_ctx})")
        if not isinstance(prompt_cache_ram_mb, int | float) or not 0 <= prompt_cache_ram_mb < float("inf"):
            raise ConfigError(f"prompt_cache_ram_mb must be a number >= 0, got {prompt_cache_ram_mb!r}")
        self.actor_config = EngineConfig(
            chunk_size=_positive("chunk_size", chunk_size),
            max_queue=max_queue,
            cache_prompt=bool(cache_prompt),
            batch_strategy=batch_strategy,
            defaults=defaults,
            n_ctx_per_slot=n_ctx_per_slot,
            context_shift=bool(context_shift),
            ram_budget_bytes=int(prompt_cache_ram_mb * 1024 * 1024),
            name=name,
        )
        self.actor_engine: Engine | None = None
        self._who = "the engine" if name is None else f"the engine {name!r}"  # in error messages
        self._tick_scheduled = False
        self._drain: tuple[pykka.ThreadingFuture[int], float | None] | None = None

    # -- lifecycle (actor thread) --------------------------------------------------

    def on_start(self) -> None:
        """Load the model and make the context (actor thread)."""
        path = self.actor_options.model_path
        t0 = time.perf_counter()
        name = self.actor_config.name
        labels: dict[str, Any] = (
            {"model_path": path} if name is None else {"model_path": path, "replica": name}
        )

        def progress(fraction: float) -> None:
            if telemetry.model_load.receivers:
                telemetry.emit(
                    telemetry.model_load,
                    self.actor_ref,
                    {"progress": fraction, "load_ms": None},
                    labels,
                )

        try:
            backend = LlamaBackend(self.actor_options, on_progress=progress)
        except Exception as e:
            _crashes[self.actor_urn] = f"loading failed: {e!r}"
            # pykka drops the tells left in the inbox when on_start fails: answer them.
            self._fail_inbox(EngineStopped(f"{self._who} could not load its model: {e!r}"))
            raise
        if self.actor_options.n_batch > backend.n_batch:  # llama.cpp clamps; keep it honest
            _log.warning("n_batch clamped by llama.cpp to %d", backend.n_batch)
        self.actor_engine = Engine(backend, self.actor_config, self.actor_ref)
        _live_servers.add(self)
        if telemetry.model_load.receivers:
            load_ms = (time.perf_counter() - t0) * 1000.0
            telemetry.emit(
                telemetry.model_load,
                self.actor_ref,
                {"progress": 1.0, "load_ms": load_ms},
                labels,
            )

    def on_stop(self) -> None:
        """Fail what is pending, free the model (actor thread)."""
        self._shutdown(EngineStopped(f"{self._who} was stopped"))

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Fail what is pending after a crash, so no caller waits (actor thread)."""
        _crashes[self.actor_urn] = repr(exception_value)
        self._shutdown(EngineStopped(f"{self._who} crashed: {exception_value!r}"))

    def _shutdown(self, error: EngineError) -> None:
        _live_servers.discard(self)
        engine, self.actor_engine = self.actor_engine, None
        if engine is None:
            return
        try:
            engine.fail_all(error)
            self._fail_inbox(error)
        finally:
            engine.backend.close()

    def _fail_inbox(self, error: EngineError) -> None:
        # pykka answers asks left in the inbox with ActorDeadError but drops tells:
        # a Stream still in the inbox would leave its consumer waiting forever.
        inbox = self.actor_inbox
        keep = []
        while not inbox.empty():
            envelope = inbox.get()
            message = envelope.message
            if isinstance(message, STREAMING):
                with contextlib.suppress(Exception):  # the consumer is gone too
                    message.reply_to.put(Failed(message.request_id, error))
            elif isinstance(message, SubmitMessage) and envelope.reply_to is not None:
                envelope.reply_to.set_exception(exc_info=(type(error), error, None))
            else:
                keep.append(envelope)
        for envelope in keep:
            inbox.put(envelope)

    # -- messages (actor thread) ---------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """Dispatch one message; ticks are self-sent, the rest come from callers."""
        engine = self.actor_engine
        if engine is None:
            raise EngineStopped("the engine is not running")
        if message is _TICK:
            self._tick_scheduled = False
            engine.step()
            if self._drain is not None:
                self._check_drain(engine)
        elif isinstance(message, SubmitMessage):
            future: pykka.ThreadingFuture[object] = pykka.ThreadingFuture()
            engine.admit(message, future=future)
            self._schedule()
            return future
        elif isinstance(message, _Submit):
            engine.admit(message.message, future=message.future)
        elif isinstance(message, STREAMING):
            try:
                engine.admit(message, reply_to=message.reply_to)
            except EngineError as error:
                try:
                    message.reply_to.put(Failed(message.request_id, error))
                except Exception:
                    _log.warning("could not deliver %r for %s", error, message.request_id)
        elif isinstance(message, Cancel):
            engine.cancel(message.request_id)
        elif isinstance(message, GetStats):
            return engine.stats()
        elif isinstance(message, GetInfo):
            return self._info(engine)
        elif isinstance(message, GetTokenizer):
            return Tokenizer(engine.backend)
        elif isinstance(message, Drain):
            return self._start_drain(engine, message)
        else:
            _log.warning("ignored an unknown message: %r", message)
            return None
        self._schedule()
        return None

    def _start_drain(self, engine: Engine, message: Drain) -> pykka.ThreadingFuture[int]:
        if self._drain is None:
            deadline = None if message.timeout is None else time.monotonic() + message.timeout
            self._drain = (pykka.ThreadingFuture(), deadline)
            engine.draining = True
            self._check_drain(engine)
            self._schedule()
        return self._drain[0]

    def _check_drain(self, engine: Engine) -> None:
        """Stop once the work is done, or fail what is left when the drain times out."""
        assert self._drain is not None
        future, deadline = self._drain
        unfinished = 0
        if engine.has_work:
            if deadline is None or time.monotonic() < deadline:
                return
            unfinished = len(engine.requests)
            engine.fail_all(EngineStopped("the drain timed out before the request finished"))
        future.set(unfinished)
        self.stop()  # after this message: pending callers are already answered

    def _schedule(self) -> None:
        engine = self.actor_engine
        if not self._tick_scheduled and engine is not None and engine.has_work:
            self._tick_scheduled = True
            self.actor_ref.tell(_TICK)

    def _info(self, engine: Engine) -> dict[str, Any]:
        backend = engine.backend
        return {
            "model_path": self.actor_options.model_path,
            "n_vocab": backend.n_vocab,
            "n_ctx_train": backend.n_ctx_train,
            "has_chat_template": backend.has_chat_template,
            "n_ctx": backend.n_ctx,
            "n_parallel": backend.n_seq_max,
            "n_batch": backend.n_batch,
            "n_threads": self.actor_options.n_threads,
        }
