"""Loading a model and its context, and the backend they make: :class:`LlamaBackend`.

The backend is its parts, one per concern, each in its module of this package:
``vocab`` (:class:`LlamaVocab`: tokenizing, pieces; thread-safe), ``kv``
(:class:`LlamaKv`: the KV sequences), ``rows`` (:class:`LlamaRows`: the batch and the
forward pass), ``sampling`` (:class:`LlamaSampling`: samplers, logprobs, grammars) and
``chat`` (:class:`LlamaChat`: the chat template and chat prompts). The engine sees it
through :class:`actors.backend.Backend`. Everything runs in the engine's actor thread
except what a part marks thread-safe.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import llama_cpp as _lc

from actors.backend._digest import file_digest
from actors.backend._llama._adapters import LlamaAdapters
from actors.backend._llama._chat import LlamaChat
from actors.backend._llama._context import LlamaKv, LlamaRows
from actors.backend._llama._sampling import LlamaSampling
from actors.backend._llama._vocab import LlamaVocab, file_identity
from actors.backend._options import BackendOptions
from actors.backend._protocol import KvIdentity
from actors.backend._readers import Readers
from actors.contract import ConfigError, LoraAdapter, ModelLoadError

__all__ = ["EMBED_LANES", "LlamaBackend", "exact_attention", "llama_cpp_version"]

_log = logging.getLogger("llama_cpp_actors.llama_cpp")

# ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT (continue the previous line).
_LEVELS = {
    0: logging.CRITICAL,
    1: logging.DEBUG,
    2: logging.INFO,
    3: logging.WARNING,
    4: logging.ERROR,
}
_GGML_LOG_CONT = 5
_pending_line = threading.local()


@_lc.llama_log_callback  # type: ignore[untyped-decorator]
def _route_log(level: int, text: bytes, _user_data: Any) -> None:
    """Send llama.cpp's log lines to ``logging`` instead of stderr (any thread)."""
    parts: list[str] = getattr(_pending_line, "parts", [])
    if level != _GGML_LOG_CONT or not parts:
        _pending_line.level = _LEVELS.get(level, logging.DEBUG)
    parts.append(text.decode("utf-8", errors="replace"))
    _pending_line.parts = parts
    if parts[-1].endswith("\n"):
        _log.log(_pending_line.level, "%s", "".join(parts).rstrip())
        _pending_line.parts = []


_lc.llama_log_set(_route_log, ctypes.c_void_p(0))
_lc.llama_backend_init()


def llama_cpp_version() -> str:
    """The installed llama-cpp-python version."""
    return str(_lc.__version__)


@functools.cache
def exact_attention() -> bool:
    """Whether llama.cpp's CPU flash attention is the batch-invariant one (thread-safe).

    ``make install`` builds llama.cpp with ``actors/backend/patches/``, whose kernel makes
    a sequence's attention independent of where its cells sit in the KV cache, of the
    batch beside it and of the thread count: the guarantee of identical numbers on every
    cache path rests on it (``docs/design/invariance.md``). A stock llama-cpp-python
    lacks the symbol; ``GGML_CPU_FA_STOCK=1`` in the environment turns the patch off.
    """
    for name in ("libggml-cpu.so", "libggml-cpu.dylib", "ggml-cpu.dll"):
        path = Path(_lc.__file__).parent / "lib" / name
        if path.exists():
            probe = getattr(ctypes.CDLL(str(path)), "ggml_cpu_flash_attn_exact", None)
            return probe is not None and bool(probe())
    return False


EMBED_LANES = 32
"""Sequences a context keeps beside its slots' for embedding texts, at most."""
_MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ
_POOLINGS = {
    _lc.LLAMA_POOLING_TYPE_MEAN: "mean",
    _lc.LLAMA_POOLING_TYPE_CLS: "cls",
    _lc.LLAMA_POOLING_TYPE_LAST: "last",
}

