"""Loading a ServerActor's model (and its draft model) and saying what was loaded.

Runs in the actor's thread (``on_start``); nothing here keeps state. A failure closes
what it loaded and raises: the actor records the crash and answers its inbox.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from actors.backend import BackendOptions, LlamaBackend, exact_attention
from actors.contract import ConfigError, InvalidRequest, SamplingParams, check_grammar

__all__ = ["engine_info", "load_draft", "load_model"]

_log = logging.getLogger("llama_cpp_actors.server")


def load_model(
    options: BackendOptions,
    progress: Callable[[float], None],
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any],
    default_grammar: str | None,
) -> LlamaBackend:
    """The model and its context, the server's default grammar checked against its
    vocabulary (actor thread).

    Raises:
        ConfigError: the default grammar does not fit the model.
        ModelLoadError: llama.cpp could not load the model or make the context.
    """
    backend = LlamaBackend(
        options,
        on_progress=progress,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        lora=options.lora,
    )
    if default_grammar is not None:  # its <piece> tokens need the vocabulary
        try:
            check_grammar(default_grammar, is_single_token=backend.vocab.is_single_token)
        except InvalidRequest as e:
            backend.close()
            raise ConfigError(f"the default grammar does not fit this model: {e}") from None
    if options.n_batch > backend.n_batch:  # llama.cpp clamps; keep it honest
        _log.warning("n_batch clamped by llama.cpp to %d", backend.n_batch)
    if options.flash_attn is False or not exact_attention():
        why = "is off" if options.flash_attn is False else "is llama.cpp's stock kernel"
        _log.warning(
            "flash attention %s: a request's numbers may change with the batch and the cache "
            "path that serves it (make install builds the batch-invariant kernel; see "
            "docs/design/invariance.md)",
            why,
        )
    return backend


def load_draft(target: LlamaBackend, options: BackendOptions | None) -> LlamaBackend | None:
    """The draft model's backend, its vocabulary checked against the target's (actor
    thread); None without ``spec_type="draft"``.

    Raises:
        ConfigError: the draft model's vocabulary differs from the model's.
    """
    if options is None:
        return None
    # No chat template, no recurrent model, no adapters (they adapt the target only).
    draft = LlamaBackend(dataclasses.replace(options, lora=()), draft=True)
    differs = target.vocab.differs(draft.vocab)
    if differs is not None:
        draft.close()
        raise ConfigError(
            f"the draft model {options.model_path!r} does not share the model's vocabulary: {differs}"
        )
    return draft


def engine_info(
    options: BackendOptions, defaults: SamplingParams, backend: LlamaBackend | None
) -> dict[str, Any]:
    """What ``GetInfo`` answers: the model, its context and the sampling defaults."""
    assert backend is not None
    return {
        "model_path": options.model_path,
        "n_vocab": backend.vocab.n_vocab,
        "n_ctx_train": backend.n_ctx_train,
        "has_chat_template": backend.chat.has_template,
        # How the chat template writes tool calls ("generic" for one that knows none),
        # and whether it thinks: what a chat with tools is constrained and parsed by.
        "chat_format": backend.chat.info.syntax.name if backend.chat.info else None,
        "chat_thinks": bool(backend.chat.info and backend.chat.info.syntax.think),
        "n_ctx": backend.n_ctx,
        "n_parallel": backend.n_seq_max,
        "n_batch": backend.n_batch,
        "n_threads": options.n_threads,
        "lora": [
            {"id": i, "name": a.name, "path": a.path, "scale": a.scale} for i, a in enumerate(options.lora)
        ],
        # The sampling defaults a request's unset options take (grammar: whether one is set).
        "sampling": {
            f.name: getattr(defaults, f.name) if f.name != "grammar" else defaults.grammar is not None
            for f in dataclasses.fields(defaults)
        },
    }
