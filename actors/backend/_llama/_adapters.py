"""The LoRA adapters loaded with a model, and the one set the context applies.

llama.cpp applies a set of adapters to the whole context (``llama_set_adapters_lora``):
every sequence in the next ``llama_decode`` runs with it. A change of set makes that
decode re-reserve the compute graph (8-11 ms on a quiet 2-core AMD EPYC with
SmolLM2-135M, where a one-row decode takes 13-17 ms: ``bench/lora.py``), so the engine
serves one set for a few ticks in a row (``strategies.fair_adapters``). Engine thread only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp as _lc

from actors.contract import DecodeError, LoraAdapter, ModelLoadError

__all__ = ["LlamaAdapters"]


class LlamaAdapters:
    """The adapters ``loaded`` (checked by ``check_adapter`` first) and the set in use.

    The model frees its adapters when it is freed; none is freed alone.
    """

    def __init__(self, model: Any, ctx: Any, loaded: tuple[LoraAdapter, ...]) -> None:
        self._ctx = ctx
        self.loaded = loaded
        self._handles: list[Any] = []
        for adapter in loaded:
            handle = _lc.llama_adapter_lora_init(model, adapter.path.encode())
            if not handle:
                raise ModelLoadError(
                    f"llama.cpp could not load LoRA adapter {adapter.name!r} ({adapter.path!r})"
                )
            self._handles.append(handle)
        self.current: tuple[tuple[int, float], ...] = ()
        self.n_switches = 0

    def use(self, adapters: Sequence[tuple[int, float]]) -> None:
        """Apply ``adapters`` (``(id, scale)`` pairs) to the context for the next decodes;
        nothing to do when it is the set in use."""
        key = tuple(adapters)
        if key == self.current:
            return
        n = len(key)
        handles = (_lc.llama_adapter_lora_p_ctypes * max(n, 1))(*(self._handles[i] for i, _ in key))
        scales = (ctypes.c_float * max(n, 1))(*(scale for _, scale in key))
        code = int(_lc.llama_set_adapters_lora(self._ctx, handles, n, scales))
        if code != 0:
            raise DecodeError(f"llama_set_adapters_lora failed with code {code}")
        self.current = key
        self.n_switches += 1
