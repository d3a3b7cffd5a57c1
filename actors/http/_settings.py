"""``HttpSettings``: how the HTTP face behaves, built by the command line from
llama-server's flags (or by hand for ``create_app``).

Frozen and checked on construction (the caller's thread), like every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from actors import Chat, ConfigError, InvalidRequest

__all__ = ["HttpSettings", "ResumeBounds"]

# Parsing JSON holds the GIL, so the event loop waits for it even in a worker thread:
# 4 MiB parses in about 0.1 s here, and carries a prompt of a million characters (far
# past any slot's context; llama-server's clients send far less).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Connections beyond this get a JSON 503 (each costs a file descriptor, no slot).
DEFAULT_MAX_CONNECTIONS = 2048
# A connection's time to send a whole request head (at its start and after each response).
DEFAULT_HEADER_TIMEOUT_S = 10.0
# An idle keep-alive connection closes after this (uvicorn's timeout_keep_alive).
DEFAULT_KEEP_ALIVE_S = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeBounds:
    """How much of the resumable streams (``X-Conversation-Id``) the server keeps.

    Attributes:
        max_bytes: bytes kept per stream; past them its oldest events are dropped
            (llama-server's 4 MiB). The newest event is always kept.
        max_events: events kept per stream; past them its oldest are dropped.
        max_streams: streams kept in all. A new one past it evicts the oldest ended
            stream nobody reads, of the client that keeps the most (and keeps at least
            as many as the newcomer would); with none to evict, it gets 503.
        max_streams_per_client: streams one client (its API key, else its address)
            keeps; a new one past it evicts that client's oldest ended stream nobody
            reads; with none, it gets 429.
        ttl_s: how long an ended stream is kept after it ended and its last reader
            left (llama-server's 300 s).
        max_readers: readers of one stream at once (the request that started it
            counts while its client reads); another gets 429.
    """

    max_bytes: int = 4 * 1024 * 1024
    max_events: int = 16384
    max_streams: int = 64
    max_streams_per_client: int = 8
    ttl_s: float = 300.0
    max_readers: int = 4

    def __post_init__(self) -> None:
        for name, low, high in (
            ("max_bytes", 1024, 1 << 30),
            ("max_events", 1, 1 << 20),
            ("max_streams", 1, 1 << 16),
            ("max_streams_per_client", 1, 1 << 16),
            ("max_readers", 1, 1024),
        ):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(f"{name} must be an int within [{low}, {high}], got {value!r}")
        if self.max_streams_per_client > self.max_streams:
            raise ConfigError("max_streams_per_client must be at most max_streams")
        seconds = self.ttl_s
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 86400:
            raise ConfigError(f"ttl_s must be within (0, 86400] seconds, got {seconds!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpSettings:
    """What the HTTP layer needs to know besides the engine.

    Attributes:
        model_ids: the names ``/v1/models`` lists and requests may use (llama-server's
            ``--alias``, comma-separated there); empty: the model file's name.
        tags: llama-server's ``--tags``, listed with the model.
        api_keys: accepted keys (``Authorization: Bearer <key>`` or ``X-Api-Key``);
            empty: no key needed. ``/health`` never needs one.
        metrics: serve ``GET /metrics`` (Prometheus text).
        slots: serve ``GET /slots``.
        cors_origins: ``*`` (with credentials: the request's Origin is echoed, as
            llama-server does), ``localhost`` (echo only a localhost Origin), or a
            comma-separated list sent as is.
        cors_methods: the preflight's ``Access-Control-Allow-Methods``.
        cors_headers: the preflight's ``Access-Control-Allow-Headers``.
        cors_credentials: the preflight's ``Access-Control-Allow-Credentials``.
        n_predict: the server's default and cap for tokens per request (llama-server's
            ``-n``); -1: up to the context of a slot.
        max_body_bytes: larger request bodies get 413.
        spm_infill: ``/infill`` puts the suffix before the prefix (llama-server's
            ``--spm-infill``, the suffix-prefix-middle order some models were trained
            with).
        max_connections: connections beyond this get a JSON 503 and are closed.
        max_connections_per_client: connections one address may hold, and requests one
            API key may have in flight (when keys are set); beyond it, a JSON 503. None:
            a quarter of ``max_connections``; 0: no bound (behind a proxy, where every
            client has the proxy's address).
        header_timeout_s: a connection that has not sent a whole request head this long
            after it opened, or after its last response, is closed.
        keep_alive_s: an idle keep-alive connection is closed after this many seconds.
        drain_timeout_s: on SIGTERM/SIGINT, how long in-flight requests may finish.
        chat_template_kwargs: extra variables for the chat template, (name, JSON value)
            pairs checked as a ``Chat``'s ``template_kwargs`` are and stored frozen
            (``--chat-template-kwargs``; ``--reasoning`` sets ``enable_thinking``).
        reasoning_format: a chat's ``reasoning_format`` when its request sets none
            (``--reasoning-format``): ``auto``, ``deepseek`` or ``none``.
        reasoning_budget: a chat's thinking budget in tokens when its request sets
            none (``--reasoning-budget``; None: no bound).
        reasoning_budget_message: the text that closes a spent thinking budget
            (``--reasoning-budget-message``).
        verbose: log every request.
        pooling: how the embeddings endpoints pool (``--pooling``): ``"mean"``, ``"cls"``
            or ``"last"``; None: the model's own, else mean. ``"none"`` serves no pooled
            embeddings (llama-server's per-token output is not offered).
        loop_nice: on Linux, once the engine is up, the event loop's thread (and the
            threads it starts later) run at this nice value, so the scheduler lets
            llama.cpp's compute threads, which run at the process's own, finish a
            forward pass before the loop writes tokens: on a machine whose cores the
            forward pass takes (n_threads = cores) the loop otherwise preempts one of
            them mid-pass, and the others wait for it. 0 leaves it alone.
        models: router mode (llama-server's, several models): each model's name and
            its own settings (``n_predict``, ``chat_template_kwargs``, ``pooling``,
            ``tags``; the rest is the router's, from these settings); the engine is then
            a ``ModelManager`` that registers them. Empty: one model.
        models_autoload: router mode: a request for a model that is not loaded loads
            it (``--models-autoload``; a request's ``?autoload=`` decides for itself).
        models_max: router mode: what ``/props`` reports as ``max_instances``.
        slot_save_path: the folder of slot files (``--slot-save-path``, resolved): serve
            ``POST /slots/{id}?action=save|restore|erase``; None: those answer 501.
        sleep_idle_s: unload the model after this many seconds without a request, and
            load it again for the next (``--sleep-idle-seconds``); None: never. One
            model only (router mode unloads idle models by their keep-alive).
        resumable: the bounds of the resumable streams (``X-Conversation-Id``,
            ``GET /v1/stream``).
    """

    model_ids: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    metrics: bool = False
    slots: bool = True
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    n_predict: int = -1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    spm_infill: bool = False
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int | None = None
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S
    drain_timeout_s: float = 30.0
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    reasoning_format: str = "auto"
    reasoning_budget: int | None = None
    reasoning_budget_message: str | None = None
    verbose: bool = False
    loop_nice: int = 10
    pooling: Literal["mean", "cls", "last", "none"] | None = None
    models: tuple[tuple[str, HttpSettings], ...] = ()
    models_autoload: bool = True
    models_max: int = 4
    slot_save_path: str | None = None
    sleep_idle_s: float | None = None
    resumable: ResumeBounds = ResumeBounds()

    def __post_init__(self) -> None:
        for name in ("model_ids", "tags", "api_keys"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{name} must be a tuple of non-empty strings, got {value!r}")
        for name in ("metrics", "slots", "cors_credentials", "verbose", "spm_infill"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool")
        for name in ("cors_origins", "cors_methods", "cors_headers"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a str")
        object.__setattr__(self, "chat_template_kwargs", _template_pairs(self.chat_template_kwargs))
        if type(self.n_predict) is not int or self.n_predict < -1 or self.n_predict == 0:
            raise ConfigError(f"n_predict must be -1 or an int >= 1, got {self.n_predict!r}")
        if type(self.max_body_bytes) is not int or not 1024 <= self.max_body_bytes <= 1 << 30:
            raise ConfigError(
                f"max_body_bytes must be an int within [1024, 2**30], got {self.max_body_bytes!r}"
            )
        if type(self.max_connections) is not int or not 1 <= self.max_connections <= 1 << 20:
            raise ConfigError(f"max_connections must be within [1, 2**20], got {self.max_connections!r}")
        per_client = self.max_connections_per_client
        if per_client is None:
            object.__setattr__(self, "max_connections_per_client", max(1, self.max_connections // 4))
        elif type(per_client) is not int or not 0 <= per_client <= 1 << 20:
            raise ConfigError(f"max_connections_per_client must be within [0, 2**20], got {per_client!r}")
        seconds = self.header_timeout_s
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0.1 <= seconds <= 3600:
            raise ConfigError(f"header_timeout_s must be within [0.1, 3600] seconds, got {seconds!r}")
        if type(self.keep_alive_s) is not int or not 1 <= self.keep_alive_s <= 3600:
            raise ConfigError(f"keep_alive_s must be an int within [1, 3600], got {self.keep_alive_s!r}")
        if self.pooling not in (None, "mean", "cls", "last", "none"):
            raise ConfigError(f"pooling must be mean, cls, last, none or None, got {self.pooling!r}")
        if type(self.loop_nice) is not int or not 0 <= self.loop_nice <= 19:
            raise ConfigError(f"loop_nice must be an int within [0, 19], got {self.loop_nice!r}")
        if not isinstance(self.models, tuple) or not all(
            isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], HttpSettings)
            for m in self.models
        ):
            raise ConfigError("models must be a tuple of (name, HttpSettings) pairs")
        if not isinstance(self.models_autoload, bool):
            raise ConfigError("models_autoload must be a bool")
        if type(self.models_max) is not int or self.models_max < 0:
            raise ConfigError(f"models_max must be an int >= 0, got {self.models_max!r}")
        if self.slot_save_path is not None and (
            not isinstance(self.slot_save_path, str) or not self.slot_save_path
        ):
            raise ConfigError(f"slot_save_path must be a folder's path or None, got {self.slot_save_path!r}")
        sleep = self.sleep_idle_s
        if sleep is not None and (
            isinstance(sleep, bool) or not isinstance(sleep, int | float) or not 0 < sleep < 1e9
        ):
            raise ConfigError(f"sleep_idle_s must be a number of seconds > 0 or None, got {sleep!r}")
        if not isinstance(self.resumable, ResumeBounds):
            raise ConfigError("resumable must be a ResumeBounds")
        if not isinstance(self.drain_timeout_s, int | float) or not 0 <= self.drain_timeout_s <= 3600:
            raise ConfigError(
                f"drain_timeout_s must be within [0, 3600] seconds, got {self.drain_timeout_s!r}"
            )


def _template_pairs(value: object) -> tuple[tuple[str, Any], ...]:
    """``value`` checked by the one checker a ``Chat``'s ``template_kwargs`` go through."""
    pairs = value if isinstance(value, tuple) else None
    if pairs is None or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        raise ConfigError("chat_template_kwargs must be a tuple of (name, JSON value) pairs")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError("chat_template_kwargs names a variable twice")
    try:
        chat = Chat([{"role": "user", "content": "-"}], template_kwargs=dict(pairs))
    except InvalidRequest as e:
        raise ConfigError(str(e).replace("template_kwargs", "chat_template_kwargs", 1)) from None
    assert chat.template_kwargs is not None
    return tuple(chat.template_kwargs.items())
