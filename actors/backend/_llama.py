"""The only module that imports ``llama_cpp``: model, context, batch and samplers.

Everything in :class:`LlamaBackend` runs in the engine's actor thread, except the
methods marked thread-safe (tokenizing and token pieces read the immutable vocabulary).
llama.cpp aborts the whole process on some bad input (a batch over ``n_batch``, a
logits index that did not ask for logits), so the engine validates every batch before
it reaches :meth:`LlamaBackend.decode`. What needs no llama.cpp lives beside it:
``_options`` (what a backend is built from), ``_greedy`` (numpy greedy, ``DeadEnd``),
``_chat`` (special tokens only from the template), ``_template`` (the chat template's
render) and ``_readers`` (the vocabulary lock).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import llama_cpp as _lc
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_grammar import json_schema_to_gbnf

from actors.backend._chat import chat_tokens, check_fields, prefill
from actors.backend._faults import faults
from actors.backend._greedy import GREEDY_TEMP, DeadEnd, _Greedy
from actors.backend._options import BackendOptions
from actors.backend._readers import _Readers
from actors.backend._rows import put_rows
from actors.backend._template import ChatTemplate
from actors.chat import (
    ReplySpec,
    TemplateInfo,
    ToolGrammar,
    chat_grammar,
    detect,
    param_types,
    template_messages,
    template_tools,
)
from actors.contract import (
    Chat,
    ConfigError,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    SamplingParams,
    StreamChat,
    grammar_for_schema,
    template_variables,
)

__all__ = ["LlamaBackend", "Triggers", "exact_attention", "llama_cpp_version"]

Triggers = tuple[tuple[str, ...], tuple[int, ...]]
"""What wakes a lazy grammar: regular expressions searched in the reply so far, and
token ids."""

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
    """One model, one context with ``n_seq_max = n_parallel`` and a reusable batch.

    Construct and use it in the actor thread only (``tokenize``/``piece``/``is_eog``
    are thread-safe). The batch arrays are numpy views the engine writes into, so a
    tick allocates nothing per token.
    """

    def __init__(
        self,
        options: BackendOptions,
        on_progress: Callable[[float], None] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        draft: bool = False,
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

        Raises:
            ModelLoadError: llama.cpp could not load the model or make the context.
            ConfigError: ``draft`` and the model is recurrent or hybrid.
        """
        self.options = options
        self._custom_template = chat_template
        self._template_defaults: Mapping[str, Any] = chat_template_kwargs or {}
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
        self._vocab = _lc.llama_model_get_vocab(self._model)
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
        self._memory = _lc.llama_get_memory(self._ctx)

        self.n_vocab: int = _lc.llama_vocab_n_tokens(self._vocab)
        self.n_ctx: int = _lc.llama_n_ctx(self._ctx)
        self.n_batch: int = _lc.llama_n_batch(self._ctx)
        self.n_seq_max: int = options.n_parallel
        self.embed_seq_ids: tuple[int, ...] = tuple(range(options.n_parallel, _lc.llama_n_seq_max(self._ctx)))
        self.n_embd: int = _lc.llama_model_n_embd(self._model)
        if _lc.llama_pooling_type(self._ctx) != _lc.LLAMA_POOLING_TYPE_NONE:
            self.embed_seq_ids = ()  # pooled in llama.cpp: no per-token rows to pool here
        self.n_ctx_train: int = _lc.llama_model_n_ctx_train(self._model)
        self._bos: int = _lc.llama_vocab_bos(self._vocab)
        self._add_bos: bool = bool(_lc.llama_vocab_get_add_bos(self._vocab)) and self._bos != -1
        self.eog_ids: frozenset[int] = frozenset(
            t for t in range(self.n_vocab) if _lc.llama_vocab_is_eog(self._vocab, t)
        )
        self.eog_array = np.fromiter(sorted(self.eog_ids), dtype=np.intp)
        # Every piece up front (tens of ms): the engine thread then never calls into
        # the vocabulary, nor waits for a caller's thread that tokenizes a long prompt.
        self._pieces: list[bytes] = [self._load_piece(t) for t in range(self.n_vocab)]
        # Callers' threads tokenize (and probe grammars) at once; close() waits until
        # they are done, so the vocabulary is never freed under them.
        self._readers = _Readers()
        self._specials = self._special_texts()
        self._chat = None if draft else self._chat_formatter()
        self.has_chat_template: bool = self._chat is not None
        # What the template speaks (its tool-call format) and renders: probed once.
        self.chat_info: TemplateInfo | None = (
            detect(self._chat.source, lambda m, tools: self._render(m, None, True, tools))
            if self._chat is not None
            else None
        )
        self.n_decode_calls = 0
        self._token_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._candidates = _candidates(self.n_vocab)
        self._one = _candidates(1)
        self._init_batch(self.n_batch)

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

    def _special_texts(self) -> dict[str, int]:
        """The text of every token that tokenizing with ``parse_special`` matches, to its id."""
        special = (
            _lc.LLAMA_TOKEN_ATTR_CONTROL | _lc.LLAMA_TOKEN_ATTR_USER_DEFINED | _lc.LLAMA_TOKEN_ATTR_UNKNOWN
        )
        texts: dict[str, int] = {}
        for token in range(self.n_vocab):
            if _lc.llama_vocab_get_attr(self._vocab, token) & special:
                text = _lc.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")
                if text:
                    texts.setdefault(text, token)
        return texts

    def _chat_formatter(self) -> ChatTemplate | None:
        # Rendered as the formatter llama_cpp.Llama builds from the GGUF metadata, so chat
        # prompts render (and so tokenize) exactly as create_chat_completion's do; a
        # custom template renders the same way, with the same variables.
        if self._custom_template is not None:
            template = self._custom_template
        else:
            raw = _lc.llama_model_chat_template(self._model, None)
            if not raw:
                return None
            template = raw.decode("utf-8")

        def text(token: int) -> str:
            return (
                "" if token == -1 else _lc.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")
            )

        return ChatTemplate(
            template, bos_token=text(self._bos), eos_token=text(_lc.llama_vocab_eos(self._vocab))
        )

    def render_chat(
        self,
        messages: list[dict[str, str]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt for ``messages`` under the chat template (thread-safe): the model's
        own, or the server's ``chat_template``.

        ``template_kwargs`` (checked, as a request's) are the template's variables, over
        the server's ``chat_template_kwargs``; each render gets its own copy. Without
        ``add_generation_prompt`` the assistant's turn is not opened (a final assistant
        message is still a prefill); ``tools`` (checked) go to the template's ``tools``.
        """
        history, suffix = prefill(messages)
        add = add_generation_prompt or len(history) < len(messages)  # a prefill opens the turn
        return self._render(history, template_kwargs, add, tools) + suffix

    def _render(
        self,
        messages: list[dict[str, str]],
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if self._chat is None:
            raise InvalidRequest("the model has no chat template")
        # llama.cpp's extra context (common_chat_extra_context): templates that print the
        # date find today's, under the server's and the request's own variables.
        now = time.localtime()
        today = {"datetime": time.strftime("%b %d %Y", now), "date_string": time.strftime("%d %b %Y", now)}
        variables = template_variables({**today, **self._template_defaults, **(template_kwargs or {})})
        plain_tools = template_variables({"tools": tools})["tools"] if tools else None
        try:
            return self._chat.render(
                messages, variables, add_generation_prompt=add_generation_prompt, tools=plain_tools
            )
        except Exception as e:  # the template's raise_exception, or a Jinja error
            raise InvalidRequest(f"the chat template refused these messages: {e}") from None

    def _chat_render(
        self, message: Chat | StreamChat
    ) -> tuple[TemplateInfo, tuple[list[dict[str, Any]], str, dict[str, Any], bool, Any, str]]:
        """A chat request rendered (any thread): the template's info, then the history,
        the prefill suffix, the variables, whether the turn is opened, the tools the
        template describes, and the rendered text (without the suffix)."""
        info = self.chat_info
        if info is None:
            raise InvalidRequest("the model has no chat template")
        tools, choice = message.tools, message.tool_choice or "auto"
        variables = dict(message.template_kwargs or {})
        if info.enable_thinking and "enable_thinking" not in {**self._template_defaults, **variables}:
            # As llama-server: a template that can think does, unless its budget is 0.
            variables["enable_thinking"] = message.reasoning_budget != 0
        described = template_tools(tools, info)
        history, suffix = prefill(template_messages(message.messages, info, tools, choice))
        add = message.add_generation_prompt or bool(suffix)
        rendered = self._render(history, variables, add, described)
        return info, (history, suffix, variables, add, described, rendered)

    def render_chat_request(self, message: Chat | StreamChat) -> str:
        """The prompt text of a chat request, tools and tool calls as its tokens will
        have them (any thread)."""
        _, (_, suffix, _, _, _, rendered) = self._chat_render(message)
        return rendered + suffix

    def chat_prompt(
        self, message: Chat | StreamChat, reasoning_format: str = "auto"
    ) -> tuple[list[int], ToolGrammar | None, ReplySpec | None]:
        """A chat request's prompt tokens, its tool grammar (or None) and how to read
        its reply (None: the text is the content), in the caller's thread.

        ``reasoning_format`` is the server's default for requests that set none.

        Raises:
            InvalidRequest: the template refuses the chat, a tool is refused, or a
                field other than content spells a special token.
        """
        info, r = self._chat_render(message)
        history, suffix, variables, add, described, rendered = r
        tools, choice = message.tools, message.tool_choice or "auto"
        reasoning = (message.reasoning_format or reasoning_format) != "none"
        syntax = info.syntax
        thinking = bool(
            reasoning and syntax.think and not suffix and rendered.rstrip().endswith(syntax.think[0])
        )
        grammar = chat_grammar(
            info,
            tools=tools,
            choice=choice,
            parallel=message.parallel_tool_calls,
            convert=lambda schema: grammar_for_schema(schema, self.json_schema_grammar),
            thinking=thinking,
            response_schema=message.json_schema,
        )
        if not message.parse_special and described:
            check_fields([{"role": "tools", "tools": described}], self._specials)
        prompt = chat_tokens(
            history,
            message.parse_special,
            lambda chat: self._render(chat, variables, add, described),
            self._specials,
            lambda text, special: self.tokenize(text, add_special=False, parse_special=special),
            suffix,
            rendered=rendered,
        )
        tools_on = bool(tools) and choice != "none"
        # GPT-OSS's channels and a reply that opens after Functionary's ">>>" need reading
        # even without tools: their markers are never content.
        structured = syntax.body == "channels" or syntax.opened
        if not tools_on and not (reasoning and syntax.think) and not structured:
            return prompt, None, None
        spec = ReplySpec(
            syntax, tools=tools_on, reasoning=reasoning, thinking=thinking, param_types=param_types(tools)
        )
        return prompt, grammar, spec

    def tokenize_chat(
        self,
        messages: list[dict[str, str]],
        parse_special: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt tokens of a chat (thread-safe), as ``create_chat_completion`` makes them.

        Special tokens come only from the template: text inside message content that
        spells one (``<|im_start|>system``) is tokenized as text, so no message can forge
        another role, unless ``parse_special`` allows it. ``template_kwargs`` and
        ``add_generation_prompt`` are as :meth:`render_chat`'s.
        """
        history, suffix = prefill(messages)
        add = add_generation_prompt or len(history) < len(messages)
        return chat_tokens(
            history,
            parse_special,
            lambda chat: self._render(chat, template_kwargs, add),
            self._specials,
            lambda text, special: self.tokenize(text, add_special=False, parse_special=special),
            suffix,
        )

    def is_single_token(self, piece: str) -> bool:
        """Whether ``piece`` (a grammar's ``<piece>``) is exactly one token (thread-safe)."""
        return len(self.tokenize(piece, add_special=False, parse_special=True)) == 1

    @staticmethod
    def json_schema_grammar(schema: object) -> str:
        """A GBNF grammar that admits exactly the JSON documents valid under ``schema``."""
        try:
            return str(json_schema_to_gbnf(json.dumps(schema)))
        except Exception as e:
            raise InvalidRequest(f"json_schema cannot be converted to a grammar: {e!r}") from None

    # -- the batch ---------------------------------------------------------------

    def _init_batch(self, size: int) -> None:
        # Our own arrays instead of llama_batch_init: one flat seq_id array (a slot's
        # token belongs to exactly one sequence) behind a fixed array of pointers, so
        # the engine fills the batch with numpy slices and never follows a pointer.
        self.tokens: npt.NDArray[np.int32] = np.zeros(size, dtype=np.int32)
        self.pos: npt.NDArray[np.int32] = np.zeros(size, dtype=np.int32)
        self.seq_ids: npt.NDArray[np.int32] = np.zeros(size, dtype=np.int32)
        self.logits: npt.NDArray[np.int8] = np.zeros(size, dtype=np.int8)
        self._n_seq_id = np.ones(size, dtype=np.int32)
        int_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq_ids.ctypes.data
        self._seq_ptrs = (int_p * size)(*(ctypes.cast(base + 4 * i, int_p) for i in range(size)))
        self._batch = self._batch_view(0)

    def _batch_view(self, start: int) -> Any:
        batch: Any = _lc.llama_batch()
        int_p = ctypes.POINTER(ctypes.c_int32)
        batch.token = ctypes.cast(self.tokens.ctypes.data + 4 * start, int_p)
        batch.embd = None
        batch.pos = ctypes.cast(self.pos.ctypes.data + 4 * start, int_p)
        batch.n_seq_id = ctypes.cast(self._n_seq_id.ctypes.data + 4 * start, int_p)
        batch.seq_id = ctypes.cast(
            ctypes.addressof(self._seq_ptrs) + ctypes.sizeof(int_p) * start, ctypes.POINTER(int_p)
        )
        batch.logits = ctypes.cast(self.logits.ctypes.data + start, ctypes.POINTER(ctypes.c_int8))
        return batch

    def decode(self, start: int, end: int) -> int:
        """Run ``llama_decode`` on batch rows ``[start, end)``; returns its code.

        The caller guarantees ``0 <= start < end <= n_batch``, seq ids within
        ``[0, n_seq_max)`` and contiguous positions per sequence.
        """
        self.n_decode_calls += 1
        if faults.decode is not None:
            injected = faults.decode(self.n_decode_calls)
            if injected is not None:
                return injected
        batch = self._batch if start == 0 else self._batch_view(start)
        batch.n_tokens = end - start
        return int(_lc.llama_decode(self._ctx, batch))

    def decode_embeddings(self, n_rows: int) -> tuple[int, npt.NDArray[np.float32] | None]:
        """``llama_decode`` of batch rows ``[0, n_rows)`` with embeddings on; its code and,
        when 0, a copy of every row's embedding, shape ``(n_rows, n_embd)``.

        Every row must ask for output (with embeddings on llama.cpp outputs them all
        anyway, and logs a warning per row that did not ask). Outputs come back in batch
        order. Embeddings are off again on return: the next generation pass computes
        logits only where asked.
        """
        _lc.llama_set_embeddings(self._ctx, True)
        try:
            code = self.decode(0, n_rows)
            if code != 0:
                return code, None
            pointer = _lc.llama_get_embeddings(self._ctx)
            if not pointer:
                return -1, None
            return code, np.ctypeslib.as_array(pointer, shape=(n_rows, self.n_embd)).copy()
        finally:
            _lc.llama_set_embeddings(self._ctx, False)

    def time_passes(self, sizes: Sequence[int], seq_id: int, repeats: int = 1) -> dict[int, float]:
        """The least time in ms of ``repeats`` forward passes of each size in ``sizes``,
        every row with logits, on ``seq_id`` at positions from 0; the sequence is
        cleared after each (engine thread, while ``seq_id`` holds nothing).

        A speculating engine prices draft rows with it before its first tick. Sizes over
        ``n_batch`` are skipped; a pass that fails ends the timing with what it has.
        """
        sizes = sorted({n for n in sizes if 1 <= n <= self.n_batch})
        if not sizes:
            return {}
        times: dict[int, float] = {}
        batch = self._batch
        for i, n in enumerate(sizes[:1] + sizes * repeats):  # the first pass warms up
            put_rows(self, 0, seq_id, np.arange(n, dtype=np.int32) % self.n_vocab, 0, logits=True)
            batch.n_tokens = n
            t0 = time.perf_counter()
            code = int(_lc.llama_decode(self._ctx, batch))
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            self.seq_clear(seq_id)
            if code != 0:
                break
            if i:
                times[n] = min(times.get(n, math.inf), elapsed_ms)
        return times

    # -- sampling ----------------------------------------------------------------

    def make_sampler(
        self,
        params: SamplingParams,
        logit_bias: dict[int, float] | None,
        history: list[int],
        triggers: Triggers | None = None,
    ) -> _Greedy | SamplerChain:
        """Build a sampler for one request; raises ``InvalidRequest`` on a bad grammar.

        With ``triggers`` the grammar is lazy: it constrains nothing until the reply
        matches one of the trigger patterns or samples one of the trigger tokens, and
        everything from there (a tool call's marker on) after.

        ``history`` is the prompt: its tail feeds the repetition penalties. Plain greedy
        sampling (no penalties, no grammar) skips llama.cpp's sampler chain, which
        copies the whole vocabulary into a candidate array for every token: an argmax
        over a numpy view of the logits picks the same token (the first maximum).
        """
        penalties_off = (
            params.penalty_repeat == 1.0 and not params.penalty_freq and not params.penalty_present
        )
        # Below GREEDY_TEMP every logit / temp overflows a float in llama.cpp's temperature
        # sampler, which then picks among infinities: it is greedy in all but name.
        greedy = params.temp < GREEDY_TEMP
        if greedy and params.grammar is None and penalties_off:
            return _Greedy(logit_bias)
        chain = SamplerChain()
        try:
            if logit_bias or not penalties_off:
                filters = chain.filters = _lc.llama_sampler_chain_init(
                    _lc.llama_sampler_chain_default_params()
                )
                if logit_bias:
                    _lc.llama_sampler_chain_add(filters, self._logit_bias_sampler(logit_bias))
                if not penalties_off:
                    # A window past the context means the context; llama.cpp allocates it.
                    last_n = (
                        self.n_ctx if params.penalty_last_n == -1 else min(params.penalty_last_n, self.n_ctx)
                    )
                    penalties = _lc.llama_sampler_init_penalties(
                        self.n_vocab,
                        last_n,
                        params.penalty_repeat,
                        params.penalty_freq,
                        params.penalty_present,
                    )
                    # Only the penalties see the prompt: accepting it on the whole chain
                    # would walk a grammar through tokens it never produced.
                    for token in history[-last_n:] if last_n > 0 else []:
                        _lc.llama_sampler_accept(penalties, token)
                    _lc.llama_sampler_chain_add(filters, penalties)
            if params.grammar is not None:
                chain.grammar = self._grammar_sampler(params.grammar, triggers)
            select = chain.select = _lc.llama_sampler_chain_init(_lc.llama_sampler_chain_default_params())
            if greedy:
                chain.greedy = True
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_greedy())
            else:
                seed = _lc.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
                if params.top_k > 0:
                    _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_top_k(params.top_k))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_top_p(params.top_p, 1))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_min_p(params.min_p, 1))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_temp(params.temp))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_dist(seed))
        except BaseException:
            chain.free()
            raise
        return chain

    def _logit_bias_sampler(self, logit_bias: dict[int, float]) -> Any:
        biases: Any = (_lc.llama_logit_bias * len(logit_bias))()
        for i, (token, bias) in enumerate(logit_bias.items()):
            biases[i].token = token
            biases[i].bias = bias if math.isfinite(bias) else -math.inf
        return _lc.llama_sampler_init_logit_bias(self.n_vocab, len(logit_bias), biases)

    def _grammar_sampler(self, grammar: str, triggers: Triggers | None = None) -> Any:
        """A grammar sampler of an already checked grammar (any thread, vocab held open);
        lazy, waiting for one of ``triggers``, when given."""
        if triggers is not None:
            patterns, tokens = triggers
            c_patterns = (ctypes.c_char_p * max(len(patterns), 1))(*[p.encode() for p in patterns])
            c_tokens = (_lc.llama_token * max(len(tokens), 1))(*tokens)
            sampler = _lc.llama_sampler_init_grammar_lazy_patterns(
                self._vocab, grammar.encode(), b"root", c_patterns, len(patterns), c_tokens, len(tokens)
            )
        else:
            sampler = _lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            raise InvalidRequest("grammar does not parse (llama.cpp logs the reason)")
        return sampler

    def probe_grammar(self, grammar: str, logit_bias: dict[int, float] | None) -> float:
        """Check a grammar against the vocabulary in the caller's thread; its cost in ms.

        Builds the grammar (with the request's logit biases) on its own, applies it once
        to the whole vocabulary as the first token of a request would, and frees it.
        Raises ``InvalidRequest`` when no token is allowed at the start: such a request
        could never produce anything (thread-safe; never touches the context).
        """
        with self._readers.reading():
            chain = _lc.llama_sampler_chain_init(_lc.llama_sampler_chain_default_params())
            try:
                if logit_bias:
                    _lc.llama_sampler_chain_add(chain, self._logit_bias_sampler(logit_bias))
                _lc.llama_sampler_chain_add(chain, self._grammar_sampler(grammar))
                candidates, array = _candidates(self.n_vocab)
                candidates["id"] = np.arange(self.n_vocab, dtype=np.int32)
                # CPU time of this thread, not wall time: a busy machine must not make
                # an ordinary grammar look costly.
                t0 = time.thread_time()
                _lc.llama_sampler_apply(chain, ctypes.byref(array))
                cost_ms = (time.thread_time() - t0) * 1000.0
            finally:
                _lc.llama_sampler_free(chain)
        if not (candidates["logit"] > -np.inf).any():
            raise InvalidRequest("the grammar (with this logit_bias) allows no token at the start")
        return cost_ms

    def _logits(self, index: int) -> npt.NDArray[np.float32]:
        """A writable numpy view of batch row ``index``'s logits in llama.cpp's buffer."""
        return np.ctypeslib.as_array(_lc.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))

    def sample(self, sampler: _Greedy | SamplerChain, index: int, *, ban_eog: bool = False) -> int:
        """Sample (and accept) a token from the logits of batch row ``index``.

        ``ban_eog`` makes every end-of-generation token impossible (``min_tokens``,
        ``ignore_eos``). llama.cpp never sees a choice without an allowed token: its
        grammar sampler aborts the process when asked to accept one. Such a dead end
        raises :class:`DeadEnd` instead, and nothing is accepted.
        """
        if faults.sample is not None:
            faults.sample(index)
        logits = self._logits(index)
        if isinstance(sampler, _Greedy):
            return sampler.pick(logits, self.eog_array if ban_eog else None)
        if sampler.greedy and sampler.grammar is not None:
            token = self._greedy_if_grammatical(sampler, logits, ban_eog)
            if token >= 0:
                return token
        # llama_sampler_sample's own steps, split: the filters (bias, penalties) and the
        # grammar mark what is allowed; the dead end is caught before the selection
        # (greedy, or top-k ... dist) picks; then each accepts the token.
        candidates, array = self._fill(logits)
        allowed = candidates["logit"]
        if sampler.filters is not None:
            _lc.llama_sampler_apply(sampler.filters, ctypes.byref(array))
        if sampler.grammar is not None:
            t0 = time.thread_time()  # CPU time: contention must not count against the grammar
            _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
            sampler.grammar_ms = (time.thread_time() - t0) * 1000.0
        eog_allowed = False
        if ban_eog:
            eog_allowed = bool((allowed[self.eog_array] > -np.inf).any())
            allowed[self.eog_array] = -np.inf
        if (sampler.filters is not None or sampler.grammar is not None or ban_eog) and not (
            allowed > -np.inf
        ).any():
            raise DeadEnd(eog_allowed)
        _lc.llama_sampler_apply(sampler.select, ctypes.byref(array))
        selected = int(array.selected)
        if not 0 <= selected < int(array.size) or not candidates["logit"][selected] > -np.inf:
            raise DeadEnd(False)
        token = int(candidates["id"][selected])
        sampler.accept(token)
        return token

    def force(self, sampler: _Greedy | SamplerChain, token: int) -> bool:
        """Take ``token`` as sampled without sampling (a spent thinking budget's close):
        accepted by the sampler's grammar and penalties, if its grammar allows it (one
        it does not allow would abort llama.cpp); False, and nothing accepted, if not."""
        if not 0 <= token < self.n_vocab:
            return False
        if isinstance(sampler, SamplerChain) and sampler.grammar is not None:
            one, one_array = self._one
            one["id"][0], one["logit"][0], one["p"][0] = token, 0.0, 0.0
            one_array.size, one_array.selected, one_array.sorted = 1, -1, False
            _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(one_array))
            if not one["logit"][0] > -np.inf:
                return False
        if isinstance(sampler, SamplerChain):
            sampler.accept(token)
        return True

    def _fill(self, logits: npt.NDArray[np.float32]) -> tuple[npt.NDArray[Any], Any]:
        """The shared candidate array, filled with every token's logit in id order."""
        candidates, array = self._candidates
        candidates["id"] = self._token_ids
        candidates["logit"] = logits
        array.size, array.selected, array.sorted = self.n_vocab, -1, False
        return candidates, array

    def _greedy_if_grammatical(
        self, sampler: SamplerChain, logits: npt.NDArray[np.float32], ban_eog: bool
    ) -> int:
        """Greedy with a grammar, llama.cpp's fast way: the argmax of the unconstrained
        logits, accepted if the grammar allows it (one candidate to check instead of the
        whole vocabulary); -1 when it does not, and the full path must run. The result
        is the same token: the argmax of the allowed ones."""
        if sampler.filters is not None:
            candidates, array = self._fill(logits)
            _lc.llama_sampler_apply(sampler.filters, ctypes.byref(array))
            allowed = candidates["logit"]
        else:  # nothing to filter: the logits themselves (a copy only to ban the end)
            allowed = logits.copy() if ban_eog else logits
        if ban_eog:
            allowed[self.eog_array] = -np.inf
        token = int(np.argmax(allowed))
        if not allowed[token] > -np.inf:
            return -1
        one, one_array = self._one
        one["id"][0], one["logit"][0], one["p"][0] = token, allowed[token], 0.0
        one_array.size, one_array.selected, one_array.sorted = 1, -1, False
        t0 = time.thread_time()
        _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(one_array))
        sampler.grammar_ms = (time.thread_time() - t0) * 1000.0
        if not one["logit"][0] > -np.inf:
            return -1
        sampler.accept(token)
        return token

    def top_token(self, index: int) -> tuple[int, float]:
        """Batch row ``index``'s most likely token and its probability (the softmax of
        the raw logits): a draft model's greedy pick and its confidence."""
        logits = self._logits(index)
        token = int(np.argmax(logits))
        top = logits[token]
        if not np.isfinite(top):
            return token, 0.0
        return token, float(1.0 / np.exp(logits - top, dtype=np.float32).sum(dtype=np.float64))

    def vocabulary_differs(self, other: LlamaBackend) -> str | None:
        """Why ``other``'s tokens do not mean this model's (a draft model must share the
        vocabulary), or None when every token's text and the special tokens agree."""
        if other.n_vocab != self.n_vocab:
            return f"{other.n_vocab} tokens against {self.n_vocab}"
        if other._add_bos != self._add_bos or (self._add_bos and other._bos != self._bos):
            return "a different beginning-of-sequence token"
        if other.eog_ids != self.eog_ids:
            return "different end-of-generation tokens"
        differ = next((t for t in range(self.n_vocab) if other._pieces[t] != self._pieces[t]), None)
        if differ is not None:
            return f"token {differ} is {other._pieces[differ]!r} against {self._pieces[differ]!r}"
        return None

    def logprobs(self, index: int, k: int) -> tuple[npt.NDArray[np.float64], list[tuple[int, float]]]:
        """Log-softmax of row ``index``'s raw logits, and its ``k`` largest entries.

        Call before :meth:`sample`, which may overwrite banned logits.
        """
        logits = self._logits(index).astype(np.float64)
        top = logits.max()
        log_softmax = logits - (top + np.log(np.exp(logits - top).sum()))
        best: list[tuple[int, float]] = []
        if k > 0:
            ids = np.argpartition(log_softmax, -k)[-k:]
            ids = ids[np.argsort(-log_softmax[ids], kind="stable")]
            best = [(int(i), float(log_softmax[i])) for i in ids]
        return log_softmax, best

    def sampled_probs(
        self, sampler: _Greedy | SamplerChain, token: int, k: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """The probability ``token`` had in the distribution the last :meth:`sample` with
        ``sampler`` drew it from, and that distribution's ``k`` likeliest tokens with a
        probability above 0 (llama-server's ``post_sampling_probs``).

        The distribution is the one after the whole chain: what llama.cpp's ``dist``
        sampler left in the candidate array (its samplers shrink and reorder the array in
        place, never moving its data). Greedy sampling is one-hot. Call right after
        :meth:`sample` (the actor thread).
        """
        if isinstance(sampler, _Greedy) or sampler.greedy:
            return 1.0, [(token, 1.0)] if k > 0 else []
        candidates, array = self._candidates
        kept = candidates[: int(array.size)]
        ids, probs = kept["id"], kept["p"]
        chosen = probs[ids == token]
        order = np.argsort(-probs, kind="stable")[:k]
        top = [(int(ids[i]), float(probs[i])) for i in order if probs[i] > 0.0]
        return (float(chosen[0]) if chosen.size else 0.0), top

    @staticmethod
    def free_sampler(sampler: _Greedy | SamplerChain) -> None:
        """Free a sampler made by :meth:`make_sampler`."""
        if isinstance(sampler, SamplerChain):
            sampler.free()

    # -- KV memory ---------------------------------------------------------------

    def seq_trim(self, seq_id: int, keep: int) -> bool:
        """Drop the KV of ``seq_id`` from position ``keep`` on; False if refused."""
        return bool(_lc.llama_memory_seq_rm(self._memory, seq_id, keep, -1))

    def seq_remove(self, seq_id: int, p0: int, p1: int) -> bool:
        """Drop the KV of ``seq_id`` at positions ``[p0, p1)``, later ones stay where they
        are; False if refused (memory that cannot drop a middle range)."""
        return bool(_lc.llama_memory_seq_rm(self._memory, seq_id, p0, p1))

    def seq_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Tag ``src``'s cells at positions ``[p0, p1)`` with ``dst`` too (unified KV: no
        new cells, no compute). ``dst`` must hold no position in that range."""
        _lc.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position ``seq_id`` holds in the KV cache, -1 when it holds none."""
        return int(_lc.llama_memory_seq_pos_max(self._memory, seq_id))

    def seq_clear(self, seq_id: int) -> None:
        """Drop all KV of ``seq_id``."""
        _lc.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    @property
    def can_shift(self) -> bool:
        """Whether the memory can move positions (needed for a context shift)."""
        return bool(_lc.llama_memory_can_shift(self._memory))

    def seq_shift(self, seq_id: int, n_keep: int, n_discard: int, n_past: int) -> None:
        """Drop positions ``[n_keep, n_keep + n_discard)`` and move the rest back to close the gap."""
        _lc.llama_memory_seq_rm(self._memory, seq_id, n_keep, n_keep + n_discard)
        _lc.llama_memory_seq_add(self._memory, seq_id, n_keep + n_discard, n_past, -n_discard)

    def seq_save(self, seq_id: int) -> bytes:
        """A copy of ``seq_id``'s KV state in host memory."""
        size = _lc.llama_state_seq_get_size(self._ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        n = _lc.llama_state_seq_get_data(self._ctx, buf, size, seq_id)
        return bytes(buf)[:n]

    def seq_restore(self, seq_id: int, state: bytes) -> bool:
        """Load a state made by :meth:`seq_save` into ``seq_id``; False if refused."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return bool(_lc.llama_state_seq_set_data(self._ctx, buf, len(state), seq_id))

    # -- vocabulary (thread-safe) -----------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenize as ``llama_cpp.Llama.create_completion`` does (thread-safe).

        ``add_special``: a BOS token when the model's metadata asks for one;
        ``parse_special``: special tokens such as ``<|im_start|>`` written in the text
        become their ids.

        Raises:
            InvalidRequest: ``text`` is not a str of valid Unicode (a lone surrogate).
            EngineStopped: the model was unloaded.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"can only tokenize a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"text is not valid Unicode: a lone surrogate at index {e.start}") from None
        capacity = len(data) + 8
        with self._readers.reading():
            self._check_open()
            while True:
                buf = (_lc.llama_token * capacity)()
                n = _lc.llama_tokenize(
                    self._vocab, data, len(data), buf, capacity, False, bool(parse_special)
                )
                if n >= 0:
                    break
                capacity = -n
        tokens = list(buf[:n])
        return [self._bos, *tokens] if add_special and self._add_bos else tokens

    def detokenize(self, tokens: list[int]) -> str:
        """Text of ``tokens``, special tokens rendered (thread-safe); bad bytes become U+FFFD."""
        bad = [
            t
            for t in tokens
            if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.n_vocab)
        ]
        if bad:
            raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary (n_vocab={self.n_vocab})")
        ids = (_lc.llama_token * max(len(tokens), 1))(*tokens)
        capacity = 8 * len(tokens) + 16
        with self._readers.reading():
            self._check_open()
            while True:
                buf = ctypes.create_string_buffer(capacity)
                n = _lc.llama_detokenize(self._vocab, ids, len(tokens), buf, capacity, False, True)
                if n >= 0:
                    break
                capacity = -n
        return buf.raw[:n].decode("utf-8", errors="replace")

    def _check_open(self) -> None:
        if not self._model:
            raise EngineStopped("the model was unloaded (its engine stopped)")

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated text (special tokens render empty)."""
        return self._pieces[token]

    def special_piece(self, token: int) -> bytes:
        """The bytes of one token with special tokens spelled out (``[TOOL_CALLS]``): for
        the markers a reply parser reads (engine thread)."""
        buf = ctypes.create_string_buffer(256)
        n = _lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)]

    def special_token(self, text: str) -> int | None:
        """The special token spelled ``text``, if the vocabulary has one (any thread)."""
        return self._specials.get(text)

    def _load_piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = _lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:  # a piece longer than the buffer: -n is the size it needs
            buf = ctypes.create_string_buffer(-n)
            n = _lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[: max(n, 0)]

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


