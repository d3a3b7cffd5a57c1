"""The HTTP face: llama-server's and OpenAI's APIs served by the engine, as an ASGI app
(``create_app``) and a command, ``llama-cpp-actors serve``, that takes llama-server's
flags.

It imports only the public API of ``actors`` (messages, helpers, pools) and
``telemetry``, never the engine's internals; it needs the ``server`` extra (Starlette,
uvicorn), which the rest of the library does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.http._app import create_app
    from actors.http._serve import serve
    from actors.http._settings import HttpSettings, ResumeBounds

__all__ = ["HttpSettings", "ResumeBounds", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so the command line can say "install the server extra"
    # instead of failing on Starlette's import.
    if name == "create_app":
        from actors.http._app import create_app

        return create_app
    if name == "serve":
        from actors.http._serve import serve

        return serve
    if name == "HttpSettings":
        from actors.http._settings import HttpSettings

        return HttpSettings
    if name == "ResumeBounds":
        from actors.http._settings import ResumeBounds

        return ResumeBounds
    raise AttributeError(f"module 'actors.http' has no attribute {name!r}")