_FLASH_ATTN = {
    None: _lc.LLAMA_FLASH_ATTN_TYPE_AUTO,
    True: _lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: _lc.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


class LlamaBackend:
    """One model, one context with ``n_seq_max = n_parallel`` plus embedding lanes, and
    the parts that use them (see the module's docstring).

    Construct and close it in the actor thread only.
    """

    def __init__(
        self,
        options: BackendOptions,
        on_progress: Callable[[float], None] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        draft: bool = False,
        lora: tuple[LoraAdapter, ...] = (),
    ) -> None:
        """Load the model and make the context (the actor thread).

        Args:
            options: the model and context to make.
            on_progress: called with the load's progress, 0 to 1.
            chat_template: Jinja2 text (checked by :func:`check_chat_template`) used
                instead of the model's own chat template.
            chat_template_kwargs: the template's variables every chat gets, under the
                request's ``template_kwargs`` (checked as those are).
            draft: a draft model's (speculative decoding): its chat template is never
                compiled (it renders no chat, and one that does not compile must not
                stop it loading), and a recurrent or hybrid model is refused.
            lora: LoRA adapters to load (checked by ``check_adapter`` already); none
                applies until the engine asks (``adapters.use``).

        Raises:
            ModelLoadError: llama.cpp could not load the model or make the context.
            ConfigError: ``draft`` and the model is recurrent or hybrid.
        """
        self.options = options
        self._identity: KvIdentity | None = None
        model_params = _lc.llama_model_default_params()
        if on_progress is not None:
            # llama.cpp calls it from the loading thread (this one); returning False
            # would abort the load, so a failing callback is only logged.
            def report(progress: float, _user_data: Any) -> bool:
                try:
                    on_progress(float(progress))
                except Exception:
                    _log.exception("model-load progress callback raised")
                return True

            self._progress = _lc.llama_progress_callback(report)  # kept alive while loading
            model_params.progress_callback = self._progress
        model_params.n_gpu_layers = options.n_gpu_layers
        model_params.use_mmap = options.use_mmap
        model_params.use_mlock = options.use_mlock
        self._model = _lc.llama_model_load_from_file(options.model_path.encode(), model_params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {options.model_path!r} (not a GGUF model?)")
        if draft and (_lc.llama_model_is_recurrent(self._model) or _lc.llama_model_is_hybrid(self._model)):
            # Its memory refuses to drop a sequence's tail (llama_memory_seq_rm), and a
            # draft model drops its rejected draft tokens every tick.
            _lc.llama_model_free(self._model)
            self._model = None
            raise ConfigError(
                f"the draft model {options.model_path!r} is recurrent or hybrid: llama.cpp cannot "
                "drop its rejected draft tokens; a draft model must be a transformer"
            )
        vocab_handle = _lc.llama_model_get_vocab(self._model)
        context_params = _lc.llama_context_default_params()
        context_params.n_ctx = options.n_ctx
        context_params.n_batch = options.n_batch
        context_params.n_ubatch = options.n_ubatch
        # The slots' sequences, then lanes for embeddings (up to EMBED_LANES, within
        # LLAMA_MAX_SEQ and n_batch: llama.cpp reserves one output per sequence and
        # aborts when they outnumber the batch). Only sequence ids below n_seq_max may
        # enter a batch (-1 otherwise), unified KV or not.
        n_batch = min(options.n_batch, options.n_ctx)  # llama.cpp clamps it so
        lanes = max(0, min(EMBED_LANES, _MAX_SEQ - options.n_parallel, n_batch - options.n_parallel))
        context_params.n_seq_max = options.n_parallel + lanes
        self.pooling: str | None = self._model_pooling()
        if self.pooling is not None:
            # Per-token embeddings whatever the metadata says: every pooling is then done
            # in numpy, on this one context (actors.engine._embedding). A causal LM names
            # no pooling, and its context has none already.
            context_params.pooling_type = _lc.LLAMA_POOLING_TYPE_NONE
        context_params.n_threads = options.n_threads
        context_params.n_threads_batch = options.n_threads_batch
        # One KV buffer shared by all sequences: a prompt fits when it fits n_ctx.
        context_params.kv_unified = True
        context_params.flash_attn_type = _FLASH_ATTN[options.flash_attn]
        if options.type_k is not None:
            context_params.type_k = options.type_k
        if options.type_v is not None:
            context_params.type_v = options.type_v
        context_params.no_perf = True
        self._ctx = _lc.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            _lc.llama_model_free(self._model)
            self._model = None
            raise ModelLoadError(f"llama.cpp could not create a context for {options.model_path!r}")
        self.n_ctx: int = _lc.llama_n_ctx(self._ctx)
        self.n_batch: int = _lc.llama_n_batch(self._ctx)
        self.n_seq_max: int = options.n_parallel
        self.embed_seq_ids: tuple[int, ...] = tuple(range(options.n_parallel, _lc.llama_n_seq_max(self._ctx)))
        self.n_embd: int = _lc.llama_model_n_embd(self._model)
        if _lc.llama_pooling_type(self._ctx) != _lc.LLAMA_POOLING_TYPE_NONE:
            self.embed_seq_ids = ()  # pooled in llama.cpp: no per-token rows to pool here
        self.n_ctx_train: int = _lc.llama_model_n_ctx_train(self._model)
        # Callers' threads tokenize (and probe grammars) at once; close() waits until
        # they are done, so the vocabulary is never freed under them.
        try:  # a template that does not compile, say: the model and context are freed
            self._readers = Readers()
            identity = file_identity(options.model_path)
            self.vocab = LlamaVocab(vocab_handle, self._readers, lambda: bool(self._model), identity)
            self.adapters = LlamaAdapters(self._model, self._ctx, lora)
            self.kv = LlamaKv(self._ctx)
            self.rows = LlamaRows(self._ctx, self.kv, self.n_batch, self.vocab.n_vocab, self.n_embd)
            self.sampling = LlamaSampling(self.vocab, self.rows.row_logits, self.n_ctx)
            self.chat = LlamaChat(
                None if draft else self._template_text(chat_template),
                self.vocab,
                chat_template_kwargs or {},
                self.sampling.json_schema_grammar,
            )
        except BaseException:
            self._close()
            raise

    def _model_pooling(self) -> str | None:
        """The pooling the GGUF metadata names (``<arch>.pooling_type``), when it is one
        of mean, cls and last; None otherwise (a causal LM names none)."""
        buf = ctypes.create_string_buffer(256)
        n = _lc.llama_model_meta_val_str(self._model, b"general.architecture", buf, len(buf))
        if n <= 0:
            return None
        key = buf.value + b".pooling_type"
        n = _lc.llama_model_meta_val_str(self._model, key, buf, len(buf))
        if n <= 0:
            return None
        try:
            return _POOLINGS.get(int(buf.value.decode()))
        except ValueError:
            return None

    def _template_text(self, custom: str | None) -> str | None:
        """The chat template's text: the server's ``chat_template``, else the model's own
        (None when it has none)."""
        if custom is not None:
            return custom
        raw = _lc.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def identity(self) -> KvIdentity:
        """What this context's saved KV states are valid for (actor thread): the model's
        and adapters' digests (about 2 MiB read from each file, once) and the KV types."""
        if self._identity is None:
            options = self.options
            kv_types = (
                1 if options.type_k is None else options.type_k,
                1 if options.type_v is None else options.type_v,
            )
            self._identity = KvIdentity(
                file_digest(options.model_path),
                kv_types,
                tuple(file_digest(a.path) for a in self.adapters.loaded),
            )
        return self._identity

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model (actor thread, once), after running tokenizes."""
        self._readers.close(self._close)

    def _close(self) -> None:
        if self._ctx:
            _lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            _lc.llama_model_free(self._model)
            self._model = None
