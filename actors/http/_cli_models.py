"""Router mode's command line: ``--models-dir`` and ``--models-preset`` (llama-server's
INI file of models) turned into one ``ServePlan`` per model, by the command line's own
parser and converters (no second table of options).

A model's options, by precedence (llama-server's): the command line (and its
``LLAMA_ARG_*`` variables), then its preset section, then the preset's ``[*]``
section. The preset is read as llama-server reads it: an optional ``version = 1``
before the first section, ``;`` and ``#`` comments, ``key = value`` lines whose key is
a flag without its dashes (``ctx-size``), a short form (``c``, ``np``, ``ngl``) or its
``LLAMA_ARG_*`` name, and the preset-only keys ``load-on-startup`` and, ours,
``keep-alive`` and ``pin``. A key the server would not honour is an error naming the
file, the section and the key, never ignored.

Everything here runs in the main thread before the server starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.http._cli_options import _FALSEY, _OPTIONS, _OURS, _TRUTHY, CliError
from actors.http._flags import LLAMA_SERVER_FLAGS

__all__: list[str] = []

_MAX_SECTIONS = 1024
_MAX_NAME = 256  # a model name: what requests send as "model"
# Options that are the router's, not a model's: llama-server drops them from a preset
# (host, port, API key, alias); here a section that sets one is an error.
_ROUTER_ONLY = frozenset(
    {
        "host", "port", "api_key", "api_key_file", "alias", "metrics", "slots", "cors_origins",
        "cors_methods", "cors_headers", "cors_credentials", "verbose", "verbosity", "drain_timeout",
        "loop_nice", "backend", "models_dir", "models_preset", "models_max", "models_autoload",
        "models_memory_mb", "models_keep_alive", "max_connections", "max_connections_per_client",
        "header_timeout", "keep_alive_timeout",
    }
)  # fmt: skip
_PRESET_REFUSED = {  # llama-server's preset-only keys we cannot honour
    "stop-timeout": "an unload stops the model's engine at once",
    "dedup-cache-models": "there is no model cache",
}
_ENV_FLAGS = {flag.env: flag.spellings[-1] for flag in LLAMA_SERVER_FLAGS if flag.env}


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model of the router, before its options are planned.

    Attributes:
        name: what requests call it.
        where: where it was found, for errors (``preset x.ini [name]``, ``--models-dir``).
        argv: its preset flags, ``[*]``'s first (the command line's come on top).
        model_path: its GGUF file, if the preset or the directory gave one.
        eager: ``load-on-startup``.
        keep_alive_s: ``keep-alive``, if the section set it.
        pinned: ``pin``.
    """

    name: str
    where: str
    argv: tuple[str, ...] = ()
    model_path: str | None = None
    eager: bool = False
    keep_alive_s: float | None = None
    pinned: bool = False


