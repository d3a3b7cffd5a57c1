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

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.actor._option_values import (
    _FLOAT_KV_TYPES,
    _INT32_MAX,
    KV_CACHE_TYPES,
    MAX_N_CTX,
    MAX_N_PARALLEL,
    MAX_N_THREADS,
    _chat_template,
    _chat_template_kwargs,
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
from actors.actor._start_options import StartOptions
from actors.backend import default_n_threads
from actors.contract import ConfigError, InvalidRequest, LoraAdapter, checked_adapters, suggesting
from strategies import BatchStrategy, DecodeMaximal

__all__ = ["OPTION_NAMES", "ServerOptions", "StartOptions", "check_options"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """Every start option of a ``ServerActor``, checked when made (the caller's thread).

    ``ServerActor.start(**options)`` makes one of these; so do the ``Supervisor``, the
    ``ServerPool``, the ``ModelManager`` and ``serve``'s command line, so an option is
    declared here once, with its default, and each of them takes it by the same name.
    The options reference page lists exactly these fields. The values are the
    caller's, as given; :attr:`checked` holds them checked, each alone and in
    combination, with the defaults that depend on other options resolved.

    Raises:
        ConfigError: an option has the wrong type or is out of range, or two options
            contradict each other; the message names the option and the rule.
    """

    model_path: str | os.PathLike[str] | None = None
    n_parallel: int = 4
    n_ctx: int = 8192
    n_batch: int | None = None
    chunk_size: int = 512
    max_queue: int = 64
    cache_prompt: bool = True
    prefix_sharing: bool = True
    cache_idle_slots: bool = True
    batch_strategy: BatchStrategy | None = None
    n_threads: int | None = None
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    grammar: str | None = None
    n_ubatch: int | None = None
    n_threads_batch: int | None = None
    flash_attn: bool | None = None
    type_k: int | None = None
    type_v: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    n_ctx_per_slot: int | None = None
    context_shift: bool = True
    prompt_cache_ram_mb: float = 0
    name: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    spec_type: Literal["ngram", "draft"] | None = None
    draft_max: int = 16
    draft_min: int = 0
    draft_model_path: str | os.PathLike[str] | None = None
    draft_p_min: float = 0.0
    lora: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], float] | LoraAdapter] = ()
    checked: StartOptions = field(init=False, repr=False, compare=False)
    """The options checked, as plain values (``n_batch``, ``n_ubatch``, ``n_threads``
    and ``n_threads_batch`` resolved, the sampling defaults as ``SamplingParams``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "checked", _check(self))

    @classmethod
    def of(cls, **options: Any) -> ServerOptions:
        """The options named by keyword, as ``ServerActor.start`` takes them.

        Raises:
            TypeError: a keyword that is not an option, named with the option it most
                likely meant ("did you mean ``temp``?").
            ConfigError: as the constructor.
        """
        return cls(**options)

    @classmethod
    def given(cls, options: object, changes: Mapping[str, Any]) -> ServerOptions:
        """How every start takes its options: ``options`` (a ServerOptions, or None for
        the defaults) with ``changes`` by name.

        Raises:
            TypeError: ``options`` is something else, or a name is not an option.
            ConfigError: as the constructor.
        """
        if options is None:
            return cls.of(**changes)
        if not isinstance(options, ServerOptions):
            raise TypeError(f"options must be a ServerOptions, got {type(options).__name__}")
        return options.replace(**changes) if changes else options

    def replace(self, **changes: Any) -> ServerOptions:
        """These options with ``changes`` (checked again, as :meth:`of`)."""
        return dataclasses.replace(self, **changes)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(ServerOptions) if f.init)
"""The names ``ServerActor.start`` takes."""

# Names other libraries and llama-server give these options.
_ALIASES = {
    "temperature": "temp", "model": "model_path", "ctx_size": "n_ctx", "context_size": "n_ctx",
    "threads": "n_threads", "batch_size": "n_batch", "ubatch_size": "n_ubatch",
    "parallel": "n_parallel", "n_slots": "n_parallel", "slots": "n_parallel",
    "presence_penalty": "penalty_present", "frequency_penalty": "penalty_freq",
    "repeat_penalty": "penalty_repeat", "repeat_last_n": "penalty_last_n",
    "flash_attention": "flash_attn", "cache_type_k": "type_k", "cache_type_v": "type_v",
    "gpu_layers": "n_gpu_layers", "ngl": "n_gpu_layers", "mlock": "use_mlock", "mmap": "use_mmap",
    "draft_model": "draft_model_path", "model_draft": "draft_model_path", "strategy": "batch_strategy",
}  # fmt: skip

# A keyword that is not an option names the one it likely meant, as the messages do.
suggesting(ServerOptions, "ServerActor.start()", _ALIASES, " (see docs/reference/options.md)")


def check_options(**options: Any) -> StartOptions:
    """``ServerOptions.of(**options).checked``: ``ServerActor.start``'s keywords checked
    (caller's thread). Pure: it loads nothing, reads no file and changes nothing; it asks
    the OS only for the cores it may use and the size of its memory.

    Raises:
        TypeError: an unknown keyword.
        ConfigError: an option has the wrong type or is out of range, or two options
            contradict each other; the message names the option and the rule.
    """
    return ServerOptions.of(**options).checked


def _check(options: ServerOptions) -> StartOptions:
    """Check ``options``, each and in combination (caller's thread); see the module's
    docstring for why each bound is what it is."""
    model_path: object = options.model_path
    n_parallel: object = options.n_parallel
    n_ctx: object = options.n_ctx
    n_batch: object = options.n_batch
    chunk_size: object = options.chunk_size
    max_queue: object = options.max_queue
    cache_prompt: object = options.cache_prompt
    prefix_sharing: object = options.prefix_sharing
    cache_idle_slots: object = options.cache_idle_slots
    batch_strategy: object = options.batch_strategy
    n_threads: object = options.n_threads
    temp: object = options.temp
    top_k: object = options.top_k
    top_p: object = options.top_p
    min_p: object = options.min_p
    seed: object = options.seed
    penalty_last_n: object = options.penalty_last_n
    penalty_repeat: object = options.penalty_repeat
    penalty_freq: object = options.penalty_freq
    penalty_present: object = options.penalty_present
    grammar: object = options.grammar
    n_ubatch: object = options.n_ubatch
    n_threads_batch: object = options.n_threads_batch
    flash_attn: object = options.flash_attn
    type_k: object = options.type_k
    type_v: object = options.type_v
    n_gpu_layers: object = options.n_gpu_layers
    use_mmap: object = options.use_mmap
    use_mlock: object = options.use_mlock
    n_ctx_per_slot: object = options.n_ctx_per_slot
    context_shift: object = options.context_shift
    prompt_cache_ram_mb: object = options.prompt_cache_ram_mb
    name: object = options.name
    chat_template: object = options.chat_template
    chat_template_kwargs: object = options.chat_template_kwargs
    spec_type: object = options.spec_type
    draft_max: object = options.draft_max
    draft_min: object = options.draft_min
    draft_model_path: object = options.draft_model_path
    draft_p_min: object = options.draft_p_min
    try:
        lora = checked_adapters(options.lora)
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None
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
    spec_type, draft_max, draft_min, draft_path, p_min = _speculation(
        spec_type, draft_max, draft_min, draft_model_path, draft_p_min
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
        draft_min=draft_min,
        draft_model_path=draft_path,
        draft_p_min=p_min,
        lora=lora,
    )
