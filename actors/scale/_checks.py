"""What a ``ModelManager`` checks in the caller's thread before its actor sees it:
model names, options, timeouts and the messages it routes; and the arithmetic of its
budget (the machine's memory, a model's replicas). Any thread.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from actors.actor import MemoryEstimate, StartOptions
from actors.contract import (
    MAX_ID_LENGTH,
    AdmittedMessage,
    ConfigError,
    InvalidRequest,
    SamplingParams,
    Submit,
    checked_text,
)

__all__ = [
    "checked_keep_alive",
    "checked_name",
    "checked_timeout",
    "known_name",
    "listed",
    "machine_memory_mb",
    "plain_options",
    "routed_id",
    "times",
]

_MIB = 1 << 20
_ROUTED = AdmittedMessage | Submit
_MAX_TIMEOUT_S = 1e6


def machine_memory_mb() -> float:
    """The memory this process may use, in MiB (any thread): the machine's, or its
    cgroup's limit when lower (a container); 0 when the OS says neither."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _MIB
    except (ValueError, OSError, AttributeError):
        physical = 0.0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 says a huge number
            limit = int(text) / _MIB
            if 0 < limit < (physical or float("inf")):
                return limit
    return physical


def times(estimate: MemoryEstimate, replicas: int) -> MemoryEstimate:
    """The estimate of ``replicas`` engines of one model (each holds its own copy)."""
    if replicas == 1:
        return estimate
    return dataclasses.replace(
        estimate,
        weights_mb=estimate.weights_mb * replicas,
        kv_mb=estimate.kv_mb * replicas,
        compute_mb=estimate.compute_mb * replicas,
        overhead_mb=estimate.overhead_mb * replicas,
        draft_mb=estimate.draft_mb * replicas,
        ram_cache_mb=estimate.ram_cache_mb * replicas,
    )


def listed(models: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in models) or "no model"


def checked_name(name: object) -> str:
    try:
        checked = checked_text("a model name", name, MAX_ID_LENGTH)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
    if not checked:
        raise ConfigError("a model name must be a non-empty str")
    return checked


def checked_keep_alive(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        raise ConfigError(f"keep_alive_s must be a number of seconds >= 0, or None (never), got {value!r}")
    return float(value)


def routed_id(message: Any) -> str:
    """The id of a request the manager routes; anything else is refused before a model
    is leased (leasing may load one, and unload another)."""
    if not isinstance(message, _ROUTED):
        raise TypeError(f"a ModelManager does not handle {type(message).__name__}: {message!r}")
    request = message.message if isinstance(message, Submit) else message
    return request.request_id


def checked_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 <= timeout <= _MAX_TIMEOUT_S
    ):
        raise InvalidRequest(
            f"timeout must be None or a number of seconds within [0, {_MAX_TIMEOUT_S:g}], got {timeout!r}"
        )
    return float(timeout)


def known_name(name: object) -> str:
    """A name given to unload, unregister or load: never None (the default model)."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"name a model, got {name!r}")
    return name


def plain_options(options: Mapping[str, Any], checked: StartOptions) -> dict[str, Any]:
    """``options`` as the engine will be started with them, from the checked values:
    never a caller's object that could answer differently at load (a path-like whose
    ``__fspath__`` changes, a number subclass that raises). Paths become absolute, so a
    change of the working directory does not change the model."""
    plain: dict[str, Any] = {}
    for key, value in options.items():
        if key in ("model_path", "draft_model_path"):
            path = getattr(checked, key)
            plain[key] = None if path is None else os.path.abspath(path)
        elif key in _START_FIELDS:
            plain[key] = getattr(checked, key)
        elif key in _SAMPLING_FIELDS:
            plain[key] = getattr(checked.defaults, key)
        elif isinstance(value, bool | int | float | str):
            plain[key] = next(base(value) for base in (bool, int, float, str) if isinstance(value, base))
        else:
            plain[key] = value
    return plain


_START_FIELDS = frozenset(f.name for f in dataclasses.fields(StartOptions)) - {"defaults"}
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def replica_names(replicas: object, max_restarts: object, name: object) -> list[str]:
    """A pool's replica names (``name``, or ``name-0``, ``name-1``...), its counts checked.

    Raises:
        ConfigError: ``replicas`` is not an int >= 1, ``max_restarts`` not an int >= 0,
            or ``name`` not a non-empty str or None.
    """
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"replicas must be an int >= 1, got {replicas!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if name is not None and (not isinstance(name, str) or not name):
        raise ConfigError(f"name must be a non-empty str or None, got {name!r}")
    if name is not None and replicas == 1:
        return [name]
    return [f"{name or 'replica'}-{i}" for i in range(replicas)]
