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

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from actors.backend import BackendOptions, check_chat_template, default_n_threads
from actors.contract import ConfigError, InvalidRequest, SamplingParams, checked_template_kwargs
from actors.engine import EngineConfig
from strategies import BatchStrategy, DecodeMaximal

__all__ = [
    "KV_CACHE_TYPES",
    "MAX_CHAT_TEMPLATE_CHARS",
    "MAX_DRAFT",
    "MAX_NAME_LENGTH",
    "MAX_N_CTX",
    "MAX_N_PARALLEL",
    "MAX_N_THREADS",
    "MAX_PROMPT_CACHE_RAM_MB",
    "StartOptions",
    "check_options",
    "host_ram_mb",
]

MAX_N_PARALLEL = 256
"""Sequences per context at most: llama.cpp's ``LLAMA_MAX_SEQ``."""
MAX_N_THREADS = 512
"""Threads at most: ggml's ``GGML_MAX_N_THREADS`` (its CPU masks have this many entries)."""
MAX_N_CTX = 2**31 - 256
"""Context cells (and ``n_batch``, ``n_ubatch``) at most: positions are ``int32`` and
llama.cpp pads ``n_ctx`` up to a multiple of 256 in a ``uint32``."""
MAX_PROMPT_CACHE_RAM_MB = 2**40
"""The RAM prompt cache budget at most (an exabyte), and at most :func:`host_ram_mb`."""
MAX_NAME_LENGTH = 256
"""Characters in a server's ``name`` at most (it labels telemetry and log lines)."""
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024
"""Characters in a custom ``chat_template`` at most (256 Ki; real ones are a few KiB).

A template is Jinja2: its loops run for every chat, in the caller's thread, unbounded
by the sandbox. It is the operator's option, never a caller's, so its size is bound
and its syntax checked here, and the rest is trusted."""
KV_CACHE_TYPES = MappingProxyType(
    {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 20: "iq4_nl", 6: "q5_0", 7: "q5_1"}
)
"""The ``type_k``/``type_v`` values allowed, ``llama_cpp.GGML_TYPE_*`` id -> ggml name:
llama.cpp's own list of KV cache types; every other id aborts or is refused."""
_FLOAT_KV_TYPES = frozenset({0, 1, 30})
_INT32_MAX = 2**31 - 1
_SAMPLING_INTS = ("top_k", "penalty_last_n", "seed")
_SAMPLING_FLOATS = ("temp", "top_p", "min_p", "penalty_repeat", "penalty_freq", "penalty_present")


def _show(value: object) -> str:
    """A short description of a caller's value for an error message (any thread).

    ``repr`` of an int over 4300 digits raises ``ValueError``, and a caller's object
    may have a ``__repr__`` that raises: neither may turn a ``ConfigError`` into
    something else.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"


def _int(name: str, value: object, low: int, high: int | None, why: str = "") -> int:
    """``value`` as a plain int within ``[low, high]`` (bools are not ints here)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {_show(value)}{why}")
    number = int.__int__(value)  # a plain int even from a subclass
    if high is None and number < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {_show(number)}{why}")
    if high is not None and not low <= number <= high:
        raise ConfigError(f"{name} must be within [{low}, {high}], got {_show(number)}{why}")
    return number


def _optional_int(name: str, value: object, low: int, high: int, why: str = "") -> int | None:
    return None if value is None else _int(name, value, low, high, why)


def _flag(name: str, value: object) -> bool:
    # bool(x) would read "no", 0.0 or [] as a choice; ints too easily mean something else.
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {_show(value)}")
    return value


def _model_path(value: object, name: str = "model_path") -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        path = str.__getitem__(value, slice(None))
    elif isinstance(value, os.PathLike):
        try:
            path = os.fspath(value)
        except Exception as e:  # a caller's __fspath__
            raise ConfigError(f"{name} could not be read as a path: {e!r}") from None
        if not isinstance(path, str):
            raise ConfigError(f"{name} must be a str path, got {type(path).__name__}")
    else:
        raise ConfigError(f"{name} must be a str or os.PathLike (or None), got {_show(value)}")
    return _checked_path(path, name)