class SamplerChain:
    """One request's llama.cpp samplers: the filters (logit bias, penalties), the
    grammar, then the selection (greedy, or top-k, top-p, min-p, temperature and dist)."""

    __slots__ = ("filters", "grammar", "grammar_ms", "greedy", "select")

    def __init__(self) -> None:
        self.filters: Any = None
        self.grammar: Any = None
        self.select: Any = None
        self.greedy = False
        self.grammar_ms = 0.0  # CPU time of the grammar's last check

    @property
    def has_grammar(self) -> bool:
        return self.grammar is not None

    def accept(self, token: int) -> None:
        """Every sampler records the chosen token (penalties count it, the grammar moves)."""
        for sampler in (self.filters, self.grammar, self.select):
            if sampler:
                _lc.llama_sampler_accept(sampler, token)

    def free(self) -> None:
        for sampler in (self.filters, self.grammar, self.select):
            if sampler:
                _lc.llama_sampler_free(sampler)
        self.filters = self.grammar = self.select = None


_CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _CANDIDATE.itemsize == ctypes.sizeof(_lc.llama_token_data)


def _candidates(n_vocab: int) -> tuple[npt.NDArray[Any], Any]:
    """A zeroed ``llama_token_data`` array in numpy and the ``llama_token_data_array`` over it."""
    candidates = np.zeros(n_vocab, dtype=_CANDIDATE)
    array = _lc.llama_token_data_array(
        data=ctypes.cast(candidates.ctypes.data, _lc.llama_token_data_p),
        size=n_vocab,
        selected=-1,
        sorted=False,
    )
    return candidates, array