def _boolean(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUTHY + _FALSEY:
        raise CliError(f"{where}: {text!r} is not a boolean (one of {', '.join(_TRUTHY + _FALSEY)})")
    return value in _TRUTHY


def read_preset(text: str, path: str) -> dict[str, list[tuple[str, str, int]]]:
    """The sections of a preset file: ``{section: [(key, value, line)]}``, ``[*]`` as ``*``."""
    sections: dict[str, list[tuple[str, str, int]]] = {}
    current: list[tuple[str, str, int]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            name = line[1:-1].strip() if line.endswith("]") else ""
            if not name or len(name) > _MAX_NAME or not name.isprintable():
                raise CliError(f"preset {path} line {number}: a bad section header {line[:80]!r}")
            if name in sections:
                raise CliError(f"preset {path} line {number}: section [{name}] appears twice")
            if len(sections) >= _MAX_SECTIONS:
                raise CliError(f"preset {path}: more than {_MAX_SECTIONS} sections")
            current = sections[name] = []
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise CliError(f"preset {path} line {number}: expected key = value, got {line[:80]!r}")
        if current is None:
            if key == "version" and value == "1":
                continue
            raise CliError(f"preset {path} line {number}: {key!r} before the first section (only version)")
        current.append((key, value, number))
    return sections


def _flag_of(key: str, spellings: Mapping[str, argparse.Action]) -> str | None:
    if key.startswith("LLAMA_"):
        return _ENV_FLAGS.get(key)
    for flag in (f"--{key}", f"-{key}"):
        if flag in spellings:
            return flag
    return None


def _section(
    pairs: list[tuple[str, str, int]], where: str, serve: argparse.ArgumentParser
) -> tuple[list[str], dict[str, Any]]:
    """A section's flags (for the parser) and its preset-only keys."""
    spellings = {name: a for a in serve._actions for name in a.option_strings}
    dests = {o.dest for o in _OPTIONS} | {ours[1] for ours in _OURS}
    argv: list[str] = []
    extra: dict[str, Any] = {}
    for key, value, number in pairs:
        at = f"{where} line {number}: {key}"
        if key in ("load-on-startup", "pin"):
            extra[key] = _boolean(value, at)
            continue
        if key == "keep-alive":
            try:
                seconds = float(value)
            except ValueError:
                raise CliError(f"{at}: {value!r} is not a number of seconds") from None
            if not 0 <= seconds <= 1e9:
                raise CliError(f"{at}: {value!r} is out of range: must be within [0, 1e9] seconds")
            extra[key] = seconds
            continue
        if key in _PRESET_REFUSED:
            raise CliError(
                f"{at}: a llama-server preset key llama-cpp-actors does not support ({_PRESET_REFUSED[key]})"
            )
        if key == "model":  # checked here, so a missing file names its section
            extra["model"] = value
            continue
        flag = _flag_of(key, spellings)
        if flag is None:
            raise CliError(f"{at}: not a llama-server flag, a short form, LLAMA_ARG_* or a preset key")
        action = spellings[flag]
        if action.dest in _ROUTER_ONLY:
            raise CliError(f"{at}: {flag} is the router's, not a model's: give it on the command line")
        if action.dest not in dests:  # a llama-server flag we refuse: the parser says so
            argv.append(flag if action.nargs == 0 else f"{flag}={value}")
            continue
        if action.nargs == 0:  # a switch: key = true, or false for its negation
            on = _boolean(value, at)
            negations = (n for n, a in spellings.items() if a.dest == action.dest and a is not action)
            negation = next(negations, None)
            if on:
                argv.append(flag)
            elif negation is not None:
                argv.append(negation)
            else:
                raise CliError(f"{at}: {flag} has no negation: leave it out instead of false")
        else:
            argv.append(f"{flag}={value}")
    return argv, extra


def _entry(
    name: str,
    where: str,
    pairs: list[tuple[str, str, int]],
    base: tuple[str, ...],
    serve: argparse.ArgumentParser,
    path: str | None,
) -> ModelEntry:
    argv, extra = _section(pairs, where, serve)
    model = extra.get("model", path)
    if model is None:
        raise CliError(f"{where}: no model = PATH (and no file of that name in --models-dir)")
    if not os.path.isfile(model):
        raise CliError(f"{where}: model = {model!r}: no such file")
    return ModelEntry(
        name=name,
        where=where,
        argv=(*base, *argv),
        model_path=model,
        eager=extra.get("load-on-startup", False),
        keep_alive_s=extra.get("keep-alive"),
        pinned=extra.get("pin", False),
    )


def model_entries(
    models_dir: str | None,
    preset: tuple[str, str] | None,
    serve: argparse.ArgumentParser,
    notes: list[str],
) -> list[ModelEntry]:
    """The router's models: the directory's files, then the preset's sections (a section
    named as a file of the directory configures that file)."""
    found: dict[str, str] = {}
    if models_dir is not None:
        try:
            names = sorted(os.listdir(models_dir))
        except OSError as e:
            raise CliError(f"--models-dir {models_dir!r}: {e.strerror or e}") from None
        for file in names:
            full = os.path.join(models_dir, file)
            if os.path.isdir(full):
                notes.append(f"--models-dir: {full} skipped: a model in a subdirectory is not supported")
            elif file.endswith(".gguf") and not file.startswith("mmproj") and os.path.isfile(full):
                found[file[: -len(".gguf")][:_MAX_NAME]] = full
        if not found and preset is None:
            raise CliError(f"--models-dir {models_dir!r} holds no *.gguf file")
    sections = {} if preset is None else read_preset(preset[1], preset[0])
    where = f"preset {preset[0]}" if preset else ""
    base: tuple[str, ...] = ()
    if "*" in sections:
        argv, extra = _section(sections.pop("*"), f"{where} [*]", serve)
        if extra:
            raise CliError(f"{where} [*]: {', '.join(extra)} belongs in a model's section")
        base = tuple(argv)
    entries = {
        name: _entry(name, "--models-dir", [], base, serve, path)
        for name, path in found.items()
        if name not in sections
    }
    for name, pairs in sections.items():
        entries[name] = _entry(name, f"{where} [{name}]", pairs, base, serve, found.get(name))
    if not entries:
        raise CliError(f"{where} has no model section")
    return list(entries.values())


def model_values(
    entry: ModelEntry,
    command_line: Mapping[str, Any],
    serve: argparse.ArgumentParser,
    normalized: Callable[[list[str]], list[str]],
) -> dict[str, Any]:
    """One model's option values: the command line's over its preset's."""
    try:
        given = vars(serve.parse_args(normalized(list(entry.argv))))
    except CliError as e:
        raise CliError(f"{entry.where}: {e}") from None
    values = {dest: given.get(dest) for dest in command_line}
    values.update({dest: value for dest, value in command_line.items() if value is not None})
    values["model"] = entry.model_path
    values["models_dir"] = values["models_preset"] = None
    return values
