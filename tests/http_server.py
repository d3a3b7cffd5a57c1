"""An HTTP server for tests: the app served by uvicorn in a thread (``Running``), or
``serve`` in a child process (``serve_child``)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from actors import GetStats
from actors.http import HttpSettings, create_app
from actors.http._serve import uvicorn_config


class Running:
    """An app served by uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, settings: HttpSettings, start_engine: Callable[[], Any]) -> None:
        self.app = create_app(settings, start_engine)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(self.app, settings)  # as serve()
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    @property
    def engine(self) -> Any:
        return self.app.service.engine  # type: ignore[attr-defined]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    @classmethod
    @contextlib.contextmanager
    def ready(cls, settings: HttpSettings, start_engine: Callable[[], Any]) -> Iterator[Running]:
        """A server up and answering ``/health``, stopped on leaving."""
        server = cls(settings, start_engine)
        try:
            server.wait_ready()
            yield server
        finally:
            server.stop()


def idle(running: Running) -> bool:
    stats = running.engine.ask(GetStats())
    return stats["active_slots"] == 0 and stats["queue_depth"] == 0


def serve_child(*flags: str) -> tuple[Any, str]:
    """``python -m actors.http serve`` on a free port, in a child process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-m", "actors.http", "serve", "--port", str(port), "-c", "1024", "-np", "2", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return child, f"http://127.0.0.1:{port}"


def child_ready(url: str, child: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(
        f"the server did not start: {child.stdout.read() if child.poll() is not None else ''}"
    )
