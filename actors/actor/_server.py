"""``ServerActor``: a pykka actor that owns one model and serves it to many callers.

Options are checked in ``__init__`` (the caller's thread, so ``start()`` raises); the
model is loaded in ``on_start`` (the actor's thread, the only one that touches it).
The actor sends itself a tick message while a slot or the queue has work; caller
messages interleave with ticks, and an idle engine uses no CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from types import TracebackType
from typing import Any

import pykka

import telemetry
from actors.actor._crashes import TickCrashed, crashes, live_servers
from actors.actor._estimate import kv_file_bound
from actors.actor._loading import engine_info, load_draft, load_model
from actors.actor._options import ServerOptions
from actors.actor._ref import TICK, EngineRef, _Admit, _Told
from actors.backend import LlamaBackend, Tokenizer, check_adapters, resolve_model_path
from actors.contract import (
    STREAMING,
    AdmittedMessage,
    AskedMessage,
    Cancel,
    CancelExact,
    Decide,
    Drain,
    Embed,
    EngineError,
    EngineStopped,
    EraseSlot,
    Failed,
    GetInfo,
    GetLora,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    RequestMessage,
    RestoreSlot,
    SaveSlot,
    SetLora,
    Submit,
)
from actors.engine import (
    Engine,
    Prepared,
    PreparedDecision,
    PreparedEmbed,
    courier,
    prepare,
    prepare_decision,
    prepare_embed,
    settle,
)

__all__ = ["ServerActor"]

_log = logging.getLogger("llama_cpp_actors.server")


class ServerActor(pykka.ThreadingActor):
    """Serves one llama.cpp model to many concurrent callers with continuous batching.

    Start it with ``ServerActor.start(**options)`` and talk to the returned ``ActorRef``:
    ``ref.ask(Generate(...))`` returns a future of the ``Completion`` once the request is
    admitted; ``ref.tell(Stream(..., reply_to=q))`` puts ``Token`` events (after
    ``Progress`` events with ``progress=True``) then one ``Done`` or ``Failed`` on ``q``.
    docs/reference/options.md describes every option.
    """

    use_daemon_thread = True

    @property
    def actor_ref(self) -> EngineRef:
        """This actor's ref: an :class:`actors.actor._ref.EngineRef`."""
        return self._actor_ref  # type: ignore[return-value]

    def __init__(self, options: ServerOptions | None = None, /, **changes: Any) -> None:
        """Check the options (the caller's thread); the model loads in ``on_start``.

        Args:
            options: a :class:`ServerOptions`, or None for the defaults.
            **changes: options by name (``ServerActor.start(n_parallel=8)``), over
                ``options``; every name is in the options reference.

        Raises:
            TypeError: a name that is not an option (with the one it likely meant).
            ConfigError: a value out of range, or two that contradict each other.
            ModelLoadError: the model file cannot be found.
        """
        super().__init__()
        # pykka made a plain ActorRef; ours prepares requests in the sender's thread.
        self._actor_ref = EngineRef(self)
        # Every option is checked, alone and against the others, before anything is
        # loaded: llama.cpp aborts the process on some of them (see actors.actor._options).
        options = ServerOptions.given(options, changes)
        self.actor_server_options = options
        checked = options.checked
        self.actor_options = checked.backend_options(resolve_model_path(checked.model_path))
        # llama.cpp would read a bad adapter only to refuse it: refused here, at once.
        check_adapters(self.actor_options.model_path, checked.lora)
        # The draft model (spec_type="draft"): the target's context options, its own file.
        self.actor_draft_options = (
            None
            if checked.draft_model_path is None
            else dataclasses.replace(
                self.actor_options,
                model_path=resolve_model_path(checked.draft_model_path, "draft_model_path="),
                type_k=None,
                type_v=None,
            )
        )
        self.actor_config = checked.engine_config()
        self.actor_config.kv_file_max_bytes = kv_file_bound(checked)
        self.actor_chat_template = checked.chat_template
        self.actor_chat_template_kwargs = checked.chat_template_kwargs
        self.actor_engine: Engine | None = None
        self.actor_backend: LlamaBackend | None = None  # the engine's, once loaded
        self._who = (
            "the engine" if checked.name is None else f"the engine {checked.name!r}"
        )  # in error messages
        self._tick_scheduled = False
        self._drain: tuple[pykka.ThreadingFuture[int], float | None] | None = None
        self._drain_future: pykka.ThreadingFuture[int] | None = None  # every Drain gets this one
        self._crash_recorded = False

    # -- lifecycle (actor thread) --------------------------------------------------

    def on_start(self) -> None:
        """Load the model and make the context (actor thread)."""
        self.actor_ref.thread_ident = threading.get_ident()
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
            backend = load_model(
                self.actor_options,
                progress,
                self.actor_chat_template,
                self.actor_chat_template_kwargs,
                self.actor_config.defaults.grammar,
            )
        except Exception as e:
            crashes[self.actor_urn] = f"loading failed: {e!r}"
            # pykka drops the tells left in the inbox when on_start fails: answer them.
            self._fail_inbox(EngineStopped(f"{self._who} could not load its model: {e!r}"))
            raise
        try:
            draft = load_draft(backend, self.actor_draft_options)
        except Exception as e:
            backend.close()
            crashes[self.actor_urn] = f"loading the draft model failed: {e!r}"
            self._fail_inbox(EngineStopped(f"{self._who} could not load its draft model: {e!r}"))
            raise
        try:
            self.actor_engine = Engine(
                backend, self.actor_config, self.actor_ref, draft, on_stall=self._cancel_stalled
            )
        except BaseException:
            backend.close()
            if draft is not None:
                draft.close()
            raise
        self.actor_ref.n_ctx_slot = self.actor_engine.n_ctx_slot
        self.actor_ref.backend = self.actor_backend = backend
        live_servers.add(self)
        if telemetry.model_load.receivers:
            load_ms = (time.perf_counter() - t0) * 1000.0
            telemetry.emit(
                telemetry.model_load,
                self.actor_ref,
                {"progress": 1.0, "load_ms": load_ms},
                labels,
            )

    def _cancel_stalled(self, message: RequestMessage) -> None:
        """A stream's consumer stopped reading: cancel that very request (the courier's
        thread; the cancel waits its turn in the inbox)."""
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(CancelExact(message.request_id, message))

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
        if not self._crash_recorded:  # else a Supervisor may have read (and dropped) it already
            crashes[self.actor_urn] = repr(exception_value)
        self._shutdown(EngineStopped(f"{self._who} crashed: {exception_value!r}"))

    def _shutdown(self, error: EngineError) -> None:
        live_servers.discard(self)
        self.actor_ref.backend = self.actor_backend = None  # callers' threads stop preparing with it
        engine, self.actor_engine = self.actor_engine, None
        drain, self._drain = self._drain, None
        if engine is None:
            if drain is not None:
                settle(drain[0], 0)
            return
        try:
            unfinished = len(engine.requests)
            engine.fail_all(error)
            self._fail_inbox(error)
            if drain is not None:  # stopped or crashed while draining: the drain ends too
                settle(drain[0], unfinished)
        finally:
            try:
                engine.backend.close()
            finally:
                if engine.drafter is not None:
                    engine.drafter.close()

    def _fail_inbox(self, error: EngineError) -> None:
        # pykka answers asks left in the inbox with ActorDeadError but drops tells:
        # a Stream still in the inbox would leave its consumer waiting forever.
        inbox = self.actor_inbox
        keep = []
        while not inbox.empty():
            envelope = inbox.get()
            message = envelope.message
            if isinstance(message, _Told):
                message = message.message
            if isinstance(message, _Admit):
                asker = envelope.reply_to
                if (
                    asker is not None
                    and message.future is None
                    and not isinstance(message.message, STREAMING)
                ):
                    settle(asker, error=error)
                else:  # its outcome goes where a told one's would; the asker learns nothing more
                    self._refuse(dataclasses.replace(message, told=True), error)
                    if asker is not None:
                        settle(asker, None)
            elif isinstance(message, STREAMING):
                courier.send(message.reply_to, Failed(message.request_id, error))
            elif isinstance(message, AskedMessage) and envelope.reply_to is not None:
                settle(envelope.reply_to, error=error)
            else:
                keep.append(envelope)
        for envelope in keep:
            inbox.put(envelope)

    # -- messages (actor thread) ---------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """Dispatch one message; ticks are self-sent, the rest come from callers.

        A caller's message never takes the engine down: a failure of a told one is
        logged (a request's failure is its own outcome), of an asked one goes back to
        the caller as an ``EngineError``. Only a tick may crash the engine.
        """
        told = isinstance(message, _Told)
        if told:
            message = message.message
        try:
            return self._dispatch(message)
        except BaseException as e:
            if message is TICK:
                # Recorded before pykka sets actor_stopped: a Supervisor reads it then.
                crashes[self.actor_urn] = repr(e)
                self._crash_recorded = True
                if isinstance(e, Exception):
                    raise  # the engine's state may be broken: crash, a Supervisor restarts
                raise TickCrashed(f"a tick raised {e!r}") from e
            if told:
                _log.exception("a told %s failed; ignored", type(message).__name__)
                return None
            if isinstance(e, EngineError):
                raise
            _log.exception("an asked %s failed", type(message).__name__)
            raise EngineError(f"{type(message).__name__} failed: {e!r}") from None

    def _dispatch(self, message: Any) -> Any:
        engine = self.actor_engine
        if engine is None:
            error = EngineStopped("the engine is not running")
            if isinstance(message, _Admit):  # a request still gets its one outcome
                return self._refuse(message, error)
            raise error
        if message is TICK:
            self._tick_scheduled = False
            engine.step()
            if self._drain is not None:
                self._check_drain(engine)
        elif isinstance(message, _Admit):
            answer = self._admit(engine, message)
            self._schedule()
            return answer
        elif isinstance(message, AdmittedMessage | Submit):  # not through an EngineRef
            item = message if isinstance(message, Submit) else None
            request = message.message if isinstance(message, Submit) else message
            answer = self._admit(engine, _Admit(request, None, None, item.future if item else None, False))
            self._schedule()
            return answer
        elif isinstance(message, Cancel):
            engine.cancel(message.request_id)
        elif isinstance(message, CancelExact):
            engine.cancel(message.request_id, message.message)
        elif isinstance(message, GetStats):
            return engine.stats()
        elif isinstance(message, GetInfo):
            return engine_info(self.actor_options, self.actor_config.defaults, self.actor_backend)
        elif isinstance(message, GetLora):
            return engine.lora()
        elif isinstance(message, SetLora):
            return engine.set_lora(message.by_adapter)
        elif isinstance(message, SaveSlot):
            return engine.save_slot(message)
        elif isinstance(message, RestoreSlot):
            return engine.restore_slot(message)
        elif isinstance(message, EraseSlot):
            return engine.erase_slot(message)
        elif isinstance(message, GetTokenizer):
            assert self.actor_backend is not None
            return Tokenizer(self.actor_backend, engine.n_ctx_slot)
        elif isinstance(message, Drain):
            return self._start_drain(engine, message)
        else:
            _log.warning("ignored an unknown message: %r", message)
            return None
        self._schedule()
        return None

    def _admit(self, engine: Engine, item: _Admit) -> Any:
        """Admit a request; its refusal is its outcome (actor thread)."""
        message = item.message
        try:
            if item.error is not None:
                raise item.error
            if isinstance(message, Embed | Decide):
                return self._admit_asked(engine, item, message)
            assert isinstance(item.prepared, Prepared | None)
            prepared = item.prepared or prepare(engine.backend, message, engine.n_ctx_slot)
            if isinstance(message, STREAMING):
                engine.admit(prepared, reply_to=message.reply_to)
                return None
            future: pykka.ThreadingFuture[object] = item.future or pykka.ThreadingFuture()
            engine.admit(prepared, future=future)
            return None if item.future is not None else future
        except EngineError as error:
            return self._refuse(item, error)
        except Exception as e:
            _log.exception("admitting %s failed", message.request_id)
            return self._refuse(item, InvalidRequest(f"the request could not be admitted: {e!r}"))

    @staticmethod
    def _admit_asked(engine: Engine, item: _Admit, message: Embed | Decide) -> Any:
        """Queue an ``Embed`` or place a ``Decide``'s requests; the future of its
        ``Embeddings`` or ``Decision`` (actor thread)."""
        prepared = item.prepared
        future: pykka.ThreadingFuture[object] = item.future or pykka.ThreadingFuture()
        if isinstance(message, Embed):
            if not isinstance(prepared, PreparedEmbed):
                prepared = prepare_embed(engine.backend, message, engine.n_ctx_slot)
            engine.admit_embed(prepared, future)
        else:
            if not isinstance(prepared, PreparedDecision):
                prepared = prepare_decision(engine.backend, message, engine.n_ctx_slot)
            engine.admit_decision(prepared, future)
        return None if item.future is not None else future

    @staticmethod
    def _refuse(item: _Admit, error: EngineError) -> None:
        """Give a refused request its one outcome: a stream's Failed, a told future's
        exception; an asked request raises it (to its asker)."""
        message = item.message
        if isinstance(message, STREAMING):
            if not courier.send(message.reply_to, Failed(message.request_id, error)):
                _log.warning("could not deliver %r for %s", error, message.request_id)
        elif item.future is not None and item.told:
            settle(item.future, error=error)
        elif item.told:
            _log.warning("a told %s was refused: %s", type(message).__name__, error)
        else:
            raise error

    def _start_drain(self, engine: Engine, message: Drain) -> pykka.ThreadingFuture[int]:
        if self._drain_future is None:
            deadline = None if message.timeout is None else time.monotonic() + message.timeout
            self._drain_future = pykka.ThreadingFuture()
            self._drain = (self._drain_future, deadline)
            engine.draining = True
            self._check_drain(engine)
            self._schedule()
        return self._drain_future

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
        self._drain = None
        settle(future, unfinished)
        self.stop()  # after this message: pending callers are already answered

    def _schedule(self) -> None:
        engine = self.actor_engine
        if not self._tick_scheduled and engine is not None and engine.has_work:
            self._tick_scheduled = True
            self.actor_ref.tell(TICK)
