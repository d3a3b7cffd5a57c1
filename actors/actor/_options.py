"""Checking ``ServerActor``'s start options (the caller's thread, before any model load).

llama.cpp checks few context parameters and aborts the whole process on some of
them instead of returning an error. Measured with llama-cpp-python 0.3.36 (its
vendored llama.cpp) on the default model, each in a child process:

- ``n_batch`` (after llama.cpp clamps it to ``n_ctx``) below ``n_parallel``: SIGABRT,
  ``GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)`` while reserving one output per
  sequence. ``n_ctx=1`` with 4 sequences is the same abort (the batch is clamped to 1).
- ``type_k``/``type_v`` outside ggml's types (999, 43, -1): SIGABRT in
  ``GGML_ASSERT(type >= 0 && type < GGML_TYPE_COUNT)``, or SIGSEGV. Removed ids (4, 5,
  31-33, 36-38): SIGFPE. q8_1 (9) and the integer types (24-28): SIGSEGV or SIGABRT at
  the first decode. K-quants and i-quants (10-19, 21-23, 29, 34, 35, 41) as ``type_k``:
  SIGABRT without flash attention (a clean refusal with it). A quantized ``type_v``
  without flash attention: a clean refusal. mxfp4, nvfp4 and q2_0 (39, 40, 42) ran
  here but are not KV cache types llama.cpp offers, so they are refused too.
- ``n_threads=100000``: SIGSEGV at the first decode (512 threads work, 4096 take 36 s
  on 2 cores to decode two tokens).
- ctypes writes Python ints into llama.cpp's ``uint32_t``/``int32_t`` fields modulo
  2**32 without a word: ``n_ctx=2**32 + 512`` became a 512-token context, and
  ``n_batch=2**32 + 1`` would become 1 and then abort.

So every option is checked here, in pure Python, and anything wrong raises
:class:`~actors.contract._errors.ConfigError` from ``ServerActor.start()``. The bounds are
llama.cpp's own: ``LLAMA_MAX_SEQ`` (256, ``src/llama-cparams.h``), ``GGML_MAX_N_THREADS``
(512, ``ggml/include/ggml.h``), the KV cache types its command line accepts
(``kv_cache_types`` in ``common/arg.cpp``), and the int32 positions and uint32 sizes
of ``llama_context_params``. What needs the model is left to llama.cpp: a quantized K
cache whose block size does not divide the head size is refused cleanly
(``ModelLoadError``), and so is a KV cache the OS will not allocate; one the OS
allocates but the machine cannot hold is not caught here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.actor._option_values import (
    _FLOAT_KV_TYPES,
    _INT32_MAX,
    KV_CACHE_TYPES,
    MAX_N_CTX,
    MAX_N_PARALLEL,
    MAX_N_THREADS,
    _chat_template,
    _chat_template_kwargs,
    _checked_path,
    _flag,
    _int,
    _kv_type,
    _megabytes,
    _model_path,
    _name,
    _optional_int,
    _sampling,
    _show,
    _speculation,
)
from actors.backend import BackendOptions, default_n_threads
from actors.contract import ConfigError, SamplingParams
from actors.engine import EngineConfig
from strategies import BatchStrategy, DecodeMaximal

__all__ = ["StartOptions", "check_options"]


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
    draft_model_path: str | None = None
    draft_p_min: float = 0.0
    cache_idle_slots: bool = True

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
            draft_p_min=self.draft_p_min,
            cache_idle_slots=self.cache_idle_slots,
        )


def check_options(
    *,
    model_path: object = None,
    n_parallel: object = 4,
    n_ctx: object = 8192,
    n_batch: object = None,
    chunk_size: object = 512,
    max_queue: object = 64,
    cache_prompt: object = True,
    prefix_sharing: object = True,
    cache_idle_slots: object = True,
    batch_strategy: object = None,
    n_threads: object = None,
    temp: object = 0.8,
    top_k: object = 40,
    top_p: object = 0.95,
    min_p: object = 0.05,
    seed: object = None,
    penalty_last_n: object = 64,
    penalty_repeat: object = 1.0,
    penalty_freq: object = 0.0,
    penalty_present: object = 0.0,
    grammar: object = None,
    n_ubatch: object = None,
    n_threads_batch: object = None,
    flash_attn: object = None,
    type_k: object = None,
    type_v: object = None,
    n_gpu_layers: object = 0,
    use_mmap: object = True,
    use_mlock: object = False,
    n_ctx_per_slot: object = None,
    context_shift: object = True,
    prompt_cache_ram_mb: object = 0,
    name: object = None,
    chat_template: object = None,
    chat_template_kwargs: object = None,
    spec_type: object = None,
    draft_max: object = 16,
    draft_model_path: object = None,
    draft_p_min: object = 0.0,
) -> StartOptions:
    """Check ``ServerActor``'s start options, each and in combination (caller's thread).

    Takes the same keywords and defaults as ``ServerActor.__init__``, values of any
    type. Pure: it loads nothing, reads no file and changes nothing; it asks the OS only
    for the cores it may use and the size of its memory.

    Returns:
        the options checked, as plain values, with the defaults that depend on other
        options resolved (``n_batch``, ``n_ubatch``, ``n_threads``, ``n_threads_batch``).

    Raises:
        ConfigError: an option has the wrong type or is out of range, or two options
            contradict each other; the message names the option and the rule.
    """
    n_parallel = _int("n_parallel", n_parallel, 1, MAX_N_PARALLEL, " (llama.cpp's LLAMA_MAX_SEQ)")
    # A slot needs a cell for a prompt token and one for the token it generates.
    n_ctx = _int("n_ctx", n_ctx, 2, MAX_N_CTX)
    if n_ctx < 2 * n_parallel:
        raise ConfigError(
            f"n_ctx ({n_ctx}) must be at least 2 * n_parallel ({2 * n_parallel}): "
            "each slot needs room for a prompt token and a generated one"
        )
    n_batch = min(n_ctx, 2048) if n_batch is None else _int("n_batch", n_batch, 1, MAX_N_CTX)
    if n_batch < n_parallel:
        # llama.cpp reserves one output per sequence in a buffer of n_batch outputs
        # and aborts the process when they do not fit.
        raise ConfigError(
            f"n_batch ({n_batch}) must be at least n_parallel ({n_parallel}): "
            "one decode must hold a token of every slot"
        )
    # llama.cpp uses min(n_ubatch, n_batch) as the physical batch; say so here.
    n_ubatch = (
        min(n_batch, 512) if n_ubatch is None else min(n_batch, _int("n_ubatch", n_ubatch, 1, MAX_N_CTX))
    )
    threads_why = " (ggml's GGML_MAX_N_THREADS)"
    n_threads = (
        min(default_n_threads(), MAX_N_THREADS)
        if n_threads is None
        else _int("n_threads", n_threads, 1, MAX_N_THREADS, threads_why)
    )
    n_threads_batch = (
        n_threads
        if n_threads_batch is None
        else _int("n_threads_batch", n_threads_batch, 1, MAX_N_THREADS, threads_why)
    )
    if flash_attn is not None:
        flash_attn = _flag("flash_attn", flash_attn)
    type_k = _kv_type("type_k", type_k)
    type_v = _kv_type("type_v", type_v)
    if flash_attn is False and type_v is not None and type_v not in _FLOAT_KV_TYPES:
        raise ConfigError(
            f"type_v={type_v} ({KV_CACHE_TYPES[type_v]}) is a quantized V cache, which needs "
            "flash attention: pass flash_attn=True or None (auto), or a float type_v"
        )
    n_ctx_per_slot = _optional_int(
        "n_ctx_per_slot", n_ctx_per_slot, 2, n_ctx, " (a prompt token and a generated one, within n_ctx)"
    )
    if batch_strategy is None:
        batch_strategy = DecodeMaximal()
    if not isinstance(batch_strategy, BatchStrategy):
        raise ConfigError(f"batch_strategy must be a BatchStrategy instance, got {_show(batch_strategy)}")
    sampling: dict[str, object] = {
        "temp": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
        "penalty_last_n": penalty_last_n, "penalty_repeat": penalty_repeat,
        "penalty_freq": penalty_freq, "penalty_present": penalty_present, "grammar": grammar,
    }  # fmt: skip
    ram_mb = _megabytes(prompt_cache_ram_mb)
    spec_type, draft_max, draft_path, p_min = _speculation(
        spec_type, draft_max, draft_model_path, draft_p_min
    )
    return StartOptions(
        model_path=_model_path(model_path),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_parallel=n_parallel,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        flash_attn=flash_attn,
        type_k=type_k,
        type_v=type_v,
        n_gpu_layers=_int("n_gpu_layers", n_gpu_layers, -1, _INT32_MAX, " (-1 offloads every layer)"),
        use_mmap=_flag("use_mmap", use_mmap),
        use_mlock=_flag("use_mlock", use_mlock),
        # Python-side counts, compared and never handed to llama.cpp: no upper bound.
        chunk_size=_int("chunk_size", chunk_size, 1, None),
        max_queue=_int("max_queue", max_queue, 0, None),
        cache_prompt=_flag("cache_prompt", cache_prompt),
        prefix_sharing=_flag("prefix_sharing", prefix_sharing),
        cache_idle_slots=_flag("cache_idle_slots", cache_idle_slots),
        batch_strategy=batch_strategy,
        defaults=_sampling(sampling),
        n_ctx_per_slot=n_ctx_per_slot,
        context_shift=_flag("context_shift", context_shift),
        ram_budget_bytes=int(ram_mb * 1024 * 1024),
        name=_name(name),
        chat_template=_chat_template(chat_template),
        chat_template_kwargs=_chat_template_kwargs(chat_template_kwargs),
        spec_type=spec_type,
        draft_max=draft_max,
        draft_model_path=draft_path,
        draft_p_min=p_min,
    )
