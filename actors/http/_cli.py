"""The command line: ``llama-cpp-actors serve ...`` (or ``python -m actors.http serve ...``).

A drop-in for ``llama-server``: the flags it has that we support keep their spellings,
their environment variables (``LLAMA_ARG_*``; a flag wins over its variable) and their
meaning; the ones it has that we do not support are refused by name (exit code 2),
never ignored; a few are accepted because they describe what we always do. The list
of llama-server's flags is :mod:`actors.http._flags`, generated from llama.cpp's
``arg.cpp``; ``_OPTIONS`` below says what each supported one becomes.

Everything here runs in the main thread before the server starts: :func:`parse` turns
the arguments and the environment into a :class:`ServePlan` (plain data, checked; it
reads only the files flags name and the model's GGUF header), and :func:`main` hands the
plan to ``actors.http._serve.serve``, which starts the engine in a worker thread. Exit
codes: 0 after a drain, 1 when the engine cannot start (``ConfigError``,
``ModelLoadError``), 2 for a bad command line or environment variable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import IO, Any

import strategies
from actors import (
    ConfigError,
    EngineError,
    InvalidRequest,
    SamplingParams,
    ServerPool,
    Supervisor,
    __version__,
    default_model_path,
)
from actors.http._flags import LLAMA_SERVER_FLAGS, LlamaFlag, by_spelling
from actors.http._settings import HttpSettings

__all__ = ["PROG", "CliError", "ServePlan", "main", "parse"]

PROG = "llama-cpp-actors"
_FALLBACK_N_CTX = 8192  # ServerActor's default, when the GGUF header does not say
_DEFAULT_CACHE_RAM_MB = 8192  # llama-server's --cache-ram default
# ggml's type ids (llama_cpp.GGML_TYPE_*) of the KV cache types llama.cpp's -ctk/-ctv
# accept (kv_cache_types in common/arg.cpp); ServerActor's type_k/type_v take the id.
_KV_TYPES = MappingProxyType(
    {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
)
_STRATEGIES: Mapping[str, Callable[[], strategies.BatchStrategy]] = MappingProxyType(
    {
        "DecodeMaximal": strategies.DecodeMaximal,
        "PrefillPriority": strategies.PrefillPriority,
        "Balanced": strategies.Balanced,
        "Adaptive": strategies.Adaptive,
    }
)
_TRUTHY = ("on", "enabled", "true", "1")  # llama.cpp's is_truthy / is_falsey / is_autoy
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


class CliError(Exception):
    """A command line we cannot serve: printed as ``error: ...``, exit ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


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
        log_level: the server's log level (``warning``, ``info``, ``debug``...).
        notes: what to tell the operator before starting (a flag without effect).
    """

    server_options: Mapping[str, Any]
    pool_options: Mapping[str, Any] | None
    settings: HttpSettings
    hosts: tuple[str, ...]
    port: int
    log_level: str
    notes: tuple[str, ...] = ()

    def start_engine(self) -> Any:
        """Start the engine this plan describes (``serve``'s worker thread).

        Returns:
            a ``Supervisor`` of one ``ServerActor``, or a ``ServerPool``.

        Raises:
            ConfigError, ModelLoadError: the engine cannot start with these options.
        """
        if self.pool_options is None:
            # Supervised: an engine that crashes is restarted, and requests wait for it.
            return Supervisor.start(**self.server_options)
        return ServerPool.start(**self.pool_options, **self.server_options)


# -- values (the caller's thread; each raises ValueError with the reason) --------------


def _integer(low: int, high: int | None = None, *, extra: Sequence[int] = ()) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if number not in extra and (number < low or (high is not None and number > high)):
            allowed = f">= {low}" if high is None else f"within [{low}, {high}]"
            also = "".join(f" or {x}" for x in extra)
            raise ValueError(f"{number} is out of range: must be {allowed}{also}")
        return number

    return convert


def _number(low: float | None = None, high: float | None = None) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"{text!r} is not a finite number")
        if (low is not None and number < low) or (high is not None and number > high):
            bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
            raise ValueError(f"{number:g} is out of range: must be within {bounds}")
        return number

    return convert


def _temperature(text: str) -> float:
    return max(_number()(text), 0.0)  # llama-server: a negative temperature is greedy


def _choice(table: Mapping[str, Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text not in table:
            raise ValueError(f"{text!r} is not one of {', '.join(table)}")
        return table[text]

    return convert


_SWITCH: Mapping[str, bool | None] = MappingProxyType(
    {**dict.fromkeys(_TRUTHY, True), **dict.fromkeys(_FALSEY, False), **dict.fromkeys(_AUTOY, None)}
)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _hosts(text: str) -> tuple[str, ...]:
    hosts = _csv(text)
    if not hosts:
        raise ValueError("no address given")
    for host in hosts:
        if host.endswith(".sock"):
            raise ValueError(f"{host!r}: UNIX sockets are a llama-server feature llama-cpp-actors lacks")
    return hosts


def _gpu_layers(text: str) -> int:
    # llama-server's auto fits layers to free VRAM and all offloads every layer; we do
    # not fit, so both offload every layer (llama.cpp's -1).
    if text in ("auto", "all"):
        return -1
    return _integer(0, 2**31 - 1, extra=(-1,))(text)


def _template_kwargs(text: str) -> tuple[tuple[str, bool | str], ...]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    for key, item in value.items():
        if not isinstance(item, bool | str):
            raise ValueError(f"{key!r}: only strings and booleans are supported, got {json.dumps(item)}")
    return tuple(value.items())


_VERBOSITY = ("critical", "error", "warning", "info", "debug")  # llama.cpp's 0-4; 5 is debug too


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read the {what} {path!r}: {e}") from None


# -- the options ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    """A llama-server flag we support: its dest, how its value is read, its help."""

    flag: str  # any spelling; the others, the negations and the env var come from _flags
    dest: str
    help: str
    convert: Callable[[str], Any] | None = None  # None: a switch
    metavar: str = "N"


_OPTIONS = (
    _Option("--model", "model", "model path to load (llama-server: required or -hf; ours: default "
            "$LLAMA_MODEL, else SmolLM2-135M-Instruct, actors.default_model_path())", str, "FNAME"),
    _Option("--host", "host", "IP addresses to listen on, comma-separated (default: 127.0.0.1; "
            "llama-server's UNIX sockets *.sock are not supported)", _hosts, "HOST"),
    _Option("--port", "port", "port to listen (default: 8080)", _integer(0, 65535), "PORT"),
    _Option("--ctx-size", "ctx_size", "size of the prompt context, ServerActor's n_ctx (default: 0 = "
            "the model's training context, read from its GGUF header; llama-server's --fit may shrink "
            "it to fit memory, ours does not)", _integer(0, 2**31 - 256)),
    _Option("--parallel", "parallel", "number of server slots, n_parallel (default: -1 = auto: 4 slots "
            "sharing the whole context, as llama-server's auto)", _integer(1, 256, extra=(-1,))),
    _Option("--kv-unified", "kv_unified", "let every slot grow to the whole context (n_ctx_per_slot = "
            "n_ctx) instead of an even share (n_ctx / n_parallel); default: on if -np is auto. Our KV "
            "cache is always one buffer, so this sets only the per-slot limit"),
    _Option("--kv-unified-per-slot", "kv_unified_per_slot", "context limit per slot, n_ctx_per_slot; "
            "without -c the context is n_parallel * N (default: unset)", _integer(2, 2**31 - 256)),
    _Option("--batch-size", "batch_size", "logical maximum batch size, n_batch (default: 2048, at most "
            "n_ctx)", _integer(1, 2**31 - 256)),
    _Option("--ubatch-size", "ubatch_size", "physical maximum batch size, n_ubatch (default: 512)",
            _integer(1, 2**31 - 256)),
    _Option("--threads", "threads", "CPU threads for generation, n_threads (default: -1 = the cores "
            "this process may use)", _integer(-(2**31), 512)),
    _Option("--threads-batch", "threads_batch", "threads for batch and prompt processing, "
            "n_threads_batch (default: same as --threads)", _integer(-(2**31), 512)),
    _Option("--n-predict", "n_predict", "tokens to predict: the default and cap per request (default: "
            "-1 = up to the slot's context)", _integer(1, 2**31 - 1, extra=(-1,))),
    _Option("--cache-ram", "cache_ram", "RAM prompt cache in MiB, prompt_cache_ram_mb (default: 8192, "
            "ours at most half this machine's memory; -1 = no limit: this machine's memory; 0 = off)",
            _integer(-1, 2**40)),
    _Option("--cache-prompt", "cache_prompt", "reuse a slot's cached prompt prefix, cache_prompt "
            "(default: enabled)"),
    _Option("--context-shift", "context_shift", "on a full slot, drop old tokens and go on generating "
            "(default: disabled, as llama-server; ServerActor's own default is enabled)"),
    _Option("--flash-attn", "flash_attn", "flash attention: on, off or auto (default: auto)",
            _choice(_SWITCH), "on|off|auto"),
    _Option("--cache-type-k", "cache_type_k", f"KV cache type for K: {', '.join(_KV_TYPES)} (default: "
            "f16)", _choice(_KV_TYPES), "TYPE"),
    _Option("--cache-type-v", "cache_type_v", f"KV cache type for V: {', '.join(_KV_TYPES)} (default: "
            "f16; a quantized one needs flash attention)", _choice(_KV_TYPES), "TYPE"),
    _Option("--n-gpu-layers", "n_gpu_layers", "layers to offload to the GPU: a number, auto or all "
            "(llama-server's default: auto, fitted to VRAM; ours: 0 unless given, and auto offloads "
            "every layer, as all: we do not fit)", _gpu_layers),
    _Option("--temp", "temp", "default temperature (default: 0.80; a negative one is greedy)",
            _temperature),
    _Option("--top-k", "top_k", "default top-k (default: 40, 0 = disabled)", _integer(0, 2**31 - 1)),
    _Option("--top-p", "top_p", "default top-p (default: 0.95, 1.0 = disabled)", _number(0, 1)),
    _Option("--min-p", "min_p", "default min-p (default: 0.05, 0.0 = disabled)", _number(0, 1)),
    _Option("--seed", "seed", "default RNG seed (default: -1 = a random seed per request)",
            _integer(0, 2**32 - 1, extra=(-1,)), "SEED"),
    _Option("--repeat-last-n", "repeat_last_n", "tokens the penalties look back on, penalty_last_n "
            "(default: 64, 0 = disabled, -1 = the context)", _integer(-1, 2**31 - 1)),
    _Option("--repeat-penalty", "repeat_penalty", "repeat penalty, penalty_repeat (default: 1.00 = "
            "disabled)", _number(0)),
    _Option("--presence-penalty", "presence_penalty", "presence penalty, penalty_present (default: "
            "0.00 = disabled)", _number()),
    _Option("--frequency-penalty", "frequency_penalty", "frequency penalty, penalty_freq (default: "
            "0.00 = disabled)", _number()),
    _Option("--api-key", "api_key", "API keys, comma-separated (default: none: no key needed)", _csv,
            "KEY"),
    _Option("--api-key-file", "api_key_file", "file of API keys, one per line; lines starting with # "
            "are comments (read once at startup)", str, "FNAME"),
    _Option("--alias", "alias", "model names for the API, comma-separated (default: the model file's "
            "name)", _csv, "STRING"),
    _Option("--tags", "tags", "model tags, comma-separated (informational)", _csv, "STRING"),
    _Option("--metrics", "metrics", "serve GET /metrics, Prometheus text (default: disabled)"),
    _Option("--slots", "slots", "serve GET /slots (default: enabled)"),
    _Option("--cors-origins", "cors_origins", "allowed CORS origins, comma-separated; 'localhost' "
            "echoes only a localhost Origin (default: *)", str, "ORIGINS"),
    _Option("--cors-methods", "cors_methods", "allowed CORS methods (default: GET, POST, DELETE, "
            "OPTIONS)", str, "METHODS"),
    _Option("--cors-headers", "cors_headers", "allowed CORS headers (default: *)", str, "HEADERS"),
    _Option("--cors-credentials", "cors_credentials", "allow credentials for CORS; with origins * the "
            "Origin is echoed (default: enabled)"),
    _Option("--jinja", "jinja", "use the Jinja template engine for chat (default: enabled). Ours "
            "always renders the model's own template with Jinja: --jinja and --no-jinja change nothing"),
    _Option("--chat-template-file", "chat_template_file", "a custom Jinja chat template file: read, "
            "then refused: ServerActor has no option for a template other than the model's", str,
            "FILE"),
    _Option("--reasoning", "reasoning", "thinking in the chat: on, off or auto; on/off set the "
            "template's enable_thinking (default: auto: the template's own default)", _choice(_SWITCH),
            "on|off|auto"),
    _Option("--chat-template-kwargs", "chat_template_kwargs", "extra chat template variables, a JSON "
            "object of strings and booleans (--reasoning wins on enable_thinking)", _template_kwargs,
            "JSON"),
    _Option("--cont-batching", "cont_batching", "continuous batching (default: enabled). Ours is "
            "always on: --cont-batching is accepted, --no-cont-batching refused"),
    _Option("--ui", "ui", "the web UI (default: enabled). llama-cpp-actors has none: --ui, --no-ui, "
            "--no-webui are accepted and change nothing"),
    _Option("--verbose", "verbose", "log everything, every request included (log level debug)"),
    _Option("--verbosity", "verbosity", "log threshold: 0 generic, 1 error, 2 warning, 3 info, 4-5 "
            "debug (llama-server's default: 3; ours: warning)", _integer(0, 2**31 - 1)),
)  # fmt: skip
_ACCEPTED = frozenset({"cont_batching", "ui", "jinja"})  # switches without effect
_REFUSED_NEGATIONS = MappingProxyType(
    {"cont_batching": "continuous batching is always on in llama-cpp-actors"}
)
_SPECIAL_REFUSALS = MappingProxyType(
    {"--chat-template": "ServerActor renders the model's own chat template and has no option for another"}
)
_OURS = (  # (spellings, dest, convert, metavar, help)
    (("--strategy",), "strategy", _choice({n: n for n in _STRATEGIES}), "NAME",
     f"batch strategy: {', '.join(_STRATEGIES)} (default: DecodeMaximal)"),
    (("--replicas",), "replicas", _integer(1, 1024), "N",
     "engines behind the server; more than 1 (or --backend ray) starts a ServerPool (default: 1)"),
    (("--backend",), "backend", _choice({"local": "local", "ray": "ray"}), "local|ray",
     "where a pool's replicas run: this process, or Ray actors (default: local)"),
    (("--max-queue",), "max_queue", _integer(0), "N",
     "requests that may wait for a slot before QueueFull (503) (default: 64)"),
    (("--chunk-size",), "chunk_size", _integer(1), "N",
     "prompt tokens a slot prefills per tick at most (default: 512)"),
    (("--drain-timeout",), "drain_timeout", _number(0, 3600), "SECONDS",
     "on SIGTERM/SIGINT, how long in-flight requests may finish (default: 30)"),
)  # fmt: skip
_SAMPLING = MappingProxyType(
    {"temp": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
     "repeat_last_n": "penalty_last_n", "repeat_penalty": "penalty_repeat",
     "presence_penalty": "penalty_present", "frequency_penalty": "penalty_freq"}
)  # fmt: skip
_PASSED_IF_GIVEN = MappingProxyType(
    {"batch_size": "n_batch", "ubatch_size": "n_ubatch", "flash_attn": "flash_attn",
     "cache_type_k": "type_k", "cache_type_v": "type_v", "n_gpu_layers": "n_gpu_layers",
     "cache_prompt": "cache_prompt", "max_queue": "max_queue", "chunk_size": "chunk_size"}
)  # fmt: skip
_DESCRIPTION = """\
Serve a llama.cpp model over HTTP with llama-server's endpoints and flags, from the
llama-cpp-actors engine (continuous batching, prompt caches, supervision, telemetry).

Every flag below is llama-server's, with its meaning and its environment variable
(LLAMA_ARG_*; a flag wins over its variable), unless marked as ours. A llama-server
flag not listed here is refused by name (exit code 2), never ignored."""
_EPILOG = """\
exit codes: 0 after SIGTERM/SIGINT drained the server, 1 if the engine could not start
(a bad option for it, a missing model), 2 for a bad command line or variable."""


def _llama_flag(option: _Option) -> LlamaFlag:
    return by_spelling()[option.flag]


def _refuse(message: str) -> type[argparse.Action]:
    """An argparse action that rejects its flag with ``message`` (``{flag}``: its spelling)."""

    class Refuse(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            parser.error(message.replace("{flag}", option_string or self.option_strings[0]))

    return Refuse


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that never breaks a line inside a flag's name (``--no-kv-\\nunified``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting on a bad command line."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        raise CliError(message)


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("-h", "--help", "--usage", action="help", help="print this help and exit")
    serve.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    supported = serve.add_argument_group("llama-server's flags")
    accepted = serve.add_argument_group("llama-server's flags accepted without effect")
    ours = serve.add_argument_group("llama-cpp-actors' own flags")
    covered = {"-h", "--help", "--usage", "--version"}
    unset = argparse.SUPPRESS  # absent from the namespace unless given: env vars fill the rest
    for option in _OPTIONS:
        flag = _llama_flag(option)
        group = accepted if option.dest in _ACCEPTED else supported
        text = option.help.replace("%", "%%")
        env = f" (env: {flag.env})" if flag.env else ""
        covered.update(flag.spellings, flag.negations)
        if option.convert is not None:
            group.add_argument(
                *flag.spellings,
                dest=option.dest,
                type=_argparse_type(option.convert),
                default=unset,
                metavar=option.metavar,
                help=text + env,
            )
            continue
        refused = _REFUSED_NEGATIONS.get(option.dest)
        says_it = refused or option.dest in _ACCEPTED  # its help already names the negations
        negated = f"; {', '.join(flag.negations)} to disable" if flag.negations and not says_it else ""
        group.add_argument(
            *flag.spellings, dest=option.dest, action="store_true", default=unset, help=text + negated + env
        )
        if refused:
            action = _refuse(f"{{flag}}: {refused}")
            group.add_argument(*flag.negations, nargs=0, action=action, help=argparse.SUPPRESS)
        elif flag.negations:
            group.add_argument(
                *flag.negations, dest=option.dest, action="store_false", default=unset, help=argparse.SUPPRESS
            )
    for spellings, dest, convert, metavar, help_text in _OURS:
        ours.add_argument(
            *spellings,
            dest=dest,
            type=_argparse_type(convert),
            default=unset,
            metavar=metavar,
            help=help_text,
        )
    for flag in LLAMA_SERVER_FLAGS:
        names = [n for n in (*flag.spellings, *flag.negations) if n not in covered]
        if not names:
            continue
        message = "{flag} is a llama-server flag that llama-cpp-actors does not support"
        reason = next((_SPECIAL_REFUSALS[n] for n in names if n in _SPECIAL_REFUSALS), None)
        if reason:
            message += f": {reason}"
        serve.add_argument(*names, nargs=flag.n_values, action=_refuse(message), help=argparse.SUPPRESS)


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    root = _Parser(
        prog=PROG, description="Serve a llama.cpp model over HTTP, as llama-server does.", allow_abbrev=False
    )
    root.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server (llama-server's flags)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        allow_abbrev=False,
        add_help=False,
        formatter_class=_Formatter,
    )
    _serve_parser(serve)
    return root, serve


def _normalized(argv: Sequence[str], serve: argparse.ArgumentParser) -> list[str]:
    """``argv`` as llama-server reads it: ``--foo_bar`` is ``--foo-bar`` where that is a
    flag, and the token after a flag that takes one value is its value even if it starts
    with ``-`` (argparse would take it for a flag: it is passed as ``flag=value``)."""
    values = {name: a.nargs for a in serve._actions for name in a.option_strings}
    out: list[str] = []
    skip = 0
    for token in argv:
        if skip:
            if skip == 1 and token.startswith("-") and out[-1] in values and values[out[-1]] is None:
                out[-1] = f"{out[-1]}={token}"
            else:
                out.append(token)
            skip -= 1
            continue
        name, eq, rest = token.partition("=")
        if token.startswith("--") and name not in values and name.replace("_", "-") in values:
            name = name.replace("_", "-")
            token = name + eq + rest
        if token == "--":
            skip = len(argv)  # the rest is positional
        elif name in values and not eq:
            nargs = values[name]
            skip = 1 if nargs is None else nargs if isinstance(nargs, int) else 0
        out.append(token)
    return out


# -- environment variables --------------------------------------------------------------


def _with_environment(values: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with each option not on the command line taken from its variable."""
    given = dict(values)
    for option in _OPTIONS:
        flag = _llama_flag(option)
        if flag.env is None or option.dest in given:
            continue
        negative = flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if flag.negations else None
        text = env.get(flag.env)
        where = f"environment variable {flag.env}={text!r}"
        if negative is not None and negative in env:  # any value, as llama-server
            given[option.dest] = False
            where = f"environment variable {negative}"
        elif text is None:
            continue
        elif option.convert is None and not flag.negations:  # a flag without a value
            if text in _TRUTHY:  # anything else leaves it unset, as llama-server
                given[option.dest] = True
        elif option.convert is None:
            if text not in _TRUTHY + _FALSEY:
                raise CliError(f"{where}: not a boolean (one of {', '.join(_TRUTHY + _FALSEY)})")
            given[option.dest] = text in _TRUTHY
        else:
            try:
                given[option.dest] = option.convert(text)
            except ValueError as e:
                raise CliError(f"{where}: {e}") from None
        if given.get(option.dest, True) is False and option.dest in _REFUSED_NEGATIONS:
            raise CliError(f"{where}: {_REFUSED_NEGATIONS[option.dest]}")
    supported = {n for option in _OPTIONS for n in _llama_flag(option).spellings}
    for flag in LLAMA_SERVER_FLAGS:
        # llama-server would act on these; so a set one is refused, not ignored. HF_TOKEN
        # and MTMD_BACKEND_DEVICE are not llama.cpp's own names: other tools set them.
        if flag.env is None or not flag.env.startswith("LLAMA_") or flag.spellings[0] in supported:
            continue
        for name in (
            flag.env,
            flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if flag.negations else None,
        ):
            if name is not None and name in env:
                raise CliError(
                    f"environment variable {name} sets {flag.spellings[-1]}, a llama-server flag "
                    "that llama-cpp-actors does not support"
                )
    dests = [option.dest for option in _OPTIONS] + [ours[1] for ours in _OURS]
    return {dest: given.get(dest) for dest in dests}


# -- what the values become --------------------------------------------------------------


def _gguf_string(file: IO[bytes]) -> str:
    (size,) = struct.unpack("<Q", file.read(8))
    if size > 1 << 20:
        raise ValueError("implausible GGUF string")
    return file.read(size).decode("utf-8")


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _gguf_skip(file: IO[bytes], kind: int) -> None:
    if kind in _GGUF_SIZES:
        file.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    elif kind == 8:
        _gguf_string(file)
    elif kind == 9:
        item, count = struct.unpack("<IQ", file.read(12))
        if item in _GGUF_SIZES:
            file.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        elif item == 8:
            for _ in range(count):
                file.seek(struct.unpack("<Q", file.read(8))[0], os.SEEK_CUR)
        else:
            raise ValueError("nested GGUF array")
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def _training_context(path: str) -> int | None:
    """The model's training context, ``<general.architecture>.context_length`` in its
    GGUF header, or None if the file does not say (llama.cpp then reports the file)."""
    try:
        with open(path, "rb") as file:
            if file.read(4) != b"GGUF" or struct.unpack("<I", file.read(4))[0] < 2:
                return None
            _, n_kv = struct.unpack("<QQ", file.read(16))
            arch: str | None = None
            lengths: dict[str, int] = {}
            for _ in range(min(n_kv, 1 << 16)):
                key = _gguf_string(file)
                (kind,) = struct.unpack("<I", file.read(4))
                if key == "general.architecture" and kind == 8:
                    arch = _gguf_string(file)
                elif key.endswith(".context_length") and kind in _GGUF_INTS:
                    (lengths[key],) = struct.unpack(
                        _GGUF_INTS[kind], file.read(struct.calcsize(_GGUF_INTS[kind]))
                    )
                else:
                    _gguf_skip(file, kind)
                if arch is not None and f"{arch}.context_length" in lengths:
                    length = lengths[f"{arch}.context_length"]
                    return length if length >= 2 else None
    except (OSError, ValueError, struct.error):  # UnicodeDecodeError is a ValueError
        return None
    return None


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
        return _plan(values)
    except (ConfigError, InvalidRequest) as e:
        raise CliError(str(e)) from None


def _plan(v: Mapping[str, Any]) -> ServePlan:
    notes: list[str] = []
    if v["jinja"] is False:
        notes.append("--no-jinja has no effect: the model's chat template is always rendered with Jinja")
    if v["ui"]:
        notes.append("--ui has no effect: llama-cpp-actors has no web UI")
    if v["chat_template_file"] is not None:
        _read_text(v["chat_template_file"], "chat template file")
        raise CliError(
            "--chat-template-file is a llama-server flag that llama-cpp-actors does not support yet: "
            "ServerActor renders the model's own chat template and has no option for another"
        )
    model_path = v["model"]
    if model_path is None:
        try:
            model_path = default_model_path()
        except EngineError:
            model_path = None  # ServerActor raises ModelLoadError, with how to install it
    auto_parallel = v["parallel"] in (None, -1)
    n_parallel = 4 if auto_parallel else v["parallel"]
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
    replicas = v["replicas"] or 1
    backend = v["backend"] or "local"
    pool = None if replicas == 1 and backend == "local" else {"replicas": replicas, "backend": backend}
    kwargs: list[tuple[str, bool | str]] = list(v["chat_template_kwargs"] or ())
    if v["reasoning"] is not None:  # on/off; auto leaves the template's own default
        kwargs = [(k, x) for k, x in kwargs if k != "enable_thinking"] + [("enable_thinking", v["reasoning"])]
    settings = HttpSettings(
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
        drain_timeout_s=30.0 if v["drain_timeout"] is None else v["drain_timeout"],
        chat_template_kwargs=tuple(kwargs),
        verbose=bool(v["verbose"]),
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
    )


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
            plan.start_engine, plan.settings, hosts=plan.hosts, port=plan.port, log_level=plan.log_level
        )
    except EngineError as e:  # ConfigError, ModelLoadError: a clean message, no traceback
        print(f"{command}: error: {e}", file=sys.stderr)
        return 1
