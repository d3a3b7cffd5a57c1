"""``StartOptions``: a ServerActor's options once checked, as plain values, and what
the backend and the engine are made from (caller's thread)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.actor._option_values import _checked_path
from actors.backend import BackendOptions
from actors.contract import LoraAdapter, SamplingParams
from actors.engine import EngineConfig
from strategies import BatchStrategy

__all__ = ["StartOptions"]


@dataclass(frozen=True, slots=True)
class StartOptions:
    """Every start option of a ``ServerActor``, checked and with its defaults resolved.

    ``model_path`` is only type-checked (``None`` is the default model): finding and
    reading the file is ``resolve_model_path``'s job, and raises ``ModelLoadError``.
    """

    model_path: str | None
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_parallel: int
    n_threads: int
    n_threads_batch: int
    flash_attn: bool | None
    type_k: int | None
    type_v: int | None
    n_gpu_layers: int
    use_mmap: bool
    use_mlock: bool
    chunk_size: int
    max_queue: int
    cache_prompt: bool
    prefix_sharing: bool
    batch_strategy: BatchStrategy
    defaults: SamplingParams
    n_ctx_per_slot: int | None
    context_shift: bool
    ram_budget_bytes: int
    name: str | None
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any]
    spec_type: str | None = None
    draft_max: int = 16
    draft_min: int = 0
    draft_model_path: str | None = None
    draft_p_min: float = 0.0
    cache_idle_slots: bool = True
    lora: tuple[LoraAdapter, ...] = ()

    def backend_options(self, model_path: str) -> BackendOptions:
        """What the backend loads, for the resolved ``model_path`` (caller's thread)."""
        return BackendOptions(
            model_path=_checked_path(model_path),
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_parallel=self.n_parallel,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads_batch,
            flash_attn=self.flash_attn,
            type_k=self.type_k,
            type_v=self.type_v,
            n_gpu_layers=self.n_gpu_layers,
            use_mmap=self.use_mmap,
            use_mlock=self.use_mlock,
            lora=self.lora,
        )

    def engine_config(self) -> EngineConfig:
        """The engine's scheduling options (caller's thread)."""
        return EngineConfig(
            chunk_size=self.chunk_size,
            max_queue=self.max_queue,
            cache_prompt=self.cache_prompt,
            prefix_sharing=self.prefix_sharing,
            batch_strategy=self.batch_strategy,
            defaults=self.defaults,
            n_ctx_per_slot=self.n_ctx_per_slot,
            context_shift=self.context_shift,
            ram_budget_bytes=self.ram_budget_bytes,
            name=self.name,
            spec_type=self.spec_type,
            draft_max=self.draft_max,
            draft_min=self.draft_min,
            draft_p_min=self.draft_p_min,
            cache_idle_slots=self.cache_idle_slots,
        )
