"""LoRA adapters in the contract: the adapters a server loads (:class:`LoraAdapter`),
the ``lora`` a request asks for, and the messages that read and set the server's
default scales (:class:`GetLora`, :class:`SetLora`). Checked in the caller's thread.

A request's ``lora`` names adapters by id (their place in the server's list, from 0)
or by name, each with a scale: ``{"customer-a": 1.0}``, ``{0: 0.5}``, or llama-server's
list ``[{"id": 0, "scale": 0.5}]``. The adapters it does not name are off (scale 0),
as in llama-server; a request without ``lora`` runs with the server's default scales.
Which ids and names exist is checked against the server, when the request is prepared.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from actors.contract._checks import MAX_ID_LENGTH, _checked_float, _require, _show, checked_text, is_int
from actors.contract._errors import InvalidRequest

__all__ = [
    "MAX_ADAPTERS",
    "MAX_LORA_SCALE",
    "GetLora",
    "LoraAdapter",
    "LoraScales",
    "SetLora",
    "checked_adapters",
    "checked_lora",
]

MAX_ADAPTERS = 64
"""The most LoRA adapters a server loads (and a request may name)."""
MAX_LORA_SCALE = 100.0
"""The largest magnitude of an adapter's scale (negative scales subtract an adapter)."""

LoraScales = Mapping[int | str, float]
"""A request's adapters: id or name → scale (checked, frozen)."""


def _checked_scale(name: str, value: object) -> float:
    scale = _checked_float(name, value)
    _require(
        abs(scale) <= MAX_LORA_SCALE,
        f"{name} must be within [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got {_show(value)}",
    )
    return scale


def _checked_key(value: object) -> int | str:
    if is_int(value):
        assert isinstance(value, int)
        _require(
            0 <= value < MAX_ADAPTERS,
            f"a LoRA adapter id must be within [0, {MAX_ADAPTERS}), got {_show(value)}",
        )
        return value
    _require(
        isinstance(value, str), f"a LoRA adapter is named by an int id or a str name, got {_show(value)}"
    )
    name = checked_text("a LoRA adapter's name", value, MAX_ID_LENGTH)
    _require(name != "", "a LoRA adapter's name must be non-empty")
    return name


def checked_lora(value: object, name: str = "lora") -> LoraScales | None:
    """A request's ``lora`` as a frozen id-or-name → scale mapping (None stays None).

    Takes a mapping, or llama-server's list of ``{"id": ..., "scale": ...}`` objects.

    Raises:
        InvalidRequest: a wrong type, too many entries, an id out of range, a name that is
            not text, a scale that is not finite or too large, one adapter named twice.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        pairs = list(value.items()) if len(value) <= MAX_ADAPTERS else None
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        pairs = [] if len(value) <= MAX_ADAPTERS else None
        for entry in value if pairs is not None else ():
            _require(
                isinstance(entry, Mapping) and set(entry) <= {"id", "scale"} and "id" in entry,
                f"each {name} entry must be an object {{'id', 'scale'}}, got {_show(entry)}",
            )
            assert pairs is not None and isinstance(entry, Mapping)
            pairs.append((entry["id"], entry.get("scale", 1.0)))
    else:
        raise InvalidRequest(
            f"{name} must be a dict of adapter id or name to scale, or a list of "
            f"{{'id', 'scale'}}, got {type(value).__name__}"
        )
    _require(pairs is not None, f"{name} names at most {MAX_ADAPTERS} adapters")
    assert pairs is not None
    scales: dict[int | str, float] = {}
    for key, scale in pairs:
        checked = _checked_key(key)
        _require(checked not in scales, f"{name} names adapter {checked!r} twice")
        scales[checked] = _checked_scale(f"{name}[{checked!r}]", scale)
    return MappingProxyType(scales)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter a server loads (``ServerActor.start(lora=[...])``), or one it lists.

    Attributes:
        path: the adapter's GGUF file (made by llama.cpp's ``convert_lora_to_gguf.py``).
        scale: its default scale: what a request without ``lora`` runs with (0: loaded
            but off, llama-server's ``--lora-init-without-apply``).
        name: what requests may call it by (default: the file's name without ``.gguf``);
            ids are places in the server's list, from 0.
    """

    path: str
    scale: float = 1.0
    name: str | None = None

    def __post_init__(self) -> None:
        _require(
            isinstance(self.path, str | os.PathLike),
            f"a LoRA adapter's path must be a str or a path, got {type(self.path).__name__}",
        )
        path = checked_text("a LoRA adapter's path", os.fspath(self.path), 4096)
        _require(path != "", "a LoRA adapter's path must be non-empty")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "scale", _checked_scale("a LoRA adapter's scale", self.scale))
        name = self.name if self.name is not None else _stem(path)
        name = checked_text("a LoRA adapter's name", name, MAX_ID_LENGTH)
        _require(name != "", "a LoRA adapter's name must be non-empty")
        object.__setattr__(self, "name", name)


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def checked_adapters(value: object) -> tuple[LoraAdapter, ...]:
    """A server's ``lora`` start option: paths, ``(path, scale)`` pairs or
    :class:`LoraAdapter` objects, as adapters with unique names (caller's thread).

    Raises:
        InvalidRequest: a wrong type, more than ``MAX_ADAPTERS``, two with one name.
    """
    _require(
        isinstance(value, Sequence) and not isinstance(value, str | bytes),
        f"lora must be a list of adapter paths, (path, scale) pairs or LoraAdapter, got {_show(value)}",
    )
    assert isinstance(value, Sequence)
    _require(len(value) <= MAX_ADAPTERS, f"lora takes at most {MAX_ADAPTERS} adapters, got {len(value)}")
    adapters: list[LoraAdapter] = []
    for item in value:
        if isinstance(item, LoraAdapter):
            adapter = LoraAdapter(item.path, item.scale, item.name)  # checked again: a copy may lie
        elif isinstance(item, tuple) and len(item) == 2:
            adapter = LoraAdapter(item[0], item[1])
        else:
            adapter = LoraAdapter(item)
        _require(
            all(a.name != adapter.name for a in adapters),
            f"two LoRA adapters are named {adapter.name!r}: give one a name",
        )
        adapters.append(adapter)
    return tuple(adapters)


@dataclass(frozen=True, slots=True)
class GetLora:
    """Ask for the server's adapters: a tuple of :class:`LoraAdapter`, each with its
    current default scale, in id order."""


@dataclass(frozen=True, slots=True)
class SetLora:
    """Set the server's default scales (llama-server's ``POST /lora-adapters``): the
    adapters ``scales`` names take its scales, the others 0. Requests admitted from then
    on without their own ``lora`` run with them; the ask answers the new list (as
    :class:`GetLora`)."""

    scales: LoraScales | Sequence[Mapping[str, Any]]
    """Adapter id or name → scale, or llama-server's ``[{"id", "scale"}]``; stored as a
    frozen mapping (:attr:`by_adapter`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scales", checked_lora(self.scales, "scales") or MappingProxyType({}))

    @property
    def by_adapter(self) -> LoraScales:
        """The scales, adapter id or name → scale (checked)."""
        assert isinstance(self.scales, Mapping)
        return self.scales

    def __reduce__(self) -> tuple[Any, ...]:
        return (SetLora, (dict(self.by_adapter),))  # a frozen mapping does not pickle