def _checked_path(path: str, name: str = "model_path") -> str:
    """``path`` if llama.cpp can be given it: UTF-8 (any thread).

    A file name that is not UTF-8 comes from ``os.listdir`` with lone surrogates in it,
    and encoding it for llama.cpp would fail in the actor thread instead of here.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} {_show(path)} is not valid UTF-8") from None
    return path


def _kv_type(name: str, value: object) -> int | None:
    if value is None:
        return None
    allowed = ", ".join(f"{i} ({n})" for i, n in KV_CACHE_TYPES.items())
    if not isinstance(value, int) or isinstance(value, bool) or value not in KV_CACHE_TYPES:
        raise ConfigError(
            f"{name} must be one of llama.cpp's KV cache types (llama_cpp.GGML_TYPE_*): "
            f"{allowed}; got {_show(value)}"
        )
    return int.__int__(value)


def _name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"name must be a non-empty str or None, got {_show(value)}")
    text = str.__getitem__(value, slice(None))
    if len(text) > MAX_NAME_LENGTH:
        raise ConfigError(f"name may have at most {MAX_NAME_LENGTH} characters, got {len(text)}")
    # It lands in log lines and telemetry labels: a newline could forge a log line,
    # a lone surrogate would fail wherever it is encoded.
    if not text.isprintable():
        raise ConfigError(f"name must be printable (no control characters), got {_show(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"name is not valid Unicode (a lone surrogate): {_show(text)}") from None
    return text


def _chat_template(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"chat_template must be a non-empty str of Jinja2 (or None), got {_show(value)}")
    text = str.__getitem__(value, slice(None))
    if len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ConfigError(
            f"chat_template may have at most {MAX_CHAT_TEMPLATE_CHARS} characters, got {len(text)}"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("chat_template is not valid Unicode (a lone surrogate)") from None
    check_chat_template(text)  # a syntax error is a ConfigError now, not every chat's later
    return text


def _chat_template_kwargs(value: object) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    try:
        return checked_template_kwargs(value, "chat_template_kwargs")
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


def host_ram_mb() -> float:
    """This machine's physical memory in MiB, or ``MAX_PROMPT_CACHE_RAM_MB`` where the
    OS does not say (any thread)."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / 2**20
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return float(MAX_PROMPT_CACHE_RAM_MB)


def _megabytes(value: object) -> float:
    name = "prompt_cache_ram_mb"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number >= 0, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        raise ConfigError(f"{name} is too large: {_show(value)}") from None
    if not 0 <= number <= MAX_PROMPT_CACHE_RAM_MB:  # False for NaN
        raise ConfigError(f"{name} must be within [0, {MAX_PROMPT_CACHE_RAM_MB}], got {_show(value)}")
    # The cache fills up to its budget: a budget past the machine's memory is no budget,
    # and the host would swap or be killed for memory before the cache evicts anything.
    ram = host_ram_mb()
    if number > ram:
        raise ConfigError(f"{name} ({number:g}) is more than this machine's memory ({ram:.0f} MiB)")
    return number


MAX_DRAFT = 256
"""``draft_max`` at most: draft tokens one slot may have verified in one tick."""


def _speculation(
    spec_type: object, draft_max: object, draft_model_path: object, draft_p_min: object
) -> tuple[str | None, int, str | None, float]:
    if spec_type is not None and spec_type not in ("ngram", "draft"):
        raise ConfigError(f"spec_type must be None (off), 'ngram' or 'draft', got {_show(spec_type)}")
    draft_max = _int("draft_max", draft_max, 1, MAX_DRAFT)
    path = _model_path(draft_model_path, "draft_model_path")
    if spec_type == "draft" and path is None:
        raise ConfigError(
            "spec_type='draft' needs draft_model_path: a smaller model with the same vocabulary"
        )
    if spec_type != "draft" and path is not None:
        raise ConfigError("draft_model_path is for spec_type='draft'")
    if (
        not isinstance(draft_p_min, int | float)
        or isinstance(draft_p_min, bool)
        or not 0.0 <= draft_p_min <= 1.0  # False for NaN
    ):
        raise ConfigError(f"draft_p_min must be a number within [0, 1], got {_show(draft_p_min)}")
    if spec_type != "draft" and draft_p_min != 0.0:  # never silently ignored
        raise ConfigError("draft_p_min is for spec_type='draft' (a draft model's confidence)")
    return spec_type, draft_max, path, float(draft_p_min)


def _sampling(values: dict[str, object]) -> SamplingParams:
    for name in (*_SAMPLING_INTS, *_SAMPLING_FLOATS):
        value = values[name]
        # SamplingParams would put a 4300-digit int in its message, and that raises.
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1023:
            raise ConfigError(f"{name} is out of range: {_show(value)}")
    try:
        return SamplingParams(**values)  # type: ignore[arg-type]  # checked by it
    except InvalidRequest as e:
        raise ConfigError(str(e)) from None


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
