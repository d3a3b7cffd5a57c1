"""What the backend needs to load a model and make one context (any thread)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from actors.contract import LoraAdapter

__all__ = ["BackendOptions", "default_n_threads"]


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """What the backend needs to load a model and make one context."""

    model_path: str
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_parallel: int
    n_threads: int
    n_threads_batch: int
    flash_attn: bool | None = None
    type_k: int | None = None
    type_v: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    lora: tuple[LoraAdapter, ...] = ()
    """LoRA adapters to load with the model (checked against it by ``check_adapter``)."""


def default_n_threads() -> int:
    """Threads for a new context: every core but one, at least one.

    Measured on a 2-core machine with SmolLM2-135M, 8 sequences: 2 threads decode
    157 tok/s on a quiet machine against 89 for 1 thread, but only 42 tok/s while
    another process keeps one core busy (1 thread: 89). An engine embedded in an
    application shares the machine with it, so we leave it a core.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores - 1)
