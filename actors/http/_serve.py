"""``serve``: run the HTTP face on uvicorn until a signal drains it.

SIGTERM or SIGINT starts a drain, as llama-server's users expect of a service: new
requests get 503 at once, requests in flight finish (for up to ``drain_timeout_s``,
then they are cancelled), the engine stops, and the process exits 0. A second signal
stops at once. Runs in the main thread (signals are delivered there).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import uvicorn

from actors.http._access import JsonFormatter
from actors.http._app import create_app
from actors.http._guard import guarded_protocol
from actors.http._service import Service
from actors.http._settings import HttpSettings

__all__ = ["serve", "uvicorn_config"]

_log = logging.getLogger("llama_cpp_actors.http")

# After the drain, how long uvicorn waits for the connections it still has.
_CLOSE_GRACE_S = 2


class _DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its own shutdown (the event loop's thread)."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self.drain_deadline: float | None = None
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here; on_tick (every 0.1 s) acts on them.
        if self.drain_deadline is not None:
            self.should_exit = self.force_exit = True  # a second signal: now
            return
        self.service.draining = True
        self.drain_deadline = time.monotonic() + self.service.settings.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.service.in_flight == 0:
                self.should_exit = True
            elif now >= self.drain_deadline and not self.service.drain_expired:
                _log.warning("drain timed out: cancelling %d requests", self.service.in_flight)
                self.service.cancel_all()
            elif now >= self.drain_deadline + _CLOSE_GRACE_S:
                self.should_exit = True  # what is left, uvicorn's own shutdown cancels
        return await super().on_tick(counter)

    def load_failed(self) -> None:
        self.failed = True
        self.should_exit = True


def serve(
    start_engine: Callable[[], Any],
    settings: HttpSettings,
    *,
    hosts: Sequence[str] = ("127.0.0.1",),
    port: int = 8080,
    log_level: str = "warning",
    log_file: str | None = None,
    log_format: str = "text",
    log_disable: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT has drained the server; the process's exit code.

    Args:
        start_engine: makes the engine (called once, in a worker thread, while the
            server already answers 503).
        settings: the HTTP settings.
        hosts: the addresses to bind, each on ``port``.
        port: the TCP port.
        log_level: uvicorn's log level.
        log_file: write the log (the banner, one access line per request, warnings)
            to this file instead of stderr.
        log_format: ``"text"`` or ``"json"`` (one object a line).
        log_disable: write no log at all.

    Returns:
        0 after a drain, 1 when the model failed to load.
    """
    app = create_app(settings, start_engine)
    service: Service = app.service  # type: ignore[attr-defined]
    config = uvicorn_config(app, settings, host=hosts[0], port=port, log_level=log_level)
    server = _DrainingServer(config, service)
    service.on_load_failed = server.load_failed
    try:
        sockets = [_bind(host, port) for host in hosts]
    except OSError as e:
        print(f"llama-cpp-actors serve: error: cannot listen on {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    urls = [f"http://{_host(sock)}:{sock.getsockname()[1]}" for sock in sockets]
    service.on_ready = lambda: _banner(service, urls)
    handler = _log_handler(log_file, log_format, log_disable)
    ours = logging.getLogger("llama_cpp_actors")
    kept = ours.level, ours.propagate
    ours.addHandler(handler)
    if log_file is not None:  # uvicorn's own lines too
        logging.getLogger("uvicorn").addHandler(handler)
    ours.setLevel(logging.CRITICAL + 1 if log_disable else logging.INFO)
    ours.propagate = False
    # llama.cpp's own lines follow the verbosity (-lv, -v): warnings and errors by default.
    engine_lines = logging.getLogger("llama_cpp_actors.llama_cpp")
    kept_engine_level = engine_lines.level
    engine_lines.setLevel(getattr(logging, log_level.upper(), logging.WARNING))
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(server.serve(sockets=sockets))
    finally:
        engine_lines.setLevel(kept_engine_level)
        ours.removeHandler(handler)
        logging.getLogger("uvicorn").removeHandler(handler)
        ours.setLevel(kept[0])
        ours.propagate = kept[1]
        handler.close()
    if server.failed and not service.draining:
        error = service.load_error
        print(f"llama-cpp-actors serve: error: the model failed to load: {error}", file=sys.stderr)
        return 1
    if not server.started and not service.draining:
        print("llama-cpp-actors serve: error: the server did not start (see the log above)", file=sys.stderr)
        return 1
    return 0


def _log_handler(log_file: str | None, log_format: str, log_disable: bool) -> logging.Handler:
    """Where serve's own log goes: stderr, or ``log_file``; text or JSON lines."""
    handler: logging.Handler
    if log_disable:
        handler = logging.NullHandler()
    elif log_file is not None:
        handler = logging.FileHandler(log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    return handler


def _host(sock: socket.socket) -> str:
    host = sock.getsockname()[0]
    return f"[{host}]" if ":" in host else host


def _banner(service: Service, urls: list[str]) -> None:
    """What the operator needs once the model is loaded: where, what, how big."""
    info, stats, settings = service.info, service.stats, service.settings
    if settings.models:
        what = f"router of {len(settings.models)} models ({', '.join(name for name, _ in settings.models)})"
    else:
        model = os.path.basename(str(info.get("model_path", "?")))
        what = (
            f"model {model}: {info.get('n_parallel')} slots of {stats.get('n_ctx_per_slot')} tokens "
            f"(n_ctx {info.get('n_ctx')}, n_batch {info.get('n_batch')}), {info.get('n_threads')} "
            f"thread{'' if info.get('n_threads') == 1 else 's'}"
        )
    keys = f", {len(settings.api_keys)} API key(s)" if settings.api_keys else ", no API key"
    _log.info("listening on %s: %s%s", " and ".join(urls), what, keys)


def uvicorn_config(
    app: Any, settings: HttpSettings, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> uvicorn.Config:
    """uvicorn's configuration of ``serve`` for ``app`` (the tests serve with it too)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=settings.verbose,
        timeout_graceful_shutdown=_CLOSE_GRACE_S,
        lifespan="on",
        server_header=False,
        # h11 sends header names as the app wrote them (httptools lowercases them);
        # llama-server's own clients compare a few names exactly. Its cost is a few
        # microseconds per event, under the noise of bench/http.py. Ours adds a header
        # timeout and connection bounds that answer in JSON (_guard).
        http=guarded_protocol(settings),
        ws="none",  # no WebSocket routes: an upgrade is an ordinary request (404), never a protocol switch
        timeout_keep_alive=settings.keep_alive_s,
    )


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (the ``server`` extra brings it), else
    asyncio's: every streamed token is a socket write and an epoll wake-up, which
    uvloop does in C, and on 2 cores the loop's CPU is taken from llama.cpp's threads."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; an ``OSError`` naming the address."""
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, port))
        sock.listen(2048)  # here, so an address already taken fails here, by name
    except (OSError, OverflowError) as e:
        sock.close()
        reason = (e.strerror if isinstance(e, OSError) else None) or str(e)
        raise OSError(getattr(e, "errno", None), reason, f"{host}:{port}") from None
    return sock
